"""Preference losses, written once over per-sequence log-probabilities (summed target log-probs).

The log-probabilities come from the memory engine (full logits, chunked head or Liger), so every layout and path
feeds this same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .token_logprobs import Targets, target_sequences

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def sequence_logps(logps: torch.Tensor, targets: Targets, starts: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Sum the per-target log-probs of each sequence; `starts` are the sequences' flat start offsets."""
    return logps.new_zeros(num_sequences).index_add(0, target_sequences(targets, starts), logps)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """Per-pair loss and the implicit rewards beta * (log pi - log ref) of chosen and rejected."""
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    margin = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:
        raise ValueError(f"Unknown DPO loss_type {loss_type!r}; choose from {DPO_LOSS_TYPES}.")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
