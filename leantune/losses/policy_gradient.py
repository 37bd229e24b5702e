"""The clipped policy-gradient objective of GRPO and RLOO, over flat per-target log-probs.

Inputs are 1-D over the scored completion tokens of a micro-batch (the memory engine's flat target order), with
`sequence` giving each token's completion. Every function returns a *sum* that the trainer divides by the count of
the whole optimizer step (`loss_items`), so micro-batching and gradient accumulation do not change the result.

GRPO loss types (how token losses become one number), with the count each divides by:
- grpo:    each completion's mean token loss, summed;               / completions of the step
- dapo:    token losses summed;                                     / completion tokens of the step
- dr_grpo: token losses summed;                                     / completions x max_completion_length
- bnpo:    token losses summed, / the micro-batch's own tokens;     / micro-batches of the step
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")


@dataclass
class ClippedTerms:
    loss: torch.Tensor  # per unit (token or sequence): -min(r A, clip(r) A)
    ratio: torch.Tensor
    low_clipped: torch.Tensor  # bool: ratio below 1 - eps_low where A < 0 (the clip removed the gradient)
    high_clipped: torch.Tensor  # bool: ratio above 1 + eps_high where A > 0

    def clip_metrics(self) -> dict[str, torch.Tensor]:
        """Shares of units whose gradient the clip removed (NaN when there are none)."""
        return {
            "clip_ratio/low_mean": self.low_clipped.float().mean(),
            "clip_ratio/high_mean": self.high_clipped.float().mean(),
            "clip_ratio/region_mean": (self.low_clipped | self.high_clipped).float().mean(),
        }


def clipped_surrogate(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                      epsilon_low: float, epsilon_high: float) -> ClippedTerms:
    """PPO's clipped surrogate, per unit; with old == current (on-policy) its value is -A and its gradient A."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return ClippedTerms(loss, ratio.detach(), low, high)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate exp(ref - logp) - (ref - logp) - 1: unbiased, never negative."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def per_sequence_sum(values: torch.Tensor, sequence: torch.Tensor, num_sequences: int) -> torch.Tensor:
    return values.new_zeros(num_sequences).index_add(0, sequence, values)


def grpo_loss_sum(token_loss: torch.Tensor, sequence: torch.Tensor, num_sequences: int, loss_type: str,
                  max_completion_length: int) -> torch.Tensor:
    """The micro-batch's share of the GRPO loss (before division by the step's `loss_items`, see above)."""
    if loss_type == "grpo":
        tokens = per_sequence_sum(torch.ones_like(token_loss), sequence, num_sequences).clamp(min=1)
        return (per_sequence_sum(token_loss, sequence, num_sequences) / tokens).sum()
    if loss_type in ("dapo", "dr_grpo"):
        return token_loss.sum()
    if loss_type == "bnpo":
        return token_loss.sum() / max(int(token_loss.numel()), 1)
    raise ValueError(f"Unknown GRPO loss_type {loss_type!r}; choose from {GRPO_LOSS_TYPES}.")


def grpo_loss_items(loss_type: str, num_sequences: int, num_tokens: int, max_completion_length: int) -> int:
    """What one micro-batch adds to the step's divisor for this loss type."""
    if loss_type == "grpo":
        return num_sequences
    if loss_type == "dapo":
        return num_tokens
    if loss_type == "dr_grpo":
        return num_sequences * max_completion_length
    if loss_type == "bnpo":
        return 1
    raise ValueError(f"Unknown GRPO loss_type {loss_type!r}; choose from {GRPO_LOSS_TYPES}.")
