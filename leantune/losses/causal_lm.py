"""Causal-LM cross-entropy as a sum over target tokens; the trainer divides by the step's target count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.collators import IGNORE_INDEX  # the label of a position that is not learned, set by the collators


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The token each position predicts: labels moved one step left, the last position predicting nothing."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position negative log-likelihood of the next token, in fp32; 0 where there is no target."""
    targets = shifted_targets(labels)
    nll = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return nll.view(targets.shape)


def nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return token_nll(logits, labels).sum()
