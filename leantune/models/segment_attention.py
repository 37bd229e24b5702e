"""Attention over packed rows computed sequence by sequence ("varlen") with PyTorch's SDPA.

A packed or padding-free row holds several sequences. With plain SDPA, transformers builds a block-diagonal mask
for the whole row and attends over row_length^2 positions, most of them masked. Here each sequence gets its own
causal SDPA call, so the work is sum(length^2) and no mask is read. The segment boundaries arrive as the
`cu_seq_lens_q` offsets that FlashAttention's varlen kernels take, so one batch layout serves both backends.

Shared-prompt rows (trainers/online/shared_prompt.py) add `shared_prompt_of`: for each segment, the segment whose
keys and values it reads before its own (its group's prompt), or -1. Such a segment (a completion, a "branch") runs
one SDPA call with K/V = cat(prompt, branch) and a [L_b, L_p + L_b] boolean mask (every prompt key, its own keys
causally): L_b x (L_p + L_b) work per branch, the prompt's K/V gradients summed from every branch by cat's
backward. Batching a group's branches in one call would attend over every branch's keys (G^2 x L_b^2 work, mostly
masked), and a prompt-then-branch split needs two calls and a log-sum-exp merge that SDPA does not expose. Measured
on CPU (one thread, 4 heads of 64, forward + backward): a 160:160 branch 4.1 ms against 6.4 ms for its unshared
causal row, 256:64 2.0 against 6.9 ms, 64:256 5.8 against 6.4 ms (the upper triangle of the branch's own block is
computed and masked). Each branch's call is recomputed in the backward (`recomputed`): SDPA would otherwise keep its
cat(prompt, branch) keys and values, the prompt's G times per layer. Under context parallelism a shared row takes
the all-gather form instead (`gathered_segment_attention`, trainers/parts/shared_prompt_ring.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

SEGMENT_SDPA = "leantune_segment_sdpa"
# The model input that says a shared-prompt row is split over a context-parallel group (trainers/online/
# shared_prompt_ring.py's `RingSegments`): its keys and values are gathered from the group
RING_SEGMENTS = "shared_prompt_ring"
# SDPA itself, as this process computes it: inside `context_parallel`, torch replaces F.scaled_dot_product_attention
# with its ring; the gathered form below computes its attention locally
local_sdpa = torch._C._nn.scaled_dot_product_attention
_registered = False


def segment_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Drop-in for transformers' sdpa attention; uses per-sequence calls when cu_seq_lens_q is given."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if kwargs.get(RING_SEGMENTS) is not None:  # a shared-prompt row split over a context-parallel group
        return gathered_segment_attention(module, query, key, value, kwargs[RING_SEGMENTS], dropout, scaling)
    if cu_seq_lens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, length, dim = query.shape
    # Segments never cross rows, so the rows can be laid end to end and cut once with split(): one view per
    # sequence, and a backward that writes each piece's gradient into the shared buffer.
    lengths = torch.diff(cu_seq_lens).tolist()

    def flat(states):
        return states.transpose(0, 1).reshape(1, states.shape[1], batch * length, dim).split(lengths, dim=2)

    gqa = key.shape[1] != heads
    dropout_p = dropout if module.training else 0.0
    queries, keys, values = flat(query), flat(key), flat(value)
    prompt_of = kwargs.get("shared_prompt_of")
    if prompt_of is None:
        pieces = [
            F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scaling, enable_gqa=gqa)
            for q, k, v in zip(queries, keys, values)
        ]
    else:
        pieces = []
        for i, prompt in enumerate(prompt_of.tolist()):
            q, k, v = queries[i], keys[i], values[i]
            if prompt < 0:
                pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                                             scale=scaling, enable_gqa=gqa))
                continue
            mask = branch_mask(keys[prompt].shape[2], q.shape[2], q.device)
            pieces.append(recomputed(branch_attention, q, keys[prompt], k, values[prompt], v, mask, dropout_p,
                                     scaling, gqa))
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


def branch_attention(query, prompt_keys, keys, prompt_values, values, mask, dropout_p, scaling, gqa):
    """A completion's queries against its prompt's keys and values, then its own (causally: `mask`)."""
    return F.scaled_dot_product_attention(query, torch.cat((prompt_keys, keys), dim=2),
                                          torch.cat((prompt_values, values), dim=2), attn_mask=mask,
                                          dropout_p=dropout_p, scale=scaling, enable_gqa=gqa)


def branch_mask(prompt_length: int, branch_length: int, device) -> torch.Tensor:
    """[L_b, L_p + L_b] booleans: a branch's queries see every prompt key and their own keys up to themselves (the
    causal mask aligned to the bottom right). Not torch's `causal_lower_right` bias: creating that tensor subclass
    fails under a tensor-tracking mode such as leantune's memory meter (MemTracker), which runs by default."""
    seen = torch.ones(branch_length, prompt_length + branch_length, dtype=torch.bool, device=device)
    seen[:, prompt_length:] = seen[:, prompt_length:].tril()
    return seen


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
