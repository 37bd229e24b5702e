"""GRPOConfig: TRL's field names and meanings (online fields in online_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..losses.advantages import normalise_scale_rewards
from ..losses.policy_gradient import GRPO_LOSS_TYPES
from .online_config import OnlineConfig


@dataclass
class GRPOConfig(OnlineConfig):
    """Group Relative Policy Optimization. Defaults match TRL's."""

    loss_type: str = field(
        default="dapo",
        metadata={"help": "How token losses are averaged: grpo (per completion), dapo (per token of the step), "
                  "dr_grpo (per completion x max_completion_length), bnpo (per token of each micro-batch)."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "Divide advantages by the std of the group, of the batch, or none (True/False accepted)."},
    )

    def __post_init__(self):
        self.scale_rewards = normalise_scale_rewards(self.scale_rewards)
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"`loss_type` must be one of {GRPO_LOSS_TYPES}, got {self.loss_type!r}.")
        super().__post_init__()
