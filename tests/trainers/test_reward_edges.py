"""Rewards at float32's edge (issue 39, item 6): a group's statistics never overflow into a silent zero, and an
advantage float32 cannot hold is refused in one line, never clamped. Every `scale_rewards`, RLOO's two forms and
GRPO's normalize_then_sum, at rewards of 1e19 (a float32 variance overflows from ~1.8e19), 1e30 and 3e38."""

from __future__ import annotations

import math

import pytest
import torch

from leantune import GRPOTrainer
from leantune.losses.policy_gradient import (
    ADVANTAGE_BOUND,
    group_relative_advantages,
    leave_one_out_advantages,
    normalize_then_sum_advantages,
)

from ..fixtures.data import reversal_prompts_with_answers as prompts
from ..fixtures.models import char_model
from ..fixtures.online_rounds import grpo_config as config
from ..fixtures.online_rounds import one_round

SCALES = (1e19, 1e30, 3e38)
# two groups of four, every value within [-1, 1] so that scale x base stays within float32's range at 3e38
BASE = torch.tensor([1.0, 0.25, -0.5, 0.75, -1.0, 0.5, 0.0, -0.25], dtype=torch.float64)
# The float32 rewards are scale x BASE rounded once (relative 6e-8), the float64 statistics add ~1e-16, and the
# result is rounded to float32 once more: a few 1e-7 relative. STD_EPS (1e-4) against a std of scale x ~0.6 is
# below 1e-22 relative. 1e-5 relative leaves a wide margin and still fails on any zeroed or clamped advantage.
RTOL = 1e-5


def by_hand(base: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """The advantages of `base` without the eps (negligible at these scales), in float64."""
    groups = base.view(-1, 4)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / groups.std(dim=1, keepdim=True)
    elif scale_rewards == "batch":
        centred = centred / base.std()
    return centred.reshape(-1)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("scale_rewards", ["group", "batch"])
def test_scaled_advantages_do_not_depend_on_the_rewards_size(scale, scale_rewards):
    rewards = (BASE * scale).float()
    assert torch.isfinite(rewards).all()
    advantages, group_std = group_relative_advantages(rewards, 4, scale_rewards)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages.double(), by_hand(BASE, scale_rewards), rtol=RTOL, atol=0)
    assert (group_std > 0).all()  # float64 statistics: no group's spread overflowed or vanished


@pytest.mark.parametrize("scale", SCALES)
def test_unscaled_advantages_are_exact_or_refused(scale):
    rewards = (BASE * scale).float()
    expected = by_hand(rewards.double(), "none")  # the float32 rewards' own centred values
    if expected.abs().max() > ADVANTAGE_BOUND:
        with pytest.raises(ValueError, match="beyond float32's range.*scale_rewards='none'"):
            group_relative_advantages(rewards, 4, "none")
        return
    advantages, _ = group_relative_advantages(rewards, 4, "none")
    torch.testing.assert_close(advantages.double(), expected, rtol=RTOL, atol=0)


def test_the_issues_example_is_refused_not_clamped():
    # [3e38, 3e38, -3e38, 1]: the group's mean is 7.5e37, so -3e38's advantage is -3.75e38, beyond float32
    rewards = torch.tensor([3e38, 3e38, -3e38, 1.0])
    with pytest.raises(ValueError, match="1 advantage"):
        group_relative_advantages(rewards, 4, "none")
    # scaled, the same group trains: finite, not zero, the sign of each reward's distance from the mean
    advantages, _ = group_relative_advantages(rewards, 4, "group")
    assert torch.isfinite(advantages).all() and (advantages != 0).all()
    assert advantages.sign().tolist() == [1.0, 1.0, -1.0, -1.0]


@pytest.mark.parametrize("scale", SCALES)
def test_leave_one_out_advantages_at_the_edge(scale):
    rewards = (BASE * scale).float()
    groups = rewards.double().view(-1, 4)
    others = (groups.sum(dim=1, keepdim=True) - groups) / 3
    expected = (groups - others).reshape(-1)
    normalised, _ = leave_one_out_advantages(rewards, 4, normalize=True)
    torch.testing.assert_close(normalised.double(), (expected - expected.mean()) / expected.std(), rtol=RTOL, atol=0)
    if expected.abs().max() > ADVANTAGE_BOUND:
        with pytest.raises(ValueError, match="normalize_advantages=False"):
            leave_one_out_advantages(rewards, 4)
    else:
        advantages, _ = leave_one_out_advantages(rewards, 4)
        torch.testing.assert_close(advantages.double(), expected, rtol=RTOL, atol=0)


@pytest.mark.parametrize("scale", SCALES)
def test_normalize_then_sum_at_the_edge(scale):
    per_function = torch.stack([BASE * scale, BASE.flip(0) * scale], dim=1).float()
    got = normalize_then_sum_advantages(per_function, torch.tensor([1.0, 1.0]), 4)
    assert got.dtype == torch.float32
    at_unit_scale = normalize_then_sum_advantages(torch.stack([BASE, BASE.flip(0)], dim=1), torch.ones(2), 4)
    # the same advantages as the rewards divided by `scale` (only eps, 1e-4 against stds of ~0.6, differs there)
    torch.testing.assert_close(got.double(), at_unit_scale, rtol=1e-3, atol=1e-3)
    assert torch.isfinite(got).all() and (got != 0).any()


def test_grpo_round_with_rewards_at_float32s_edge_trains(char_tokenizer):
    """A real round: rewards of +-3e38 (and one of 1e19 spacing within a group) reach finite, non-zero advantages."""
    def edge(completions, **kwargs):
        return [3e38 if i % 2 else -3e38 + 1e19 * i for i in range(len(completions))]

    trainer = GRPOTrainer(char_model(char_tokenizer), edge, args=config(max_steps=1, scale_rewards="group"),
                          train_dataset=prompts(), processing_class=char_tokenizer)
    advantages = torch.cat([batch["advantages"] for batch in one_round(trainer)])
    assert torch.isfinite(advantages).all() and (advantages != 0).all()
    # each group of 4 is [-3e38, 3e38, -3e38 + 2e19, 3e38]: alternating signs of about 0.87 (1 / sqrt(4/3))
    assert advantages.abs().sub(math.sqrt(3) / 2).abs().max() < 1e-5
    assert math.isfinite(trainer.train().training_loss)
