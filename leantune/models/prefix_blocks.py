"""A shared-prompt row's attention in one SDPA call per layer: the row cut into equal query blocks, each block's keys
its prefix (its group's prompt) and itself.

A shared-prompt row (trainers/online/shared_prompt.py) is [prompt, completion_1, ..., completion_G] per group, and
`shared_prompt_of` names, for each segment, the prompt its queries see before their own keys (-1: none). Here every
segment becomes query blocks of one length, Lq = the longest completion's: a completion is one block whose prefix is
its group's prompt; a prompt (or the padding segment) is cut into blocks of Lq whose prefix is the same segment's
earlier blocks. The blocks are the batch of one SDPA call: queries [E, heads, Lq], keys and values
[E, heads, P + Lq] gathered from the row (the longest prefix P, then the block's own keys), and one boolean mask
[E, 1, Lq, P + Lq] (every key of the prefix; its own keys causally). `index_select`'s backward sums a prompt key's
gradient over every block that read it. The work is E x Lq x (P + Lq): per completion as in its unshared row and in
the G-call form, plus about Lp x (Lp + Lq) for a prompt where its causal call was Lp^2 / 2.

Why this layout, measured (CPU, one thread, 4 heads of 64, the attention's forward + backward, 2026-11-29;
prompt:completion x G):

| shape | G calls (a completion's SDPA each) | one call, these blocks | one call, dense [L, L] mask | unshared causal rows |
|---|---|---|---|---|
| 1024:256 x 16 | 0.247 s | 0.188 s | 1.05 s | 0.690 s |
| 64:256 x 16 | 0.057 s | 0.047 s | 0.68 s | 0.065 s |
| 256:64 x 8 | 0.011 s | 0.008 s | 0.022 s | 0.033 s |

The dense mask over the whole row (L = Lp + G x Lb) is small as booleans (25 MiB at 1,024 + 16 x 256) but SDPA
computes every masked score, L^2: at 1:4 that is ~11x the unshared rows' attention, so a shared row would be
slower than the unshared one. FlexAttention's block mask skips the masked blocks but has no backward on CPU in
torch 2.13, and the same blocks run through SDPA on every device (CUDA's memory-efficient kernel takes the mask).
No [L, L] mask is made: the mask is E x Lq x (P + Lq) booleans (6.25 MiB at 1,024:256 x 16), built once per batch
(`blocks_of`, cached on the batch's `shared_prompt_of` tensor) and read by every layer.

The gathered keys and values repeat the prompt's once per block (E x (P + Lq) against the row's L: 5x at
1,024:256 x 16), so the call is recomputed in the backward (`recomputed`, segment_attention.py): only the row's
own queries, keys and values are kept for it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefixBlocks:
    """A shared row cut into query blocks: `queries` [E x Lq] row positions (padding: 0, masked), `keys` [E x Kb]
    row positions of each block's prefix then own keys, `mask` [E, 1, Lq, Kb], `output` [row length] the flat block
    position each row position's output comes from."""

    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor
    output: torch.Tensor
    block_length: int

    @property
    def count(self) -> int:
        return self.mask.shape[0]


def prefix_block_spans(lengths: list[int], prompt_of: list[int]) -> tuple[list[tuple[int, int, int, int]], int]:
    """(query start, query length, prefix start, prefix length) of every block, and the block length Lq."""
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    branches = [length for length, prompt in zip(lengths, prompt_of) if prompt >= 0]
    block = max(branches) if branches else max(lengths)
    spans = []
    for start, length, prompt in zip(starts, lengths, prompt_of):
        if prompt >= 0:
            spans.append((start, length, starts[prompt], lengths[prompt]))
            continue
        for offset in range(0, length, block):
            spans.append((start + offset, min(block, length - offset), start, offset))
    return spans, block


def build_prefix_blocks(lengths: list[int], prompt_of: list[int], device=None) -> PrefixBlocks:
    """The blocks of a row of segments (`lengths`) whose prompts `prompt_of` names (per segment, or -1)."""
    spans, block = prefix_block_spans(lengths, prompt_of)
    prefix = max(span[3] for span in spans)
    width = prefix + block
    queries = torch.zeros(len(spans), block, dtype=torch.long)
    keys = torch.zeros(len(spans), width, dtype=torch.long)
    mask = torch.zeros(len(spans), 1, block, width, dtype=torch.bool)
    output = torch.empty(sum(lengths), dtype=torch.long)
    own = torch.arange(block)
    causal = own[:, None] >= own[None, :]
    for n, (start, length, prefix_start, prefix_length) in enumerate(spans):
        queries[n, :length] = own[:length] + start
        keys[n, :prefix_length] = torch.arange(prefix_start, prefix_start + prefix_length)
        keys[n, prefix:prefix + length] = own[:length] + start
        mask[n, 0, :, :prefix_length] = True
        # its own keys up to itself; a padding query (past `length`) sees the block's keys, so no row is all masked
        mask[n, 0, :, prefix:prefix + length] = causal[:, :length]
        mask[n, 0, length:, prefix:prefix + length] = True
        output[start:start + length] = own[:length] + n * block
    return PrefixBlocks(queries.flatten().to(device), keys.flatten().to(device), mask.to(device), output.to(device),
                        block)


def prefix_block_attention(query, key, value, queries, keys, mask, output, dropout_p: float = 0.0, scaling=None):
    """Row queries [heads, L, dim] and keys/values [kv heads, L, dim] -> the row's attention output [heads, L, dim],
    in one SDPA call over the blocks (`queries`, `keys`, `mask`, `output`: PrefixBlocks' tensors)."""
    count, block, width = mask.shape[0], mask.shape[2], mask.shape[3]

    def blocks(states, index, length):
        gathered = states.index_select(1, index).unflatten(1, (count, length))
        return gathered.transpose(0, 1)  # [E, heads, length, dim]

    attended = F.scaled_dot_product_attention(
        blocks(query, queries, block), blocks(key, keys, width), blocks(value, keys, width), attn_mask=mask,
        dropout_p=dropout_p, scale=scaling, enable_gqa=key.shape[0] != query.shape[0])
    return attended.transpose(0, 1).flatten(1, 2).index_select(1, output)


class BlockCache:
    """The blocks of the batch being scored, built on its first layer and read by the others: kept while the batch's
    `shared_prompt_of` and offsets are the very tensors every layer of its forward gets (weak references, so a new
    batch never meets an old batch's blocks), on the device they ran on."""

    def __init__(self):
        self.sources, self.device, self.blocks = (), None, None

    def blocks_of(self, prompt_of: torch.Tensor, cu_seq_lens: torch.Tensor, device) -> PrefixBlocks:
        current = len(self.sources) == 2 and self.sources[0]() is prompt_of and self.sources[1]() is cu_seq_lens
        if not current or self.device != device:
            lengths = torch.diff(cu_seq_lens).tolist()
            self.blocks = build_prefix_blocks(lengths, prompt_of.tolist(), device)
            self.sources, self.device = (weakref.ref(prompt_of), weakref.ref(cu_seq_lens)), device
        return self.blocks
