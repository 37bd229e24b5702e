"""Reward-model loss: the Bradley-Terry pairwise loss over one scalar reward per sequence.

Written per pair so the trainer can sum it and divide by the pairs of the whole optimizer step (like DPO): micro-batch
size and gradient accumulation then do not change the loss. Summed over a batch and divided by its pairs it equals
TRL's `-logsigmoid(rc - rr [- margin]).mean() + c * mean((rc + rr) ** 2)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       margin: torch.Tensor | None = None,
                       center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """Per-pair loss -log sigmoid(r_chosen - r_rejected - margin) [+ c * (r_chosen + r_rejected)^2].

    `margin` (per pair, optional) asks for the chosen reward to exceed the rejected one by at least that much (Llama 2);
    the centring term (Eisenstein et al. 2023, Eq. 2) keeps rewards near zero mean, which the pairwise loss alone
    leaves free.
    """
    difference = chosen_rewards.float() - rejected_rewards.float()
    if margin is not None:
        difference = difference - margin.to(difference)
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen_rewards.float() + rejected_rewards.float()) ** 2
    return losses
