"""KTO losses, written once over per-sequence log-probabilities (summed completion log-probs).

Each example is judged on its own against a reference point: the KL divergence of policy from reference, estimated
on mismatched (prompt, completion) pairs and not differentiated through (KTO paper, eq. 7). The log-probabilities
come from the memory engine (full logits, chunked head or Liger), so every layout and path feeds this same code.
"""

from __future__ import annotations

import torch

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kl_estimate(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """Mean log-ratio of the mismatched completions, detached: the reference point z0 (clamp at 0 after gathering
    it across processes)."""
    return (policy_kl_logps.detach().float() - ref_kl_logps.float()).mean()


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0, loss_type: str = "kto"):
    """Per-example weighted losses and the implicit rewards beta * (log pi - log ref).

    kto: desirable 1 - sigmoid(beta (r - z0)), undesirable 1 - sigmoid(beta (z0 - r)), r the log-ratio;
    apo_zero_unpaired: desirable 1 - sigmoid(beta r), undesirable sigmoid(beta r) (no reference point).
    """
    logratio = policy_logps - ref_logps
    desirable = desirable.to(device=logratio.device, dtype=torch.bool)
    if loss_type == "kto":
        kl = torch.as_tensor(kl, dtype=logratio.dtype, device=logratio.device)
        desirable_loss = 1 - torch.sigmoid(beta * (logratio - kl))
        undesirable_loss = 1 - torch.sigmoid(beta * (kl - logratio))
    elif loss_type == "apo_zero_unpaired":
        desirable_loss = 1 - torch.sigmoid(beta * logratio)
        undesirable_loss = torch.sigmoid(beta * logratio)
    else:
        raise ValueError(f"Unknown KTO loss_type {loss_type!r}; choose from {KTO_LOSS_TYPES}.")
    losses = torch.where(desirable, desirable_weight * desirable_loss, undesirable_weight * undesirable_loss)
    return losses, beta * logratio.detach()
