"""Attention over rows of segments with PyTorch's SDPA: packed and padding-free rows computed sequence by sequence
("varlen"), and the online methods' shared-prompt rows in one call per layer over prefix blocks.

A packed or padding-free row holds several sequences. With plain SDPA, transformers builds a block-diagonal mask
for the whole row and attends over row_length^2 positions, most of them masked. Here each sequence gets its own
causal SDPA call, so the work is sum(length^2) and no mask is read. The segment boundaries arrive as the
`cu_seq_lens_q` offsets that FlashAttention's varlen kernels take, so one batch layout serves both backends.

Shared-prompt rows (data/collators.py's `SharedPromptCollator`) add `prefix_blocks`: the row cut into equal query
blocks, each with its prefix's keys and its own (built with the batch: data/collators.py's `prefix_blocks`). Such a
row runs as one SDPA call per layer over those blocks, its gathered keys and values not kept for the backward
(`recomputed_but_attention`). Under context parallelism a shared row takes the all-gather form instead
(models/gathered_attention.py).

The prefix blocks. A shared-prompt row is [prompt, completion_1, ..., completion_G] per group, and
`shared_prompt_of` names, for each segment, the prompt its queries see before their own keys (-1: none). Every
segment is cut into query blocks of one length Lq (the longest completion's, or a half, a quarter... of it where that
is less work: data/collators.py's `block_length`); a block's prefix is its group's prompt (for a completion's blocks)
and its segment's earlier blocks. The blocks are the batch of one SDPA call: queries [E, heads, Lq], keys and values [E, heads, P + Lq]
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
made on the host when the batch is collated (no device read, no tensor op per block) and read by every layer.

The gathered keys and values repeat the prompt's once per block (E x (P + Lq) against the row's L: 5x at
1,024:256 x 16), so they are not kept for the backward but gathered again, and the SDPA kernel's results are kept
(`recomputed_but_attention`): the row's own queries, keys and values are what stays.
"""

from __future__ import annotations

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
    """Drop-in for transformers' sdpa attention, by the batch's layout: a shared-prompt row (its prefix blocks; split
    over a context-parallel group: gathered), packed or padding-free rows (`cu_seq_lens_q`), else sdpa's own."""
    dropout_p = dropout if module.training else 0.0
    if kwargs.get(RING_SEGMENTS) is not None:
        return gathered_segment_attention(module, query, key, value, kwargs[RING_SEGMENTS], dropout, scaling)
    if kwargs.get("prefix_blocks") is not None:
        return shared_row_attention(query, key, value, kwargs["prefix_blocks"], dropout_p, scaling)
    if kwargs.get("cu_seq_lens_q") is not None:
        return varlen_attention(query, key, value, kwargs["cu_seq_lens_q"], dropout_p, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def end_to_end(states: torch.Tensor) -> torch.Tensor:
    """[batch, heads, length, dim] -> [heads, batch x length, dim]: the rows end to end (segments never cross rows)."""
    return states.transpose(0, 1).flatten(1, 2)


def shared_row_attention(query, key, value, blocks: dict, dropout_p: float, scaling):
    """A shared-prompt row: one SDPA call over its prefix blocks (below), the gathered keys and values recomputed."""
    batch, length = query.shape[0], query.shape[2]
    output = recomputed_but_attention(prefix_block_attention, end_to_end(query), end_to_end(key), end_to_end(value),
                                      blocks["queries"], blocks["keys"], blocks["mask"], blocks["output"], dropout_p,
                                      scaling)
    return output.unflatten(1, (batch, length)).permute(1, 2, 0, 3).contiguous(), None


def varlen_attention(query, key, value, cu_seq_lens: torch.Tensor, dropout_p: float, scaling):
    """Packed or padding-free rows: each sequence its own causal SDPA call."""
    batch, heads, length, dim = query.shape
    # Cut once with split(): one view per sequence, and a backward that writes each piece's gradient into the
    # shared buffer.
    lengths = torch.diff(cu_seq_lens).tolist()
    queries, keys, values = (end_to_end(states).unsqueeze(0).split(lengths, dim=2) for states in (query, key, value))
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


# SDPA's fused kernels, by the names this torch build has (the math fallback's ops are recomputed): found once, not
# for every op the selective checkpoint's policy is asked about
ATTENTION_KERNELS = frozenset(getattr(torch.ops.aten, name).default
                              for name in ("_scaled_dot_product_flash_attention_for_cpu",
                                           "_scaled_dot_product_flash_attention",
                                           "_scaled_dot_product_efficient_attention",
                                           "_scaled_dot_product_cudnn_attention")
                              if hasattr(torch.ops.aten, name))


def _keep_attention_kernels(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


# --- a shared-prompt row's prefix blocks ---------------------------------------------------------------------------

def prefix_block_attention(query, key, value, queries, keys, mask, output, dropout_p: float = 0.0, scaling=None):
    """Row queries [heads, L, dim] and keys/values [kv heads, L, dim] -> the row's attention output [heads, L, dim],
    in one SDPA call over the blocks (`queries`, `keys`, `mask`, `output`: data/collators.py's `prefix_blocks`)."""
    count, block, width = mask.shape[0], mask.shape[2], mask.shape[3]

    def blocks(states, index, length):
        gathered = states.index_select(1, index).unflatten(1, (count, length))
        return gathered.transpose(0, 1)  # [E, heads, length, dim]

    attended = F.scaled_dot_product_attention(
        blocks(query, queries, block), blocks(key, keys, width), blocks(value, keys, width), attn_mask=mask,
        dropout_p=dropout_p, scale=scaling, enable_gqa=key.shape[0] != query.shape[0])
    return attended.transpose(0, 1).flatten(1, 2).index_select(1, output)


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
