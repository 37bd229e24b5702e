"""The preference-data recipe (DPO, reward modelling): format, dropped pairs, tokenisation, truncation; all counted.

Truncation, in TRL's order: `max_prompt_length` keeps the end of the prompt (the part next to the answer) and
`max_completion_length` keeps the start of each completion; then `max_length` bounds prompt + completion. With
`truncation_mode="keep_start"` the completion is cut at its end; a pair whose prompt alone fills `max_length` has no
completion token left and is dropped (counted). With `"keep_end"` the prompt is cut from its start, by the same
amount for chosen and rejected so both keep one prompt, and a completion still too long is cut at its end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .chat_template import require_chat_template
from .formats import rename_legacy_token_columns
from .lengths import length_summary_line
from .preference_formats import (
    PreferenceFormat,
    PreferenceTokenizer,
    detect_preference_format,
    explicit_prompt_example,
    is_empty_completion,
)
from .report import NothingLeft, PreparationReport

logger = logging.getLogger("leantune.data")
TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


@dataclass
class PreferenceReport(PreparationReport):
    num_identical_dropped: int = 0
    num_identical_after_truncation_dropped: int = 0  # differed only in tokens that truncation cut
    num_prompt_truncated: int = 0
    num_completion_truncated: int = 0
    num_prompt_too_long_dropped: int = 0

    UNIT = "pair"
    OWN_NAMES = {"num_examples_in": "num_pairs_in", "num_examples_out": "num_pairs_out"}
    REASONS = {
        "num_empty_dropped": "with an empty chosen or rejected completion",
        "num_identical_dropped": "whose chosen and rejected are identical (no preference to learn)",
        "num_identical_after_truncation_dropped": "whose chosen and rejected differ only past the truncation point "
                                                  "(identical after truncation; raise max_length or "
                                                  "max_completion_length to keep them)",
        "num_prompt_too_long_dropped": "whose prompt alone fills max_length (no completion token left)",
    }

    def log(self) -> None:
        for name, reason in self.REASONS.items():
            if getattr(self, name):
                logger.warning("%s: dropped %d pair(s) of %d %s.", self.split, getattr(self, name),
                               self.num_examples_in, reason)
        if self.num_prompt_truncated or self.num_completion_truncated:
            logger.warning("%s: truncated %d prompt(s) and %d completion(s), dropping %d token(s).", self.split,
                           self.num_prompt_truncated, self.num_completion_truncated, self.tokens_dropped)
        self.log_summary()


def prepare_preference_dataset(dataset, tokenizer, args, split: str = "train", keep_columns: tuple[str, ...] = ()):
    """Return (dataset with prompt/chosen/rejected token ids, PreferenceReport).

    `keep_columns` (e.g. the reward trainer's per-pair `margin`) travel with their pairs through every drop.
    """
    if dataset is None:
        return None, None
    if type(dataset).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise ValueError(f"Pass one split as the {split} dataset, not a DatasetDict with {list(dataset)}.")
    report = PreferenceReport(split=split, num_examples_in=len(dataset))
    if report.num_examples_in == 0:
        raise ValueError(f"The {split} dataset is empty.")
    dataset = rename_legacy_token_columns(dataset)
    fmt = detect_preference_format(dataset)
    num_proc = args.dataset_num_proc
    if fmt.conversational:
        require_chat_template(tokenizer, "conversational preference data")
    if fmt is not PreferenceFormat.TOKENIZED:
        dataset = _drop_unusable_pairs(dataset, fmt, report, num_proc)
        if len(dataset) == 0:  # a map of no rows adds no columns: say why before the next step looks for them
            _nothing_left(report, split)
        eos_id = tokenizer.eos_token_id
        dataset = dataset.map(PreferenceTokenizer(tokenizer, fmt, eos_id), batched=True,
                              remove_columns=[c for c in dataset.column_names if c not in keep_columns],
                              num_proc=num_proc, desc=f"Tokenising {split}")
    else:
        dataset = dataset.select_columns([c for c in dataset.column_names
                                          if c in TOKEN_COLUMNS or c.startswith("ref_") or c in keep_columns])
    dataset = _drop_identical_token_pairs(dataset, report, num_proc)
    if len(dataset) == 0:
        _nothing_left(report, split)

    prompt = np.fromiter((len(x) for x in dataset["prompt_ids"]), np.int64, len(dataset))
    lengths = np.concatenate([prompt + np.fromiter((len(x) for x in dataset[f"{side}_ids"]), np.int64,
                                                   len(dataset)) for side in ("chosen", "rejected")])
    logger.info(length_summary_line(lengths, args.max_length, split, unit="sequences (prompt + chosen/rejected)"))

    truncate = PairTruncation(args.max_prompt_length, args.max_completion_length, args.max_length,
                              args.truncation_mode)
    if truncate.active:
        dataset = dataset.map(truncate, batched=True, num_proc=num_proc, desc=f"Truncating {split}")
        keep = ~np.asarray(dataset["__prompt_too_long__"], dtype=bool)
        counts = {name: int(np.asarray(dataset[name])[keep].sum()) for name in truncate.COUNT_COLUMNS}
        report.num_prompt_truncated = counts["__prompt_truncated__"]  # of the pairs kept
        report.num_completion_truncated = counts["__completion_truncated__"]
        report.tokens_dropped = counts["__tokens_dropped__"]
        report.num_prompt_too_long_dropped = int((~keep).sum())
        dataset = dataset.remove_columns(list(truncate.COUNT_COLUMNS))
        if not keep.all():
            dataset = dataset.select(np.flatnonzero(keep))
        # cutting may leave chosen == rejected: counted apart from pairs identical in the data
        dataset = _drop_identical_token_pairs(dataset, report, num_proc, "num_identical_after_truncation_dropped")
    if len(dataset) == 0:
        _nothing_left(report, split)
    report.num_examples_out = len(dataset)
    report.log()
    return dataset, report


def _nothing_left(report: PreferenceReport, split: str):
    report.num_examples_out = 0
    report.log()
    raise NothingLeft(f"No {split} pair is left after preparation: {report.dropped()}.", report)


def _drop_unusable_pairs(dataset, fmt: PreferenceFormat, report: PreferenceReport, num_proc):
    def check(batch):
        size = len(next(iter(batch.values())))
        empty, identical = [], []
        for i in range(size):
            pair = explicit_prompt_example({k: batch[k][i] for k in batch}, fmt)
            empty.append(is_empty_completion(pair["chosen"]) or is_empty_completion(pair["rejected"]))
            identical.append(pair["chosen"] == pair["rejected"])
        return {"__empty__": empty, "__identical__": identical}

    flags = dataset.map(check, batched=True, remove_columns=dataset.column_names, num_proc=num_proc,
                        desc="Checking pairs")
    empty = np.asarray(flags["__empty__"], dtype=bool)
    identical = np.asarray(flags["__identical__"], dtype=bool) & ~empty
    report.num_empty_dropped, report.num_identical_dropped = int(empty.sum()), int(identical.sum())
    keep = ~(empty | identical)
    return dataset if keep.all() else dataset.select(np.flatnonzero(keep))


def _drop_identical_token_pairs(dataset, report: PreferenceReport, num_proc, counter: str = "num_identical_dropped"):
    same = np.fromiter((c == r for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"])), bool,
                       len(dataset))
    setattr(report, counter, getattr(report, counter) + int(same.sum()))
    return dataset if not same.any() else dataset.select(np.flatnonzero(~same))


class PairTruncation:
    """Batched map: truncate prompt, chosen and rejected ids of each pair; record what was cut."""

    COUNT_COLUMNS = ("__prompt_truncated__", "__completion_truncated__", "__tokens_dropped__", "__prompt_too_long__")

    def __init__(self, max_prompt_length, max_completion_length, max_length, mode: str = "keep_start"):
        self.max_prompt, self.max_completion, self.max_length, self.mode = (
            max_prompt_length, max_completion_length, max_length, mode)

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.max_prompt, self.max_completion, self.max_length))

    def __call__(self, batch: dict) -> dict:
        out = {name: [] for name in ("prompt_ids", "chosen_ids", "rejected_ids",
                                     *self.COUNT_COLUMNS)}
        for prompt, chosen, rejected in zip(batch["prompt_ids"], batch["chosen_ids"],
                                            batch["rejected_ids"]):
            before = 2 * len(prompt) + len(chosen) + len(rejected)
            new_prompt, new_chosen, new_rejected, too_long = self.truncate(list(prompt), list(chosen), list(rejected))
            out["prompt_ids"].append(new_prompt)
            out["chosen_ids"].append(new_chosen)
            out["rejected_ids"].append(new_rejected)
            out["__prompt_truncated__"].append(len(new_prompt) < len(prompt))
            out["__completion_truncated__"].append(int(len(new_chosen) < len(chosen))
                                                   + int(len(new_rejected) < len(rejected)))
            out["__tokens_dropped__"].append(before - 2 * len(new_prompt) - len(new_chosen) - len(new_rejected))
            out["__prompt_too_long__"].append(too_long)
        for name in batch:
            if name not in out:
                out[name] = batch[name]
        return out

    def truncate(self, prompt: list, chosen: list, rejected: list):
        if self.max_prompt is not None and len(prompt) > self.max_prompt:
            prompt = prompt[len(prompt) - self.max_prompt:]
        if self.max_completion is not None:
            chosen, rejected = chosen[: self.max_completion], rejected[: self.max_completion]
        if self.max_length is None:
            return prompt, chosen, rejected, False
        if self.mode == "keep_end":
            excess = max(len(prompt) + len(chosen), len(prompt) + len(rejected)) - self.max_length
            if excess > 0:
                prompt = prompt[min(excess, len(prompt)):]
        room = self.max_length - len(prompt)
        if room <= 0:
            return prompt[: self.max_length], [], [], True
        return prompt, chosen[:room], rejected[:room], False
