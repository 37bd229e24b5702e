"""GRPOConfig: TRL's field names and meanings (online fields in online_config.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..generation.backend import TRANSFORMERS
from ..losses.policy_gradient import (
    GRPO_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    VLLM_IMPORTANCE_SAMPLING_MODES,
    normalise_scale_rewards,
)
from .online_config import OnlineConfig
from .settings import generation_engine

logger = logging.getLogger("leantune.grpo")


MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class GRPOConfig(OnlineConfig):
    """Group Relative Policy Optimization. Defaults match TRL's."""

    loss_type: str = field(
        default="dapo",
        metadata={"help": "The objective and how token losses are averaged: grpo (per completion), dapo (per token of "
                  "the step), dr_grpo (per completion x max_completion_length), bnpo (per token of each "
                  "micro-batch), cispo (capped detached ratio x logp, per token), sapo (soft gate, per completion), "
                  "luspo (completion loss x length, per completion), vespo (Gamma-weighted logp, per token)."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "Divide advantages by the std of the group, of the batch, or none (True/False accepted)."},
    )

    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={"help": "Compute the logits of policy and reference in float32: hidden states and output-head weight "
                  "upcast for the projection (ScaleRL), on the chunked and full-logits paths and in transformers' "
                  "generate; the stored weights keep their dtype, so tied embeddings are fine. Not with a PEFT "
                  "adapter on the output head."},
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta, which bounds the loss "
                  "of negative-advantage tokens; None: off. Best above 1 + epsilon_high."},
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "token: one probability ratio per token; sequence (GSPO): one per completion, exp(mean over "
                  "its tokens of the log-ratio), applied to all its tokens (pairs best with loss_type='grpo')."},
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={"help": "Train the policy term only on tokens whose entropy is in this top share of the micro-"
                  "batch's completion tokens (over all processes); 1.0: all tokens, 0.2 recommended by the paper."},
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "With use_vllm: weight each token's policy loss by pi_trainer_old / pi_vllm of the sampled "
                  "tokens (vLLM's own log-probs against the trainer's), bounded as vllm_importance_sampling_mode "
                  "says. No effect with transformers' generate (the trainer samples itself), as in TRL."},
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={"help": "token_truncate / token_mask: per-token ratios clamped to / zeroed outside [clip_min, "
                  "clip_max]; sequence_truncate / sequence_mask: the same on each completion's product of ratios."},
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the vLLM importance ratios (None: none)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the vLLM importance ratios (None: none)."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Deprecated name of vllm_importance_sampling_clip_max (copied to it)."}
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={"help": "DeepSeek-V3.2's off-policy mask: a negative-advantage completion whose mean log-ratio "
                  "log pi_sampling - log pi_current over its tokens exceeds this gets no policy loss (the sampling "
                  "log-probs are vLLM's with use_vllm, else the generation-time policy's). None: off."},
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={"help": "Multiply each token's KL term (beta > 0) by its differentiable probability ratio "
                  "(DeepSeek-V3.2): the same value on-policy, but the gradient of the unbiased reverse KL."},
    )

    # TRL fields leantune does not implement yet: a value other than the default is refused (config_utils.py).
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "loss_type='sapo': temperature, advantage<=0."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "loss_type='sapo': temperature, advantage > 0."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "loss_type='vespo': power, advantage > 0."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "loss_type='vespo': decay, advantage > 0."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "loss_type='vespo': power, advantage <= 0."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "loss_type='vespo': decay, advantage <= 0."})
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={"help": "How several rewards combine: sum_then_normalize (weighted sum, then scale_rewards) or "
                  "normalize_then_sum (each normalised in its group, weighted sum, then normalised over the batch)."},
    )
    entropy_coef: float = field(
        default=0.0, metadata={"help": "Entropy bonus: loss - entropy_coef x mean token entropy (0: none)."}
    )
    use_adaptive_entropy: bool = field(
        default=False, metadata={"help": "Move entropy_coef after each step towards keeping entropy at entropy_target."}
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy: lowest coefficient."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy: highest coefficient."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "Adaptive entropy: step of the coefficient."})
    entropy_target: float = field(default=0.2, metadata={"help": "Adaptive entropy: target mean token entropy."})
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "With `tools` / `environment_factory`: most rounds of tool calls and "
                                         "generation after the first turn (None: until no tool is called or "
                                         "max_completion_length is spent)."}
    )
    log_completions_hub_repo: str | None = field(
        default=None, metadata={"help": "Hub dataset repo to push logged completions to. Not supported yet."}
    )

    def __post_init__(self):
        self.scale_rewards = normalise_scale_rewards(self.scale_rewards)
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"`loss_type` must be one of {GRPO_LOSS_TYPES}, got {self.loss_type!r}.")
        if self.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
            raise ValueError(f"`multi_objective_aggregation` must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, got "
                             f"{self.multi_objective_aggregation!r}.")
        if self.vllm_importance_sampling_cap is not None:
            logger.warning("`vllm_importance_sampling_cap` is deprecated (as in TRL); its value %s is used as "
                           "`vllm_importance_sampling_clip_max`.", self.vllm_importance_sampling_cap)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        validate_grpo_objective(self)
        super().__post_init__()

    @property
    def needs_sampling_logprobs(self) -> bool:
        """Whether the backend must return the sampled tokens' log-probs: vLLM's are read by the importance-sampling
        correction and the off-policy mask (transformers' generate samples from the trainer's own model)."""
        corrected = self.vllm_importance_sampling_correction or self.off_policy_mask_threshold is not None
        return corrected and generation_engine(self) != TRANSFORMERS


