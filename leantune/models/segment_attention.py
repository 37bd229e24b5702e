"""Attention over packed rows computed sequence by sequence ("varlen") with PyTorch's SDPA.

A packed or padding-free row holds several sequences. With plain SDPA, transformers builds a block-diagonal mask
for the whole row and attends over row_length^2 positions, most of them masked. Here each sequence gets its own
causal SDPA call, so the work is sum(length^2) and no mask is read. The segment boundaries arrive as the
`cu_seq_lens_q` offsets that FlashAttention's varlen kernels take, so one batch layout serves both backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SEGMENT_SDPA = "leantune_segment_sdpa"
_registered = False


def segment_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Drop-in for transformers' sdpa attention; uses per-sequence calls when cu_seq_lens_q is given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, length, dim = query.shape
    # Segments never cross rows, so the rows can be laid end to end and cut once with split(): one view per
    # sequence, and a backward that writes each piece's gradient into the shared buffer.
    lengths = torch.diff(cu_seq_lens).tolist()

    def flat(states):
        return states.transpose(0, 1).reshape(1, states.shape[1], batch * length, dim).split(lengths, dim=2)

    gqa = key.shape[1] != heads
    pieces = [
        F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout if module.training else 0.0, scale=scaling, enable_gqa=gqa
        )
        for q, k, v in zip(flat(query), flat(key), flat(value))
    ]
    output = torch.cat(pieces, dim=2).reshape(heads, batch, length, dim).transpose(0, 1)
    return output.transpose(1, 2).contiguous(), None


def register_segment_attention() -> str:
    """Register the attention (and, for padded batches, sdpa's mask builder) under one name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

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
