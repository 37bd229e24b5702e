"""Shared-prompt rows under context parallelism: each process scores its share of every segment of the row.

A shared-prompt row (shared_prompt.py) cannot go through torch's ring attention: the ring computes plain causal
attention of a sequence over itself, and a completion ("branch") attends to another segment, its group's prompt.
So these rows take the all-gather form of context parallelism instead (each process holds a share of the
queries; keys and values are gathered from the group, then every query attends to exactly the keys it attends to in
one process's row):

- the layout is the packed rows' (context_parallel.py): every segment padded to a multiple of 2 x cp_size and
  reordered so that torch's head-tail split gives process k, for every segment, its chunks k and 2 cp_size - 1 - k
  (a balanced share of each segment's queries and of the row's attention work);
- in each layer the group's keys and values are gathered (`gather_along_time`, its backward sums the group's
  gradients back to their owner), and each segment's local queries run one SDPA call against their keys: a prompt
  its own keys, causally; a branch the prompt's real keys (not its padding) and its own keys up to itself
  (`RingSegments`, the index of those keys in the gathered row and the boolean mask, built once per batch);
- targets are per position of the whole row (one position, the prompt's last, predicts every branch's first token),
  so each process takes the targets whose position it holds, with their place in the batch's flat target order
  (the round's per-target inputs are read there) and in their completion (the loss's whole-sequence sums).

Why gather, not ring: the prompt's keys are what every branch needs; with GQA they are a fraction of the hidden
states, and the gather is one collective per layer where a ring would need masks torch's ring does not take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...data.collators import round_up
from ...models.gathered_attention import RING_SEGMENTS
from .ring_order import ORDINAL_KEY, RANK_KEY, SEQUENCE_KEY, group_order


@dataclass
class RingSegments:
    """What one process's attention needs of a laid-out shared row (a model input, `shared_prompt_ring`): the
    context-parallel group, and per segment its local query slice, the index of its keys in the group's gathered
    keys and values, and which of those keys each local query sees."""

    group: object
    queries: list[tuple[int, int]]
    key_index: list[torch.Tensor]
    masks: list[torch.Tensor]

    def on(self, device) -> RingSegments:
        """The index and masks on the device the attention runs on (moved once, kept)."""
        if self.masks and self.masks[0].device != torch.device(device):
            self.key_index = [index.to(device) for index in self.key_index]
            self.masks = [mask.to(device) for mask in self.masks]
        return self


def lay_out_shared_row(batch: dict, cp: int, rank: int, pad_token_id: int, group=None) -> tuple[dict, torch.Tensor]:
    """A shared-prompt micro-batch (one row) laid out for a context-parallel group of `cp`, as process `rank` scores
    it: input_ids and position_ids of the whole row, reordered for torch's head-tail split (accelerate splits them);
    this process's targets (`target_index` in its local row, `target_tokens`, `target_sequence`) with their sequence,
    rank in it and ordinal in the batch's flat target order (context_parallel.py's keys, one value per target); local segment offsets; the
    attention's `shared_prompt_ring`. Also returns the position ids this process must hold after the split."""
    multiple = 2 * cp
    lengths = torch.diff(batch["cu_seq_lens_q"].cpu()).tolist()
    prompt_of = batch["shared_prompt_of"].cpu().tolist()
    ids, positions = batch["input_ids"].cpu()[0], batch["position_ids"].cpu()[0]
    padded = [round_up(n, multiple) for n in lengths]
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0).tolist()
    padded_starts = torch.tensor([0] + padded[:-1]).cumsum(0).tolist()
    row_ids, row_positions = [], []
    for start, n, m in zip(starts, lengths, padded):  # padding continues the segment's positions and has no target
        row_ids.append(torch.cat([ids[start:start + n], ids.new_full((m - n,), pad_token_id)]))
        row_positions.append(torch.cat([positions[start:start + n],
                                        positions[start + n - 1] + 1 + torch.arange(m - n, dtype=positions.dtype)]))
    row_ids, row_positions = torch.cat(row_ids), torch.cat(row_positions)
    width = sum(padded)
    local_width = width // cp
    wanted, order = group_order(padded, cp)
    gathered_place = torch.argsort(wanted)  # padded-row position -> its place in the gathered (process-major) row
    # targets: old row position -> padded row position -> (process holding it, place in its local row)
    segment_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = batch["target_index"].cpu()
    padded_index = index - torch.tensor(starts)[segment_of[index]] + torch.tensor(padded_starts)[segment_of[index]]
    holder, local_index = gathered_place[padded_index] // local_width, gathered_place[padded_index] % local_width
    sequence = batch["target_sequence"].cpu()
    counts = torch.bincount(sequence, minlength=int(sequence.max()) + 1 if sequence.numel() else 0)
    first = torch.cumsum(counts, 0) - counts
    target_rank = torch.arange(sequence.numel()) - first[sequence]
    mine = holder == rank
    laid = {
        "input_ids": row_ids[order].unsqueeze(0).to(batch["input_ids"].device),
        "position_ids": row_positions[order].unsqueeze(0).to(batch["input_ids"].device),
        "target_index": local_index[mine],
        "target_tokens": batch["target_tokens"].cpu()[mine],
        "target_sequence": sequence[mine],
        SEQUENCE_KEY: sequence[mine],
        RANK_KEY: target_rank[mine],
        ORDINAL_KEY: torch.arange(index.numel())[mine],
        "shared_prompt_of": batch["shared_prompt_of"],
        RING_SEGMENTS: ring_segments(lengths, padded, padded_starts, prompt_of, gathered_place, cp, rank,
                                            group),
    }
    offsets = torch.tensor([0] + [m // cp for m in padded]).cumsum(0).to(torch.int32)
    laid.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=max(padded) // cp,
                max_length_k=max(padded) // cp)
    return laid, row_positions[wanted[rank * local_width:(rank + 1) * local_width]].unsqueeze(0)


def ring_segments(lengths, padded, padded_starts, prompt_of, gathered_place, cp, rank, group) -> RingSegments:
    """Per segment: this process's queries (chunks rank and 2cp-1-rank of the segment, at its local offset), the
    keys they read (a branch: its prompt's real tokens, then its own padded segment; else its own) as places in the
    gathered row, and the mask: every prompt key, own keys up to the query's own position."""
    multiple = 2 * cp
    queries, key_index, masks, offset = [], [], [], 0
    for s, (m, start) in enumerate(zip(padded, padded_starts)):
        c = m // multiple
        own = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                         torch.arange((multiple - 1 - rank) * c, (multiple - rank) * c)])  # in-segment positions
        keys = gathered_place[start:start + m]
        seen = torch.arange(m).unsqueeze(0) <= own.unsqueeze(1)
        p = prompt_of[s]
        if p >= 0:
            real = lengths[p]
            keys = torch.cat([gathered_place[padded_starts[p]:padded_starts[p] + real], keys])
            seen = torch.cat([torch.ones(len(own), real, dtype=torch.bool), seen], dim=1)
        queries.append((offset, offset + 2 * c))
        key_index.append(keys)
        masks.append(seen)
        offset += 2 * c
    return RingSegments(group, queries, key_index, masks)
