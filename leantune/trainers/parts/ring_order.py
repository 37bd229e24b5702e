"""The order of a row split over a context-parallel group, written once for both layouts that use it: packed or
padding-free documents (context_parallel.py) and a shared-prompt row (shared_prompt_ring.py); and the batch keys that
carry each target through the split."""

from __future__ import annotations

import torch

# The batch keys that carry each target's sequence, rank and place in the whole batch's flat target order through the
# split (`target_sequence_grids`)
SEQUENCE_KEY, RANK_KEY, ORDINAL_KEY = "cp_target_sequence", "cp_target_rank", "cp_target_ordinal"


def head_tail(length: int, cp: int) -> torch.Tensor:
    """torch's default load balancing (head-tail): process r holds chunks r and 2cp-1-r of 2cp equal chunks."""
    chunk = length // (2 * cp)
    order = []
    for rank in range(cp):
        order += range(rank * chunk, (rank + 1) * chunk)
        order += range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.tensor(order, dtype=torch.long)


def group_order(padded: list[int], cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a row of segments of `padded` lengths (each a multiple of 2 x cp): `wanted`, the row's positions in the
    group's order (process after process; of every segment, its chunks k and 2cp-1-k, k the process's rank), and
    `order`, the reordering after which torch's head-tail split gives each process exactly that: torch takes
    row[head_tail] and splits it evenly, so row[order][head_tail] must be row[wanted]."""
    multiple = 2 * cp
    starts = torch.tensor([0] + padded[:-1]).cumsum(0).tolist()
    wanted = []
    for rank in range(cp):
        for s, m in zip(starts, padded):
            c = m // multiple
            wanted += range(s + rank * c, s + (rank + 1) * c)
            wanted += range(s + (multiple - 1 - rank) * c, s + (multiple - rank) * c)
    wanted = torch.tensor(wanted, dtype=torch.long)
    return wanted, wanted[torch.argsort(head_tail(sum(padded), cp))]
