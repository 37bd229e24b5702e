"""A shorter `max_length` for the budget search: `leantune profile`'s keep threshold, kept apart from the candidates.

Truncating more changes what is learned (the tokens past `max_length` are never trained on), so this is never one of
the "same result" candidates of recommend.py. It is offered beside them, labelled, with the rows and tokens it
truncates: the smallest multiple of 64 that keeps `keep_threshold` of the tokens (the profiler's own rule,
profiling/numbers.py `smallest_length_keeping`), when that is shorter than the run's `max_length`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..profiling.lengths import tokenize_lengths
from ..profiling.numbers import SortedLengths, smallest_length_keeping

LENGTH_MULTIPLE = 64  # the profiler's RECOMMENDATION_MULTIPLE


@dataclass
class MaxLengthSuggestion:
    max_length: int
    current: int | None  # the run's max_length (None: no truncation)
    keep_threshold: float
    rows: int
    rows_truncated: int  # rows longer than max_length (beyond what `current` truncates already)
    tokens: int
    tokens_lost: int
    search: object | None = None  # recommend.Recommendation at this max_length

    def lines(self) -> list[str]:
        now = "no truncation" if self.current is None else f"max_length {self.current}"
        out = ["changes what is learned (truncation), so not among the candidates above:",
               f"  max_length {self.max_length} (keeps {self.keep_threshold:.0%} of the tokens, leantune profile's "
               f"keep threshold; now {now}) truncates {self.rows_truncated} of {self.rows} rows "
               f"({self.rows_truncated / max(1, self.rows):.1%}) and drops {self.tokens_lost} of {self.tokens} tokens "
               f"({self.tokens_lost / max(1, self.tokens):.2%})"]
        if self.search is not None:
            out += [f"  {line}" for line in self.search.lines()[1:]]
            if self.search.chosen is not None:
                out.append(f"    --max_length {self.max_length}")
        return out


def suggest_max_length(lengths, current: int | None, keep_threshold: float = 0.99) -> MaxLengthSuggestion | None:
    """The profiler's keep-threshold length, if it is shorter than `current`; else None (nothing to suggest)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return None
    ordered = SortedLengths.of(lengths)
    suggested = smallest_length_keeping(ordered, keep_threshold, LENGTH_MULTIPLE)
    if current is not None and suggested >= current:
        return None
    now = lengths if current is None else np.minimum(lengths, current)  # what the run trains on today
    return MaxLengthSuggestion(
        suggested, current, keep_threshold, int(lengths.size), int((now > suggested).sum()), int(now.sum()),
        int(np.maximum(now - suggested, 0).sum()))


def data_lengths(train_dataset, tokenizer) -> np.ndarray:
    """The lengths the trainer truncates, from the data through the trainer's tokenisation (leantune profile's)."""
    return tokenize_lengths(train_dataset, tokenizer).sequences


def current_max_length(config_class, fields: dict) -> int | None:
    if "max_length" in fields:
        return fields["max_length"]
    default = getattr(config_class, "__dataclass_fields__", {}).get("max_length")
    return None if default is None else default.default


def suggest_for_budget(recommendation, lengths, config_class, fields: dict, keep_threshold: float, search):
    """The suggestion, with its own budget search (`search(fields)` -> Recommendation) when the same-result search
    gave something up (it did not choose its fastest candidate, or nothing fitted; searched from the frugal end, only
    when nothing fitted: there every answer gave speed up, and each search costs several plans)."""
    if "max_length" not in getattr(config_class, "__dataclass_fields__", {}):
        return None  # the method truncates by other fields (GRPO's prompt and completion lengths)
    suggestion = suggest_max_length(lengths, current_max_length(config_class, fields), keep_threshold)
    if suggestion is None:
        return None
    considered = recommendation.considered
    gave_up = considered and recommendation.chosen is not considered[0]
    if recommendation.from_frugal_end is not None:  # searched from the frugal end: the first planned is the slowest
        gave_up = False
    if recommendation.chosen is None or gave_up:
        suggestion.search = search({**fields, "max_length": suggestion.max_length})
    return suggestion
