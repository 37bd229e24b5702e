"""A shared-prompt row split over a context-parallel group (trainers/parts/shared_prompt_ring.py's `RingSegments`):
each process's queries attend to the group's keys and values, gathered along time, segment by segment
(models/segment_attention.py dispatches here when the row carries `RING_SEGMENTS`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

# The model input that says a shared-prompt row is split over a context-parallel group (trainers/parts/
# shared_prompt_ring.py's `RingSegments`): its keys and values are gathered from the group
RING_SEGMENTS = "shared_prompt_ring"
# SDPA itself, as this process computes it: inside `context_parallel`, torch replaces F.scaled_dot_product_attention
# with its ring; the gathered form below computes its attention locally
local_sdpa = torch._C._nn.scaled_dot_product_attention


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
