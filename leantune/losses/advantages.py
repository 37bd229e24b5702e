"""Advantages of the online methods, from the rewards of each prompt's group of completions.

Rewards arrive as [prompts x num_generations] in group order. A NaN reward means no reward function scored that
completion: it is left out of its group's statistics and gets advantage 0 (no learning signal either way).

Rewards are float32 (reward functions' values are refused beyond its range, rewards/functions.py), but a group's
statistics are computed in float64: a float32 variance overflows above rewards of about 1.8e19, and every
advantage of the group would become 0 without a word. The advantages go back to the rewards' dtype for the loss;
one beyond float32's range (possible only unscaled: `scale_rewards="none"`, RLOO without `normalize_advantages`,
rewards near +-3.4e38) is refused in one line, never clamped or zeroed (`ADVANTAGE_BOUND`).
"""

from __future__ import annotations

import math

import torch

SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4
# The largest advantage the loss can take: float32's largest finite value (the policy loss runs in float32 or less)
ADVANTAGE_BOUND = torch.finfo(torch.float32).max


def no_nan(advantages: torch.Tensor) -> torch.Tensor:
    """NaN (an unscored completion) -> 0; an infinity stays one for `within_bound` to refuse (nan_to_num alone would
    clamp it to the dtype's largest value)."""
    return torch.nan_to_num(advantages, nan=0.0, posinf=math.inf, neginf=-math.inf)


def within_bound(advantages: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """float64 advantages back in the rewards' dtype, refused in one line where one is beyond `ADVANTAGE_BOUND`
    (float32 would hold an infinity there, which the loss would turn into NaN or a clamp would hide)."""
    beyond = advantages.abs() > ADVANTAGE_BOUND
    if beyond.any():
        raise ValueError(f"{int(beyond.sum())} advantage(s) of this round are beyond float32's range (+-3.4e38; "
                         f"largest {advantages.abs().max().item():.3g}) with {what}: scale the rewards down or "
                         "normalise them (scale_rewards='group' or 'batch'; RLOO: normalize_advantages=True).")
    return advantages.to(dtype)


def normalise_scale_rewards(value) -> str:
    """TRL accepts True/False too: True is "group", False is "none"."""
    if value is True or value in ("true", "True"):
        return "group"
    if value is False or value in ("false", "False"):
        return "none"
    if value not in SCALE_REWARDS:
        raise ValueError(f"`scale_rewards` must be one of {SCALE_REWARDS} (or True/False), got {value!r}.")
    return value


def nan_std(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample standard deviation (n - 1) over the non-NaN entries; NaN when fewer than two."""
    valid = ~torch.isnan(values)
    count = valid.sum(dim=dim, keepdim=True) if dim is not None else valid.sum()
    mean = torch.nanmean(values, dim=dim, keepdim=True) if dim is not None else torch.nanmean(values)
    squares = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values))
    total = squares.sum(dim=dim, keepdim=True) if dim is not None else squares.sum()
    std = (total / (count - 1)).sqrt()
    std = torch.where(count > 1, std, torch.full_like(std, float("nan")))
    return std if keepdim or dim is None else std.squeeze(dim)


def group_relative_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"):
    """GRPO: reward minus its group's mean, divided by the group's (or the whole batch's) std unless "none".

    Returns (advantages [N], group std [N / num_generations]), in the rewards' dtype (computed in float64).
    """
    groups = rewards.double().view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1, keepdim=True)
    group_std = nan_std(groups, dim=1)
    advantages = groups - mean
    if scale_rewards == "group":
        advantages = advantages / (group_std.unsqueeze(1) + STD_EPS)
    elif scale_rewards == "batch":
        advantages = advantages / (nan_std(rewards.double()) + STD_EPS)
    advantages = within_bound(no_nan(advantages.reshape(-1)), rewards.dtype,
                              f"scale_rewards={scale_rewards!r}")
    return advantages, group_std.to(rewards.dtype)


def normalize_then_sum_advantages(per_function: torch.Tensor, weights: torch.Tensor, num_generations: int):
    """GRPO's multi_objective_aggregation="normalize_then_sum" (GDPO): each reward function's values are first
    normalised within their group ((r - group mean) / (group std + eps)), then weighted and summed, and the sums
    normalised over the whole batch; a function that did not score a completion adds nothing to its sum.

    `per_function` is [N, F] (NaN: not scored); returns advantages [N] (0 for a completion no function scored), in its
    dtype (computed in float64)."""
    dtype, per_function = per_function.dtype, per_function.double()
    count = per_function.shape[1]
    groups = per_function.reshape(-1, num_generations, count)
    mean = torch.nanmean(groups, dim=1, keepdim=True)
    std = torch.nan_to_num(nan_std(groups, dim=1, keepdim=True), nan=0.0)
    normalised = ((groups - mean) / (std + STD_EPS)).reshape(-1, count)
    combined = (normalised * weights.to(normalised.dtype).unsqueeze(0)).nansum(dim=1)
    combined[torch.isnan(per_function).all(dim=1)] = float("nan")
    spread = nan_std(combined) if combined.numel() > 1 else torch.zeros(())
    advantages = (combined - torch.nanmean(combined)) / (torch.nan_to_num(spread, nan=0.0) + STD_EPS)
    return within_bound(no_nan(advantages), dtype, "multi_objective_aggregation='normalize_then_sum'")


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False):
    """RLOO: reward minus the mean reward of the other scored completions of its group; optionally normalised
    over the batch. Returns (advantages [N], group std [N / num_generations]), in the rewards' dtype (computed in
    float64). A completion alone in its group with a reward (no others to compare with) gets advantage 0."""
    groups = rewards.double().view(-1, num_generations)
    scored = (~torch.isnan(groups)).sum(dim=1, keepdim=True)
    others_mean = (torch.nansum(groups, dim=1, keepdim=True) - groups) / (scored - 1)
    advantages = (groups - others_mean).reshape(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nan_std(advantages) + STD_EPS)
    advantages = within_bound(no_nan(advantages), rewards.dtype,
                              f"RLOO's normalize_advantages={normalize}")
    return advantages, nan_std(groups, dim=1).to(rewards.dtype)
