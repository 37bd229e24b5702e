"""liger-kernel's fused linear cross-entropy, fed the same targets as leantune's own losses (CUDA only)."""

from __future__ import annotations

import torch

from ..models.output_head import OutputHead
from .token_logprobs import Targets


def liger_can_run(head: OutputHead) -> bool:
    """Liger fuses a plain Linear head (optionally soft-capped); other heads go through the chunked path."""
    return type(head.module) is torch.nn.Linear and head.scale == 1.0 and head.temperature == 1.0


def liger_nll_sum(hidden: torch.Tensor, head: OutputHead, targets: Targets) -> torch.Tensor:
    """Summed negative log-likelihood of the targets, computed by Liger without materialising the logits."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets.index)
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum", softcap=head.softcap)
    loss = loss_fn(head.module.weight, flat, targets.tokens, head.module.bias)
    return (loss[0] if isinstance(loss, tuple) else loss).float()
