"""Which chunks a chunked loss runs (token_logprobs.py, distillation.py), and which tiles the tiled MLP runs
(memory/tiled_mlp.py: each full tile allocates and frees the same as the one before it, too).

A real step runs every chunk. The planner's fake step (planning/planned_run.py) runs only the chunks whose memory
can differ, so that its time does not grow with the length: the first (it creates the running sums of the head's
gradients that later chunks add to in place), the second (the first in that steady state) and the last (it may be
shorter). Every full chunk between them allocates and frees exactly what the second did, over the same live tensors,
so the step's peak and its parts are the same to the byte, and a fake chunk computes no number that anything reads.
"""

from __future__ import annotations

import contextlib

from torch._subclasses.fake_tensor import FakeTensor

_repeats_skipped = False


def chunk_starts(rows, chunk_size: int):
    """The start of each chunk of `rows` (a tensor's first dimension) that runs: all of them, except on a fake tensor
    inside `repeated_chunks_skipped`."""
    starts = range(0, rows.shape[0], chunk_size)
    if not (_repeats_skipped and isinstance(rows, FakeTensor)) or len(starts) <= 3:
        return starts
    return [starts[0], starts[1], starts[-1]]


@contextlib.contextmanager
def repeated_chunks_skipped(skipped: bool = True):
    """Within it, a chunked loss over fake tensors runs its first two chunks and its last only (`skipped=False`: all)."""
    global _repeats_skipped
    before, _repeats_skipped = _repeats_skipped, skipped
    try:
        yield
    finally:
        _repeats_skipped = before
