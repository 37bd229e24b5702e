"""The one-line length summary a trainer logs about its dataset before truncating it."""

from __future__ import annotations

import numpy as np

from .numbers import SortedLengths


def length_summary_line(lengths, max_length: int | None, split: str = "train", truncates: bool = True,
                        unit: str = "examples") -> str:
    """Count, p50/p99/max tokens, and what `max_length` truncates; for sequences split rather than truncated
    (bfd_split / wrapped packing) pass `truncates=False`.
    """
    sorted_lengths = SortedLengths.of(np.asarray(lengths, dtype=np.int64))
    if sorted_lengths.count == 0:
        return f"{split} lengths: no {unit}."
    line = (f"{split} lengths: {sorted_lengths.count:,} {unit}, tokens p50 {sorted_lengths.percentile(50):,} / "
            f"p99 {sorted_lengths.percentile(99):,} / max {int(sorted_lengths.values[-1]):,}")
    if max_length is None:
        return line + "; no max_length, nothing truncated."
    num_over, tokens_lost = (int(x) for x in sorted_lengths.truncation(max_length))
    if not truncates:
        return line + f"; {num_over:,} longer than max_length {max_length:,} are split across rows, no token lost."
    share = tokens_lost / max(1, sorted_lengths.total)
    return (line + f"; max_length {max_length:,} truncates {num_over:,} ({num_over / sorted_lengths.count:.2%}) "
            f"and loses {tokens_lost:,} tokens ({share:.2%}).")
