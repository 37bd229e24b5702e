"""Dataset lengths as the trainers report them: sorted lengths with prefix sums (truncation at any max_length in
O(log n)), and the one-line length summary each trainer logs before truncating its data. `leantune profile`
(profiling/) builds its tables on the same `SortedLengths`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SortedLengths:
    """Lengths in increasing order with their prefix sums: truncation at any max_length in O(log n)."""

    values: np.ndarray
    prefix: np.ndarray  # prefix[k] = sum of the k shortest lengths

    @classmethod
    def of(cls, lengths) -> SortedLengths:
        values = np.sort(np.asarray(lengths, dtype=np.int64))
        return cls(values, np.concatenate([[0], np.cumsum(values)]))

    @property
    def count(self) -> int:
        return len(self.values)

    @property
    def total(self) -> int:
        return int(self.prefix[-1])

    def percentile(self, q: int) -> int:
        """Nearest-rank percentile: the smallest length that at least q% of the examples do not exceed."""
        rank = max(1, -(-q * self.count // 100))
        return int(self.values[rank - 1])

    def truncation(self, max_lengths) -> tuple[np.ndarray, np.ndarray]:
        """(examples longer than each max_length, tokens cut off at each max_length)."""
        max_lengths = np.asarray(max_lengths, dtype=np.int64)
        fitting = np.searchsorted(self.values, max_lengths, side="right")
        num_over = self.count - fitting
        tokens_lost = (self.total - self.prefix[fitting]) - max_lengths * num_over
        return num_over, tokens_lost

    def kept_share(self, max_lengths) -> np.ndarray:
        """Share of all tokens kept when every example is cut to max_length: sum(min(len, L)) / sum(len)."""
        if self.total == 0:
            return np.ones(np.shape(max_lengths))
        return 1.0 - self.truncation(max_lengths)[1] / self.total


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
