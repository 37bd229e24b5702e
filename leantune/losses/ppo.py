"""PPO's per-token pieces (RLHF form): a KL-penalised reward per completion token with the sequence's score on its
last token, whitening, generalised advantage estimation, and the clipped value loss.

Everything is over flat per-target tensors (the memory engine's layout: every completion's tokens, completion after
completion, in order) with `sequence` naming each target's completion, so padded, padding-free and chunked scoring
feed the same code.
"""

from __future__ import annotations

import torch

from .policy_gradient import k3_kl

KL_ESTIMATORS = ("k1", "k3")
WHITEN_EPS = 1e-8


def token_kl(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate at the sampled token: k1 = log pi - log ref (unbiased, may be
    negative), k3 = exp(ref - pi) - (ref - pi) - 1 (unbiased, never negative; lower variance)."""
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k3":
        return k3_kl(logps, ref_logps)
    raise ValueError(f"`kl_estimator` must be one of {KL_ESTIMATORS}, got {estimator!r}.")


def last_targets(sequence: torch.Tensor, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat index of each sequence's last target, whether the sequence has any target)."""
    counts = torch.bincount(sequence, minlength=num_sequences)
    return counts.cumsum(0) - 1, counts > 0


def kl_penalised_rewards(kl: torch.Tensor, scores: torch.Tensor, sequence: torch.Tensor, kl_coef: float):
    """-kl_coef x KL on every token, plus each completion's score on its last token (a completion without a target
    token gets no reward: nothing is trained on it)."""
    rewards = -kl_coef * kl
    last, present = last_targets(sequence, len(scores))
    return rewards.index_add(0, last[present], scores[present].to(rewards.dtype))


def moments(values: torch.Tensor) -> torch.Tensor:
    """(count, sum, sum of squares) in float64: summed over processes, they whiten over all of them."""
    values = values.double()
    return torch.stack([values.new_tensor(values.numel()), values.sum(), (values * values).sum()])


def whiten(values: torch.Tensor, totals: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8), mean and unbiased variance from `moments` totals; `shift_mean=False`
    keeps the mean (rewards: whitened in scale only)."""
    count, total, squares = totals.tolist()
    if count == 0:
        return values  # nothing to whiten (every completion of the round masked out)
    mean = total / count
    variance = (squares - count * mean * mean) / (count - 1) if count > 1 else 0.0
    whitened = (values - mean) * (max(variance, 0.0) + WHITEN_EPS) ** -0.5
    return whitened if shift_mean else whitened + mean


def as_grid(values: torch.Tensor, sequence: torch.Tensor, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat per-target values as [sequences, longest] (zeros after each end) and the mask of real entries."""
    counts = torch.bincount(sequence, minlength=num_sequences)
    starts = counts.cumsum(0) - counts
    position = torch.arange(len(sequence), device=sequence.device) - starts[sequence]
    width = int(counts.max()) if len(sequence) else 0
    grid = values.new_zeros(num_sequences, width)
    mask = torch.zeros(num_sequences, width, dtype=torch.bool, device=values.device)
    grid[sequence, position] = values
    mask[sequence, position] = True
    return grid, mask


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, sequence: torch.Tensor, num_sequences: int,
                   gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimation per completion, backwards from its last token (the value after it is 0):
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}. Flat in, flat out."""
    reward_grid, mask = as_grid(rewards, sequence, num_sequences)
    value_grid, _ = as_grid(values.to(rewards.dtype), sequence, num_sequences)
    advantages = torch.zeros_like(reward_grid)
    running = reward_grid.new_zeros(num_sequences)
    for t in reversed(range(reward_grid.shape[1])):
        following = value_grid[:, t + 1] if t + 1 < reward_grid.shape[1] else 0.0
        running = reward_grid[:, t] + gamma * following - value_grid[:, t] + gamma * lam * running
        advantages[:, t] = running
    return advantages[mask]


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float):
    """Per token 0.5 x max((V - R)^2, (clip(V, V_old +- c) - R)^2), and where the clipped term was the larger."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    return 0.5 * torch.max(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss
