"""Streamed data (`datasets.IterableDataset`): the map-style recipes, applied lazily one bounded buffer at a time.

A stream has no length and cannot be indexed, so nothing can look at the whole dataset. Each recipe (SFT,
preference, KTO, prompts) is instead applied to consecutive buffers of `STREAM_BUFFER_ROWS` rows: a buffer becomes a
small in-memory `datasets.Dataset` and goes through exactly the map-style code (format detection, tokenisation,
truncation, drops, packing), inside `IterableDataset.map(batched=True)`; the trainer's split preparer
(trainers/parts/split_preparer.py) wraps the stream, once, so a recipe never sees one. There is one implementation of
each rule; a stream only decides what it sees at once.

Why bounded: memory and start-up time stay those of one buffer whatever the size of the stream, and rows leave as
soon as their buffer is prepared. What depends on more than one row sees one buffer: packing (BFD or `bfd_split`
over the buffer's sequences; `wrapped` cuts the buffer's concatenation, so each buffer ends with one shorter row),
KTO's mismatched KL completions (partners drawn inside the buffer) and SFT's `shuffle_dataset` (datasets' buffered
shuffle of the stream, seeded). With a buffer holding the whole dataset the result is the map-style one.

Counts: every drop and truncation is counted as in the map-style path, summed over the buffers read so far into the
split's live report (the trainer's `stream_reports`). They are known for the rows read: the train split's are
logged at the end of training, an eval split's after each evaluation (which reads it again from the start). The
format is checked when the trainer is built, on the stream's first buffer (read, prepared, and discarded). Counting
happens where the buffers are prepared: in the training process (with `dataloader_num_workers=0`).

Each process reads the stream itself (`dispatch_batches=False`, as TRL sets for streams). The online trainers take
their rounds of prompts from the stream in order (`online_trainer.StreamRounds`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging

import datasets

from .report import STREAM_BUFFER, NothingLeft

logger = logging.getLogger("leantune.data")

# Rows of the stream prepared (and packed) together. Large enough for BFD to fill rows as well as over the whole
# dataset (typically within a row or two per buffer), small enough to stay a fraction of a second of tokenisation.
STREAM_BUFFER_ROWS = 1000


def is_stream(dataset) -> bool:
    return isinstance(dataset, datasets.IterableDataset)


def require_max_steps(args) -> None:
    """A stream has no length, so the schedule cannot be derived from epochs (transformers refuses it later)."""
    if getattr(args, "max_steps", -1) is None or args.max_steps <= 0:
        raise ValueError("train_dataset is a stream (datasets.IterableDataset) and has no length: set `max_steps` "
                         "(> 0) to say how many optimizer steps to train.")


def use_own_stream_reads(args) -> None:
    """Each process reads the stream and keeps its own batches (accelerate's `dispatch_batches=False`, as TRL sets
    for streams): dispatching would concatenate batches of different widths and the per-batch counts, which fails.
    Called on the trainer's resolved copy of the config (its accelerator config is a copy too)."""
    check_own_stream_reads(args)
    args.accelerator_config = copy.copy(args.accelerator_config)
    args.accelerator_config.dispatch_batches = False


def check_own_stream_reads(args) -> None:
    """Refuse a config that dispatches batches; say that worker processes keep a stream's counts to themselves."""
    if getattr(args.accelerator_config, "dispatch_batches", None):
        raise ValueError("Iterable datasets require `dispatch_batches=False`: a stream (datasets.IterableDataset) is "
                         "read by each process on its own; set accelerator_config={'dispatch_batches': False}.")
    if args.dataloader_num_workers:
        logger.warning("Streamed data with dataloader_num_workers=%d: its buffers are prepared in the loader's worker "
                       "processes, so their drop and truncation counts stay there and are not reported; set "
                       "dataloader_num_workers=0 to see them.", args.dataloader_num_workers)


@contextlib.contextmanager
def quiet_buffer():
    """One buffer's preparation: its own log lines and progress bars are silenced (the summed counts are logged
    instead), and the recipes know they see a buffer (`report.in_stream_buffer`)."""
    data_logger = logging.getLogger("leantune.data")
    level, bars = data_logger.level, not datasets.are_progress_bars_disabled()
    data_logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    token = STREAM_BUFFER.set(True)
    try:
        yield
    finally:
        STREAM_BUFFER.reset(token)
        data_logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def add_counts(total, part) -> None:
    """Add one buffer's report to the split's: integer counts are summed, flags or-ed, the split name kept."""
    for field in dataclasses.fields(total):
        value = getattr(part, field.name)
        if isinstance(value, bool):
            setattr(total, field.name, getattr(total, field.name) or value)
        elif isinstance(value, int):
            setattr(total, field.name, getattr(total, field.name) + value)


def reset_counts(report) -> None:
    for field in dataclasses.fields(report):
        if field.name != "split" and isinstance(getattr(report, field.name), (int, bool)):
            setattr(report, field.name, type(getattr(report, field.name))())


def log_stream_report(report) -> None:
    logger.info("%s (streamed): the counts below are those of the rows read so far.", report.split)
    report.log(*getattr(report, "log_args", ()))


def buffer_dataset(rows_or_batch, features):
    if isinstance(rows_or_batch, list):
        return datasets.Dataset.from_list(rows_or_batch, features=features)
    return datasets.Dataset.from_dict(rows_or_batch, features=features)


def prepare_stream(stream, prepare, split: str, buffer_rows: int | None = None):
    """(lazily prepared stream, live report): `prepare(buffer: Dataset) -> (Dataset, report)` is the map-style
    recipe, applied to each buffer of `buffer_rows` rows (default `STREAM_BUFFER_ROWS`); its counts are summed into
    the live report. The first buffer is prepared once now so that format errors stop the trainer's construction."""
    buffer_rows = buffer_rows or STREAM_BUFFER_ROWS
    first = list(stream.take(buffer_rows))
    if not first:
        raise ValueError(f"The {split} dataset is empty (the stream yields no row).")
    features = stream.features
    with quiet_buffer():
        try:
            sample, sample_report = prepare(buffer_dataset(first, features))
        except NothingLeft as nothing:
            raise ValueError(f"The first {len(first)} rows of the {split} stream leave no example after "
                             f"preparation: {nothing.report.as_dict()}.") from nothing
    report = type(sample_report)(split=split)
    report.log_args = getattr(sample_report, "log_args", ())  # what the recipe's report logs with

    def prepare_buffer(batch: dict) -> dict:
        with quiet_buffer():
            try:
                prepared, part = prepare(buffer_dataset(batch, features))
            except NothingLeft as nothing:
                add_counts(report, nothing.report)
                return {}
        add_counts(report, part)
        return prepared.to_dict()

    prepared = stream.map(prepare_buffer, batched=True, batch_size=buffer_rows, remove_columns=list(first[0]),
                          features=sample.features)
    return prepared, report


def without_shuffle(args):
    """A copy of the config whose recipes do not shuffle (the stream is shuffled by its buffer instead)."""
    args = copy.copy(args)
    args.shuffle_dataset = False
    return args
