"""Attention over rows of segments with PyTorch's SDPA: packed and padding-free rows computed sequence by sequence
("varlen"), and the online methods' shared-prompt rows in one call per layer over prefix blocks.

A packed or padding-free row holds several sequences. With plain SDPA, transformers builds a block-diagonal mask
for the whole row and attends over row_length^2 positions, most of them masked. Here each sequence gets its own
causal SDPA call, so the work is sum(length^2) and no mask is read. The segment boundaries arrive as the
`cu_seq_lens_q` offsets that FlashAttention's varlen kernels take, so one batch layout serves both backends.

Shared-prompt rows (data/collators.py's `SharedPromptCollator`) add `shared_prompt_of`: for each segment, the
segment whose keys and values it reads before its own (its group's prompt), or -1. Such a row runs as one SDPA call
per layer over equal query blocks, each with its prefix's keys and its own (`PrefixBlocks`, below), its gathered keys
and values not kept for the backward (`recomputed_but_attention`). Under context parallelism a shared row takes the
all-gather form instead (models/gathered_attention.py).

The prefix blocks. A shared-prompt row is [prompt, completion_1, ..., completion_G] per group, and
`shared_prompt_of` names, for each segment, the prompt its queries see before their own keys (-1: none). Here every
segment is cut into query blocks of one length Lq (the longest completion's, or a half, a quarter... of it where that
is less work: `block_length`); a block's prefix is its group's prompt (for a completion's blocks) and its segment's
earlier blocks. The blocks are the batch of one SDPA call: queries [E, heads, Lq], keys and values [E, heads, P + Lq]
gathered from the row (the longest prefix P, then the block's own keys), and one boolean mask [E, 1, Lq, P + Lq]
(every key of its prefix; its own keys causally). `index_select`'s backward sums a prompt key's gradient over every
block that read it. The work is E x Lq x (P + Lq): per completion about its unshared row's, masked scores included.

Why this layout, measured (`python bench/shared_prompt.py --attention --repeats 3`: one layer of 4 heads of 64, the
attention's forward + backward, CPU seconds, one thread, 2026-11-29; prompt:completion x G):

| shape | one call, these blocks | G calls (a completion's SDPA each, recomputed) | one call, dense [L, L] mask | unshared causal rows |
|---|---|---|---|---|
| 1024:256 x 16 | 0.292 | 0.388 | 1.846 | 0.680 |
| 64:256 x 16 | 0.065 | 0.082 | 1.172 | 0.065 |
| 256:64 x 8 | 0.017 | 0.020 | 0.026 | 0.032 |
| 1024:256 x 2 | 0.094 | 0.089 | 0.135 | 0.087 |
| 64:256 x 2 | 0.012 | 0.011 | 0.015 | 0.008 |
| 64:256 x 1 | 0.007 | 0.006 | 0.005 | 0.004 |

The dense mask over the whole row (L = Lp + G x Lb) is small as booleans (25 MiB at 1,024 + 16 x 256) but SDPA
computes every masked score, L^2: at 1:4 x 16 that is 18x the unshared rows' attention, so a shared row would be
slower than the unshared one. The blocks cost most where a group is small: a block's upper triangle and a short
prompt's padded queries are computed and masked (G = 1: 1.7x the unshared row's attention, so a micro-batch of one
completion runs unshared by default: trainers/online/shared_prompt.py's `nothing_to_share`). FlexAttention's block
mask would skip the masked blocks, but it has no backward on CPU in torch 2.13; these blocks run through SDPA on
every device (on CUDA a masked call takes the memory-efficient kernel; leantune had no mask-free varlen path for
shared rows to keep). No [L, L] mask is made: the mask is E x Lq x (P + Lq) booleans (6.25 MiB at 1,024:256 x 16),
built once per batch (`BlockCache`, on the first layer) and read by every layer.

The gathered keys and values repeat the prompt's once per block (E x (P + Lq) against the row's L: 5x at
1,024:256 x 16), so they are not kept for the backward but gathered again, and the SDPA kernel's results are kept
(`recomputed_but_attention`): the row's own queries, keys and values are what stays.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .gathered_attention import RING_SEGMENTS, gathered_segment_attention

SEGMENT_SDPA = "leantune_segment_sdpa"
_registered = False


def segment_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Drop-in for transformers' sdpa attention; uses per-sequence calls when cu_seq_lens_q is given."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if kwargs.get(RING_SEGMENTS) is not None:  # a shared-prompt row split over a context-parallel group
        return gathered_segment_attention(module, query, key, value, kwargs[RING_SEGMENTS], dropout, scaling)
    if cu_seq_lens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, length, dim = query.shape

    def rows(states):  # [heads, batch x length, dim]: the rows end to end (segments never cross rows)
        return states.transpose(0, 1).reshape(states.shape[1], batch * length, dim)

    dropout_p = dropout if module.training else 0.0
    prompt_of = kwargs.get("shared_prompt_of")
    if prompt_of is not None:  # a shared-prompt row: one call over its prefix blocks (below)
        blocks = _blocks.blocks_of(prompt_of, cu_seq_lens, query.device)
        output = recomputed_but_attention(prefix_block_attention, rows(query), rows(key), rows(value), blocks.queries,
                                          blocks.keys, blocks.mask, blocks.output, dropout_p, scaling)
        return output.unflatten(1, (batch, length)).permute(1, 2, 0, 3).contiguous(), None
    # Cut once with split(): one view per sequence, and a backward that writes each piece's gradient into the
    # shared buffer.
    lengths = torch.diff(cu_seq_lens).tolist()
    queries, keys, values = (rows(states).unsqueeze(0).split(lengths, dim=2) for states in (query, key, value))
    gqa = key.shape[1] != heads
    pieces = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(queries, keys, values)
    ]
    output = torch.cat(pieces, dim=2).reshape(heads, batch, length, dim).transpose(0, 1)
    return output.transpose(1, 2).contiguous(), None


def recomputed_but_attention(attention, *inputs):
    """`attention(*inputs)` with only the attention kernel's results kept for the backward (selective activation
    checkpointing): the keys and values it gathers, which repeat the prompt's once per block, are gathered again in
    the backward, and the kernel is not run again (measured on CPU, forward + backward at 1,024:256 x 16, one thread:
    85.4 MiB kept -> 21.5 MiB, 0.283 s either way; recomputing the whole call instead took 0.368 s)."""
    if not torch.is_grad_enabled():
        return attention(*inputs)
    return checkpoint(attention, *inputs, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _keep_attention_kernels))


def _keep_attention_kernels(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _attention_kernels() else CheckpointPolicy.PREFER_RECOMPUTE


def _attention_kernels() -> set:
    """SDPA's fused kernels, by the names this torch build has (the math fallback's ops are recomputed)."""
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


# --- a shared-prompt row's prefix blocks ----------------------------------------------------------------------------

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


def prefix_block_spans(lengths: list[int], prompt_of: list[int], block: int) -> list[tuple[int, int, list]]:
    """(query start, query length, prefix ranges [(start, length), ...]) of every block of length `block`: a segment
    cut into blocks, each block's prefix its group's prompt (a completion's) and the segment's earlier blocks."""
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    spans = []
    for start, length, prompt in zip(starts, lengths, prompt_of):
        shared = [(starts[prompt], lengths[prompt])] if prompt >= 0 else []
        for offset in range(0, length, block):
            spans.append((start + offset, min(block, length - offset), shared + [(start, offset)]))
    return spans


# What a gathered key and value cost against the scores of one query row (their copies forward and backward):
# about 16 scores, fitted to the timings of `bench/shared_prompt.py --attention` at 64:256 x 2 and x 16, 1024:256 x 2
# and x 16, 256:64 x 8 (the fastest block length of 256, 128, 64, 32 chosen in each)
GATHER_COST = 16


def block_length(lengths: list[int], prompt_of: list[int], smallest: int = 16) -> int:
    """The block length with the least attention work, E x (P + Lq) x (Lq + GATHER_COST) (masked scores included):
    the longest completion, or a half, a quarter... of it where that pads less than it repeats prefixes (a short
    prompt before few long completions: its one block is mostly padding at the completions' length)."""
    branches = [length for length, prompt in zip(lengths, prompt_of) if prompt >= 0]
    longest = max(branches) if branches else max(lengths)
    candidates = [longest]
    while candidates[-1] // 2 >= smallest:
        candidates.append(-(-candidates[-1] // 2))

    def work(block: int) -> int:
        spans = prefix_block_spans(lengths, prompt_of, block)
        return len(spans) * (max(sum(n for _, n in span[2]) for span in spans) + block) * (block + GATHER_COST)

    return min(candidates, key=lambda block: (work(block), -block))


def build_prefix_blocks(lengths: list[int], prompt_of: list[int], device=None, block: int | None = None) -> PrefixBlocks:
    """The blocks of a row of segments (`lengths`) whose prompts `prompt_of` names (per segment, or -1); `block`:
    their length (default: `block_length`'s)."""
    block = block or block_length(lengths, prompt_of)
    spans = prefix_block_spans(lengths, prompt_of, block)
    prefix = max(sum(n for _, n in span[2]) for span in spans)
    width = prefix + block
    queries = torch.zeros(len(spans), block, dtype=torch.long)
    keys = torch.zeros(len(spans), width, dtype=torch.long)
    mask = torch.zeros(len(spans), 1, block, width, dtype=torch.bool)
    output = torch.empty(sum(lengths), dtype=torch.long)
    own = torch.arange(block)
    causal = own[:, None] >= own[None, :]
    for n, (start, length, ranges) in enumerate(spans):
        queries[n, :length] = own[:length] + start
        seen = torch.cat([torch.arange(first, first + count) for first, count in ranges])
        keys[n, :len(seen)] = seen
        keys[n, prefix:prefix + length] = own[:length] + start
        mask[n, 0, :, :len(seen)] = True
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
    batch never meets an old batch's blocks), on the device they ran on. The blocks go with the batch: once its
    `shared_prompt_of` is freed, so are they (a run that ended holds no mask of its last batch)."""

    def __init__(self):
        self.sources, self.device, self.blocks, self.batch = (), None, None, None

    def blocks_of(self, prompt_of: torch.Tensor, cu_seq_lens: torch.Tensor, device) -> PrefixBlocks:
        current = len(self.sources) == 2 and self.sources[0]() is prompt_of and self.sources[1]() is cu_seq_lens
        if not current or self.device != device:
            lengths = torch.diff(cu_seq_lens).tolist()
            self.blocks = build_prefix_blocks(lengths, prompt_of.tolist(), device)
            self.sources, self.device = (weakref.ref(prompt_of), weakref.ref(cu_seq_lens)), device
            self.batch = batch = object()
            weakref.finalize(prompt_of, self.forget, batch)
        return self.blocks

    def forget(self, batch: object) -> None:
        """The batch `batch` is gone: its blocks too (unless a newer batch's are kept)."""
        if self.batch is batch:
            self.sources, self.device, self.blocks, self.batch = (), None, None, None


_blocks = BlockCache()  # the shared row being scored: its blocks, built on the first layer


def register_segment_attention() -> str:
    """Register the attention (and, for padded batches, sdpa's mask builder) under one name."""
    global _registered
    if not _registered:
        AttentionInterface.register(SEGMENT_SDPA, segment_sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENT_SDPA, sdpa_mask)
        _registered = True
    return SEGMENT_SDPA


def use_segment_attention(model) -> bool:
    """Switch an sdpa model to per-sequence attention for packed rows; other backends are left as they are."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(register_segment_attention())
    return True
