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

    # TRL fields leantune does not implement yet: a value other than the default is refused (config_utils.py).
    cast_lm_head_to_fp32: bool = field(
        default=False, metadata={"help": "Hold the output head of policy and reference in float32. Not supported yet."}
    )
    delta: float | None = field(
        default=None, metadata={"help": "Two-sided clipping: cap on ratios of negative-advantage tokens. Not supported."}
    )
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "loss_type='sapo': temperature, advantage<=0."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "loss_type='sapo': temperature, advantage > 0."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "loss_type='vespo': power, advantage > 0."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "loss_type='vespo': decay, advantage > 0."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "loss_type='vespo': power, advantage <= 0."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "loss_type='vespo': decay, advantage <= 0."})
    importance_sampling_level: str = field(
        default="token", metadata={"help": "Ratios per token, or per sequence (GSPO). Not supported yet: token."}
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={"help": "How several rewards combine: weighted sum, then scaling. Other orders not supported yet."},
    )
    top_entropy_quantile: float = field(
        default=1.0, metadata={"help": "Train only this top share of tokens by entropy. Not supported yet: 1.0."}
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "Weight of an entropy bonus. Not supported yet: 0."})
    use_adaptive_entropy: bool = field(
        default=False, metadata={"help": "Adjust entropy_coef towards entropy_target. Not supported yet."}
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy: lowest coefficient."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy: highest coefficient."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "Adaptive entropy: step of the coefficient."})
    entropy_target: float = field(default=0.2, metadata={"help": "Adaptive entropy: target mean token entropy."})
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "Most tool-calling turns of an agent. Not supported yet."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "Reweight tokens for the gap between vLLM's and the trainer's log-probs. Not supported yet: "
                  "only the default is accepted."},
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask", metadata={"help": "How that reweighting bounds its ratios. Not supported yet."}
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound of those ratios. Not supported yet."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound of those ratios. Not supported yet."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Older name of vllm_importance_sampling_clip_max. Not supported yet."}
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={"help": "Mask negative-advantage completions this far off-policy. Not supported yet."},
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={"help": "Weight the KL term by the probability ratio. Not supported yet: only the default."},
    )
    log_completions_hub_repo: str | None = field(
        default=None, metadata={"help": "Hub dataset repo to push logged completions to. Not supported yet."}
    )

    def __post_init__(self):
        self.scale_rewards = normalise_scale_rewards(self.scale_rewards)
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"`loss_type` must be one of {GRPO_LOSS_TYPES}, got {self.loss_type!r}.")
        super().__post_init__()
