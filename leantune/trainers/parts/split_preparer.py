"""The split preparer: the train split and each eval split, prepared once by the method's recipe.

The recipe (`prepare_split(dataset, split, tokenizer, args) -> (prepared, report)`) sees map-style data only: a
stream (datasets.IterableDataset) is wrapped here, once, so that the recipe runs on one bounded buffer at a time
(data/streaming.py). Each prepared split is remembered (by fingerprint, or by identity for a stream, whose live report
counts the rows read so far), so data handed back to the trainer is never prepared twice.
"""

from __future__ import annotations

from collections.abc import Callable

from ...data.map_fingerprints import tokenizer_for_maps
from ...data.streaming import check_own_stream_reads, is_stream, prepare_stream


class SplitPreparer:
    """`recipe`: the method's preparation of one map-style split; `stream_order(stream, split, args)` -> (stream,
    buffer args): how a stream is read before its buffers are prepared (SFT's buffered shuffle); `prepared_columns`:
    columns whose presence marks data as already prepared."""

    def __init__(self, recipe: Callable, prepared_columns: tuple[str, ...] = (), stream_order: Callable | None = None,
                 skips_preparation: bool = False):
        self.recipe = recipe
        self.prepared_columns = prepared_columns
        self.stream_order = stream_order
        self.skips_preparation = skips_preparation
        self.reports: dict = {}  # the preparation report of each split, by split name
        self.stream_reports: dict = {}  # live reports of the streamed splits, by id of the prepared stream
        self.given_eval_splits: list = []  # (eval split as given, its prepared form), where the trainer keeps both
        self._fingerprints: set = set()

    def prepare(self, train_dataset, eval_dataset, tokenizer, args, keep_eval_as_given: bool = False):
        """(train, eval): `eval_dataset` is one dataset, or a dict / DatasetDict of named ones, each prepared
        (evaluation then reports `eval_<name>_...` per name). With `keep_eval_as_given` the eval splits stay as
        given, their prepared forms kept aside for evaluate()."""
        train_dataset = self.prepare_split(train_dataset, "train", tokenizer, args)
        given = eval_dataset
        if isinstance(eval_dataset, dict):  # a DatasetDict is a dict too
            eval_dataset = {name: self.prepare_split(data, f"eval_{name}", tokenizer, args)
                            for name, data in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self.prepare_split(eval_dataset, "eval", tokenizer, args)
        if keep_eval_as_given and given is not None:
            pairs = given.items() if isinstance(given, dict) else [(None, given)]
            self.given_eval_splits = [(data, eval_dataset[name] if name is not None else eval_dataset)
                                      for name, data in pairs]
            eval_dataset = given
        return train_dataset, eval_dataset

    def prepare_split(self, dataset, split: str, tokenizer, args):
        """One split, prepared by the recipe (a stream: lazily, buffer by buffer) and remembered."""
        tokenizer = tokenizer_for_maps(tokenizer)  # datasets hashes it into every map's fingerprint
        if getattr(dataset, "_format_type", None) == "custom" and not self.skips_preparation:
            raise ValueError(f"The {split} dataset has a Dataset.with_transform() / set_transform() transform, which "
                             "runs when rows are read, after preparation would have tokenised them. Apply it with "
                             "dataset.map() instead, or pass dataset_kwargs={'skip_prepare_dataset': True} (SFT) with "
                             "a transform that returns trainer-ready rows (input_ids, labels).")
        if is_stream(dataset) and not self.skips_preparation:
            stream, buffer_args = self.stream_order(dataset, split, args) if self.stream_order else (dataset, args)
            dataset, report = prepare_stream(
                stream, lambda buffer: self.recipe(buffer, split, tokenizer, buffer_args), split)
        else:
            dataset, report = self.recipe(dataset, split, tokenizer, args)
        if report is not None:
            self.reports[split] = report
        self.remember(dataset, report)
        return dataset

    def for_evaluation(self, dataset, split: str, trainer):
        """The prepared form of one dataset handed to evaluate(): kept aside at construction, already prepared, or
        prepared now by the same recipe (then the reference's `finish_eval_split`: precomputed log-probs). A stream first seen here is read by each
        process on its own, as at construction (the accelerator exists already, so it is told directly; the config
        stays as it is)."""
        prepared = self.prepared_form_of(dataset)
        if prepared is not None or trainer.is_prepared(dataset):
            return prepared if prepared is not None else dataset
        if is_stream(dataset):
            check_own_stream_reads(trainer.args)
            trainer.accelerator.dataloader_config.dispatch_batches = False
        dataset = self.prepare_split(dataset, split, trainer.processing_class, trainer.args)
        return trainer.reference.finish_eval_split(trainer, dataset, split)

    def remember(self, dataset, report=None) -> None:
        if is_stream(dataset):  # no fingerprint: known by identity; its live report is logged as it is read
            self._fingerprints.add(id(dataset))
            if report is not None:
                self.stream_reports[id(dataset)] = report
            return
        fingerprint = getattr(dataset, "_fingerprint", None)
        if fingerprint is not None:
            self._fingerprints.add(fingerprint)

    def is_prepared(self, dataset) -> bool:
        """Whether `dataset` is already prepared: one prepared here (same fingerprint), or one holding all of the
        `prepared_columns`."""
        fingerprint = id(dataset) if is_stream(dataset) else getattr(dataset, "_fingerprint", None)
        if fingerprint is not None and fingerprint in self._fingerprints:
            return True
        columns = set(getattr(dataset, "column_names", None) or ())
        return bool(self.prepared_columns) and set(self.prepared_columns) <= columns

    def prepared_form_of(self, given):
        """The prepared form of an eval split kept as given, or None."""
        return next((ready for data, ready in self.given_eval_splits if data is given), None)

    def stream_report_of(self, dataset):
        return self.stream_reports.get(id(dataset)) if is_stream(dataset) else None