def validate_grpo_objective(args: GRPOConfig) -> None:
    if args.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"`importance_sampling_level` must be one of {IMPORTANCE_SAMPLING_LEVELS}, got "
                         f"{args.importance_sampling_level!r}.")
    if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
        logger.warning("loss_type='luspo' is defined on sequence-level ratios: its paper's setup is "
                       "importance_sampling_level='sequence'.")
    if args.loss_type == "vespo" and args.importance_sampling_level != "token":
        logger.warning("loss_type='vespo' forms its own sequence-level weights from the token ratios; "
                       "importance_sampling_level does not change it (leave it 'token').")
    if args.loss_type == "vespo" and args.vllm_importance_sampling_correction and \
            not args.vllm_importance_sampling_mode.startswith("token") and generation_engine(args) != TRANSFORMERS:
        raise ValueError("loss_type='vespo' folds vLLM's per-token importance weights into its sequence weight: set "
                         "vllm_importance_sampling_mode to 'token_truncate' or 'token_mask'.")
    if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        logger.warning("importance_sampling_level='sequence' with loss_type=%r sums per-token terms, so it weights each "
                       "sequence by its completion length (GSPO's objective is one term per sequence: "
                       "loss_type='grpo').", args.loss_type)
    if args.vllm_importance_sampling_mode not in VLLM_IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"`vllm_importance_sampling_mode` must be one of {VLLM_IMPORTANCE_SAMPLING_MODES}, got "
                         f"{args.vllm_importance_sampling_mode!r}.")
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        raise ValueError(f"`vllm_importance_sampling_clip_min` ({low}) must be less than "
                         f"`vllm_importance_sampling_clip_max` ({high}).")
    if (args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode.endswith("truncate")
            and low is None and high is None):
        raise ValueError("Set `vllm_importance_sampling_clip_min` or `vllm_importance_sampling_clip_max` (or both) "
                         f"for `vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r}`: it clamps "
                         "ratios to them.")
    if not 0.0 <= args.top_entropy_quantile <= 1.0:
        raise ValueError(f"`top_entropy_quantile` must be in [0, 1], got {args.top_entropy_quantile}.")
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 0:
        raise ValueError(f"`max_tool_calling_iterations` must be >= 0 or None (no limit), got "
                         f"{args.max_tool_calling_iterations}.")
    if args.delta is not None and args.delta <= 0:
        raise ValueError(f"`delta` must be positive (best above 1 + epsilon_high) or None, got {args.delta}.")
