"""The profile's arithmetic on length arrays, vectorised so that a million examples take milliseconds per number.

Truncation numbers come from the sorted lengths and their prefix sums (one binary search per max_length);
padding numbers from one fixed random batching of the examples, padded per batch with `reduceat`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.lengths import SortedLengths  # noqa: F401  (profiling's tables are built on it)

PERCENTILES = (50, 90, 95, 99)


def round_up(values, multiple: int | None):
    """`values` rounded up to a multiple of `multiple` (unchanged when it is None or 1)."""
    if not multiple or multiple == 1:
        return values
    return -(-np.asarray(values) // multiple) * multiple


def smallest_length_keeping(lengths: SortedLengths, threshold: float, multiple: int = 64) -> int:
    """The smallest multiple of `multiple` that keeps at least `threshold` of the tokens."""
    longest = int(lengths.values[-1]) if lengths.count else 0
    candidates = multiple * np.arange(1, max(1, -(-longest // multiple)) + 1, dtype=np.int64)
    kept = lengths.kept_share(candidates)
    # A tiny tolerance so that a share of exactly `threshold` is not lost to float rounding.
    enough = np.flatnonzero(kept >= threshold - 1e-12)
    return int(candidates[enough[0]]) if len(enough) else int(candidates[-1])


@dataclass(frozen=True)
class RandomBatches:
    """One fixed random order of the examples, cut into batches as a shuffling data loader would.

    `items` is [examples, rows per example] (rows per example: 1 for SFT, 2 for a chosen/rejected pair, whose
    rows sit in the same batch). The last batch may be smaller (no drop_last).
    """

    items: np.ndarray
    batch_size: int
    starts: np.ndarray

    @classmethod
    def of(cls, items: np.ndarray, batch_size: int, seed: int) -> RandomBatches:
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        order = np.random.default_rng(seed).permutation(len(items))
        return cls(np.asarray(items, dtype=np.int64)[order], batch_size, np.arange(0, len(items), batch_size))

    @property
    def rows_per_item(self) -> int:
        return self.items.shape[1]

    def _truncated(self, max_length: int | None) -> np.ndarray:
        return self.items if max_length is None else np.minimum(self.items, max_length)

    def padded(self, max_length: int | None, pad_to_multiple_of: int | None = None) -> tuple[int, int]:
        """(real tokens, tokens in the padded batches): each batch padded to its longest (truncated) row."""
        truncated = self._truncated(max_length)
        longest_in_batch = round_up(np.maximum.reduceat(truncated.max(axis=1), self.starts), pad_to_multiple_of)
        rows_in_batch = np.diff(np.append(self.starts, len(truncated))) * self.rows_per_item
        return int(truncated.sum()), int((longest_in_batch * rows_in_batch).sum())

    def padding_free(self, max_length: int | None, pad_to_multiple_of: int | None = None) -> tuple[int, int]:
        """(real tokens, tokens in the batches) when each batch is one flat row, padded only to the multiple."""
        tokens_in_batch = np.add.reduceat(self._truncated(max_length).sum(axis=1), self.starts)
        return int(tokens_in_batch.sum()), int(round_up(tokens_in_batch, pad_to_multiple_of).sum())


def waste(real: int, total: int) -> float:
    """Share of the batch tokens that are padding."""
    return 0.0 if total == 0 else (total - real) / total
