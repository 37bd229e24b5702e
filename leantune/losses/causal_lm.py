"""The causal-LM targets: which token each position predicts, and how many positions are learned (the count a step's
summed loss is divided by). The per-token log-probs and their sums live in token_logprobs.py and liger.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.collators import IGNORE_INDEX  # the label of a position that is not learned, set by the collators


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The token each position predicts: labels moved one step left, the last position predicting nothing."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels[..., 1:] != IGNORE_INDEX).sum()
