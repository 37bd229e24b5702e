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
