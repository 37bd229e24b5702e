"""Attention over packed rows computed sequence by sequence ("varlen") with PyTorch's SDPA.

A packed or padding-free row holds several sequences. With plain SDPA, transformers builds a block-diagonal mask
for the whole row and attends over row_length^2 positions, most of them masked. Here each sequence gets its own
causal SDPA call, so the work is sum(length^2) and no mask is read. The segment boundaries arrive as the
`cu_seq_lens_q` offsets that FlashAttention's varlen kernels take, so one batch layout serves both backends.

Shared-prompt rows (trainers/online/shared_prompt.py) add `shared_prompt_of`: for each segment, the segment whose
keys and values it reads before its own (its group's prompt), or -1. Such a row runs as one SDPA call per layer over
equal query blocks, each with its prefix's keys and its own (models/prefix_blocks.py: the layout, and why it was
chosen by measurement over a call per completion and over one dense mask), its gathered keys and values not kept for
the backward (`recomputed_but_attention`). Under context parallelism a shared row takes the all-gather form instead
(`gathered_segment_attention`, trainers/parts/shared_prompt_ring.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .prefix_blocks import BlockCache, prefix_block_attention

SEGMENT_SDPA = "leantune_segment_sdpa"
# The model input that says a shared-prompt row is split over a context-parallel group (trainers/online/
# shared_prompt_ring.py's `RingSegments`): its keys and values are gathered from the group
RING_SEGMENTS = "shared_prompt_ring"
# SDPA itself, as this process computes it: inside `context_parallel`, torch replaces F.scaled_dot_product_attention
# with its ring; the gathered form below computes its attention locally
local_sdpa = torch._C._nn.scaled_dot_product_attention
_registered = False
_blocks = BlockCache()  # the shared row being scored: its blocks, built on the first layer


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
    if prompt_of is not None:  # a shared-prompt row: one call over its prefix blocks (prefix_blocks.py)
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


def gathered_segment_attention(module, query, key, value, ring, dropout, scaling):
    """A shared-prompt row split over a context-parallel group: the group's keys and values gathered, each segment's
    local queries attending to the keys `ring` (RingSegments) names, through its mask."""
    keys, values = gather_along_time(key, ring.group), gather_along_time(value, ring.group)
    output = attend_gathered(query, keys, values, ring, dropout if module.training else 0.0, scaling)
    return output.transpose(1, 2).contiguous(), None


def attend_gathered(query, keys, values, ring, dropout_p: float = 0.0, scaling=None) -> torch.Tensor:
    """This process's queries [batch, heads, local, dim] against the group's gathered keys and values, segment by
    segment (`ring`: RingSegments): [batch, heads, local, dim]."""
    ring = ring.on(query.device)
    gqa = keys.shape[1] != query.shape[1]
    pieces = [recomputed(segment_attention, query[:, :, start:end], keys, values, index, mask, dropout_p, scaling,
                         gqa) for (start, end), index, mask in zip(ring.queries, ring.key_index, ring.masks)]
    return torch.cat(pieces, dim=2)


def segment_attention(query, keys, values, index, mask, dropout_p, scaling, gqa):
    """A segment's local queries against the gathered keys and values at `index`, through `mask`."""
    return local_sdpa(query, keys.index_select(2, index), values.index_select(2, index), attn_mask=mask,
                      dropout_p=dropout_p, scale=scaling, enable_gqa=gqa)


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


def recomputed(attention, *inputs):
    """`attention(*inputs)`, with its inputs (views of the row's keys and values) kept for the backward instead of
    the keys and values it puts together: those repeat the prompt's once per completion (G copies of it per layer,
    most of a shared row's activations at the peak); the backward puts them together again and recomputes the
    attention (measured at a 1,024-token prompt, 256-token completions, G = 16, checkpointed layers, on CPU: 282.7
    -> 223.6 MiB of activations, the update step's CPU time within the machine's noise)."""
    if not torch.is_grad_enabled():
        return attention(*inputs)

    return checkpoint(attention, *inputs, use_reentrant=False)


class _GatherAlongTime(torch.autograd.Function):
    """[batch, heads, local, dim] of each process -> the group's, process after process along time; the backward
    sums every process's gradient of the gathered tensor and keeps this process's part."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group, ctx.size, ctx.rank = group, dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=2)[ctx.rank], None


def gather_along_time(local: torch.Tensor, group) -> torch.Tensor:
    return _GatherAlongTime.apply(local, group)


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
