"""The policy-gradient math of GRPO and RLOO: each completion's advantage from its group's rewards, then the clipped
objective over flat per-target log-probs (one job: what the policy's gradient is made of).

Inputs are 1-D over the scored completion tokens of a micro-batch (the memory engine's flat target order), with
`sequence` giving each token's completion. Every function returns a *sum* that the trainer divides by the count of
the whole optimizer step (`loss_items`), so micro-batching and gradient accumulation do not change the result.

GRPO loss types (how token losses become one number), with the count each divides by:
- grpo, sapo:          each completion's mean token loss, summed;   / completions of the step
- dapo, cispo, vespo:  token losses summed;                         / completion tokens of the step
- dr_grpo:             token losses summed;                         / completions x max_completion_length
- bnpo:                token losses summed, / the micro-batch's own tokens; / micro-batches of the step
- luspo:               token losses summed (a completion's loss times its length); / completions of the step

Per-token terms: grpo, dapo, dr_grpo, bnpo and luspo use the clipped surrogate; cispo (MiniMax-M1) the ratio capped
at epsilon_high and detached, times A x logp; sapo a soft gate sigmoid(tau (r - 1)) x 4 / tau in place of the clip;
vespo a detached Gamma weight phi(w) = exp(lambda + k log w - lambda w) of the completion's summed log-ratio, times
A x logp.

`grpo_token_loss` composes GRPO's per-token loss in TRL 1.16's order: the clipped ratio (per token, or per sequence
for GSPO; `delta` caps it for two-sided clipping), times the off-policy sequence mask, times the high-entropy token
mask, times the truncated importance weight between the generation engine and the trainer, plus beta x the k3 KL
(multiplied by the differentiable ratio with `use_bias_correction_kl`).

Advantages (read by the online methods' `attach_loss_inputs`): rewards arrive as [prompts x num_generations] in
group order. A NaN reward means no reward function scored that completion: it is left out of its group's statistics
and gets advantage 0 (no learning signal either way).

Rewards are float32 (reward functions' values are refused beyond its range, rewards/functions.py), but a group's
statistics are computed in float64: a float32 variance overflows above rewards of about 1.8e19, and every
advantage of the group would become 0 without a word. The advantages go back to the rewards' dtype for the loss;
one beyond float32's range (possible only unscaled: `scale_rewards="none"`, RLOO without `normalize_advantages`,
rewards near +-3.4e38) is refused in one line, never clamped or zeroed (`ADVANTAGE_BOUND`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .token_logprobs import per_sequence_sum

GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4
# The largest advantage the loss can take: float32's largest finite value (the policy loss runs in float32 or less)
ADVANTAGE_BOUND = torch.finfo(torch.float32).max


# --- advantages: each completion's reward against its group's --------------------------------------------------


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


# --- the clipped objective ------------------------------------------------------------------------------------
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
                      epsilon_low: float, epsilon_high: float, delta: float | None = None) -> ClippedTerms:
    """PPO's clipped surrogate, per unit; with old == current (on-policy) its value is -A and its gradient A."""
    return clipped_surrogate_of_log_ratio(logps - old_logps, advantages, epsilon_low, epsilon_high, delta)


def clipped_surrogate_of_log_ratio(log_ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                                   epsilon_high: float, delta: float | None = None) -> ClippedTerms:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with r = exp(log_ratio); `delta` (INTELLECT-2's two-sided
    clipping) also caps the unclipped r at delta, which bounds the loss of negative-advantage units whose ratio
    grew large. As in TRL, the clip counts are taken on the capped ratio."""
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return ClippedTerms(loss, ratio.detach(), low, high)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate exp(ref - logp) - (ref - logp) - 1: unbiased, never negative."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


# --- how a loss type turns a micro-batch's token losses into one number, and the step's divisor ------------------
# (the module's docstring lists them). The trainer takes its type's `LossAggregation` once, when it is built.


def sequence_means(token_loss: torch.Tensor, sequence: torch.Tensor, num_sequences: int, total=None,
                   num_tokens: int | None = None) -> torch.Tensor:
    """grpo, sapo: each completion's mean token loss, summed. Under context parallelism `token_loss` holds this
    process's part of every sequence's tokens and `total` makes each sequence's token count whole (the parts of the
    sum add up over the group)."""
    tokens = per_sequence_sum(torch.ones_like(token_loss), sequence, num_sequences)
    tokens = (tokens if total is None else total(tokens)).clamp(min=1)
    return (per_sequence_sum(token_loss, sequence, num_sequences) / tokens).sum()


def token_sum(token_loss: torch.Tensor, sequence: torch.Tensor, num_sequences: int, total=None,
              num_tokens: int | None = None) -> torch.Tensor:
    """dapo, dr_grpo, cispo, vespo, luspo: the token losses summed."""
    return token_loss.sum()


def micro_batch_mean(token_loss: torch.Tensor, sequence: torch.Tensor, num_sequences: int, total=None,
                     num_tokens: int | None = None) -> torch.Tensor:
    """bnpo: the token losses over the micro-batch's own tokens (`num_tokens`: the whole micro-batch's under context
    parallelism)."""
    return token_loss.sum() / max(int(token_loss.numel()) if num_tokens is None else num_tokens, 1)


def completions_of(num_sequences: int, num_tokens: int, max_completion_length: int) -> int:
    return num_sequences


def tokens_of(num_sequences: int, num_tokens: int, max_completion_length: int) -> int:
    return num_tokens


def padded_tokens_of(num_sequences: int, num_tokens: int, max_completion_length: int) -> int:
    return num_sequences * max_completion_length


def one_per_micro_batch(num_sequences: int, num_tokens: int, max_completion_length: int) -> int:
    return 1


@dataclass(frozen=True)
class LossAggregation:
    """A loss type's `total(token_loss, sequence, num_sequences, total=None, num_tokens=None)`: the micro-batch's
    share of the loss (before division by the step's `loss_items`), and `items(num_sequences, num_tokens,
    max_completion_length)`: what one micro-batch adds to that divisor."""

    total: Callable[..., torch.Tensor]
    items: Callable[[int, int, int], int]


LOSS_AGGREGATIONS = {
    "grpo": LossAggregation(sequence_means, completions_of), "sapo": LossAggregation(sequence_means, completions_of),
    "dapo": LossAggregation(token_sum, tokens_of), "cispo": LossAggregation(token_sum, tokens_of),
    "vespo": LossAggregation(token_sum, tokens_of), "dr_grpo": LossAggregation(token_sum, padded_tokens_of),
    "luspo": LossAggregation(token_sum, completions_of), "bnpo": LossAggregation(micro_batch_mean, one_per_micro_batch),
}


def loss_aggregation(loss_type: str) -> LossAggregation:
    if loss_type not in LOSS_AGGREGATIONS:
        raise ValueError(f"Unknown GRPO loss_type {loss_type!r}; choose from {GRPO_LOSS_TYPES}.")
    return LOSS_AGGREGATIONS[loss_type]


# --- GRPO's per-token loss and the options that reshape it (TRL 1.16's meanings) --------------------------------

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def tokens_per_sequence(values: torch.Tensor, sequence: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """How many of the flat tokens belong to each sequence (0 for a completion with nothing scored)."""
    return per_sequence_sum(torch.ones_like(values), sequence, num_sequences)


def per_sequence_mean(values: torch.Tensor, sequence: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Each sequence's mean over its tokens (0 for a sequence without tokens)."""
    tokens = tokens_per_sequence(values, sequence, num_sequences).clamp(min=1)
    return per_sequence_sum(values, sequence, num_sequences) / tokens


@dataclass(frozen=True)
class GRPOObjective:
    """The config fields that shape GRPO's per-token loss (TRL's names and defaults)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    loss_type: str = "dapo"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @classmethod
    def from_config(cls, args) -> GRPOObjective:
        return cls(args.epsilon, args.upper_epsilon, args.delta, args.importance_sampling_level, args.beta,
                   args.use_bias_correction_kl, args.loss_type, args.sapo_temperature_pos, args.sapo_temperature_neg,
                   args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg)


@dataclass(frozen=True)
class RatioUnits:
    """What the ratio is taken over (`importance_sampling_level`): each token, or (GSPO's "sequence") each completion,
    one ratio exp(mean over its tokens of logp - old_logp) differentiable through every token's log-prob. At the
    sequence level `sequence` gives each token its completion's value and `scored` marks the completions with scored
    tokens, the units the metrics average over."""

    log_ratio: torch.Tensor
    advantages: torch.Tensor
    sequence: torch.Tensor | None = None
    scored: torch.Tensor | None = None

    def to_tokens(self, values: torch.Tensor) -> torch.Tensor:
        return values if self.sequence is None else values.index_select(0, self.sequence)

    def counted(self, values: torch.Tensor) -> torch.Tensor:
        return values if self.scored is None else values[self.scored]


def ratio_units(log_ratio: torch.Tensor, advantages: torch.Tensor, sequence: torch.Tensor, num_sequences: int,
                level: str) -> RatioUnits:
    if level == "token":
        return RatioUnits(log_ratio, advantages.index_select(0, sequence))
    if level == "sequence":
        return RatioUnits(per_sequence_mean(log_ratio, sequence, num_sequences), advantages, sequence,
                          tokens_per_sequence(log_ratio, sequence, num_sequences) > 0)
    raise ValueError(f"`importance_sampling_level` must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}.")


def clipped_token_loss(units: RatioUnits, logps: torch.Tensor, objective: GRPOObjective):
    """grpo, dapo, dr_grpo, bnpo, luspo: the clipped surrogate (`delta` capping the ratio)."""
    terms = clipped_surrogate_of_log_ratio(units.log_ratio, units.advantages, objective.epsilon_low,
                                           objective.epsilon_high, objective.delta)
    metrics = ClippedTerms(units.counted(terms.loss), units.counted(terms.ratio), units.counted(terms.low_clipped),
                           units.counted(terms.high_clipped)).clip_metrics()
    return units.to_tokens(terms.loss), metrics


def cispo_token_loss(units: RatioUnits, logps: torch.Tensor, objective: GRPOObjective):
    """cispo: the ratio itself capped at epsilon_high and detached, times A x logp."""
    ratio = torch.exp(units.log_ratio)
    weight = torch.clamp(ratio, max=objective.epsilon_high).detach()
    clipped = (ratio > objective.epsilon_high) & (units.advantages > 0)
    token_loss = -units.to_tokens(weight * units.advantages) * logps
    return token_loss, {"cispo_clip_ratio": units.counted(clipped).float().mean()}


def sapo_token_loss(units: RatioUnits, logps: torch.Tensor, objective: GRPOObjective):
    """sapo: a soft gate sigmoid(tau (r - 1)) x 4 / tau in place of the clip, tau by the advantage's sign."""
    temperature = torch.full_like(units.advantages, objective.sapo_temperature_neg).masked_fill(
        units.advantages > 0, objective.sapo_temperature_pos)  # in the advantages' dtype, not float32
    gate = torch.sigmoid(temperature * (torch.exp(units.log_ratio) - 1)) * 4 / temperature
    return units.to_tokens(-gate * units.advantages), {}


UNIT_LOSSES = {**dict.fromkeys(CLIPPED_LOSS_TYPES, clipped_token_loss), "cispo": cispo_token_loss,
               "sapo": sapo_token_loss}  # vespo weighs whole completions: `vespo_token_loss`


def vespo_token_loss(log_ratio: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor, sequence: torch.Tensor,
                     num_sequences: int, objective: GRPOObjective, sampling_weights: torch.Tensor | None):
    """vespo: each completion's Gamma weight phi (`vespo_weights`, the sampling weights folded in) x A x logp."""
    phi = vespo_weights(log_ratio, advantages, sequence, num_sequences, objective, sampling_weights)
    has_tokens = tokens_per_sequence(logps, sequence, num_sequences) > 0
    return -(phi * advantages).index_select(0, sequence) * logps, {"vespo/phi_seq_mean": phi[has_tokens].mean()}


def grpo_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, sequence: torch.Tensor,
                    num_sequences: int, objective: GRPOObjective, ref_logps: torch.Tensor | None = None,
                    sampling_weights: torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
                    sequence_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-token loss, metrics) over the flat completion tokens; `advantages` and `sequence_mask` are per sequence.

    At the sequence level (GSPO, `RatioUnits`) the clipped loss of a completion is given to each of its tokens, so the
    loss types aggregate it as TRL's broadcast [B, 1] loss (grpo: the completion's value; dapo/bnpo/dr_grpo: its value
    x its length). Clip metrics count completions at that level, tokens otherwise.
    """
    log_ratio = logps - old_logps
    units = ratio_units(log_ratio, advantages, sequence, num_sequences, objective.importance_sampling_level)
    if objective.loss_type == "vespo":
        token_loss, metrics = vespo_token_loss(log_ratio, logps, advantages, sequence, num_sequences, objective,
                                               sampling_weights)
        sampling_weights = None  # folded into phi
    elif objective.loss_type in UNIT_LOSSES:
        token_loss, metrics = UNIT_LOSSES[objective.loss_type](units, logps, objective)
    else:
        raise ValueError(f"Unknown GRPO loss_type {objective.loss_type!r}; choose from {GRPO_LOSS_TYPES}.")
    if sequence_mask is not None:
        token_loss = token_loss * sequence_mask.to(token_loss.dtype).index_select(0, sequence)
    if token_mask is not None:
        token_loss = token_loss * token_mask.to(token_loss.dtype)
    if sampling_weights is not None:
        token_loss = token_loss * sampling_weights.to(token_loss.dtype)
    if objective.beta != 0.0:
        kl = k3_kl(logps, ref_logps)
        if objective.use_bias_correction_kl:
            # times the (undetached, uncapped) ratio: equal to k3 on-policy, but its gradient gains k3 x dlogp
            kl = kl * units.to_tokens(torch.exp(units.log_ratio))
        token_loss = token_loss + objective.beta * kl
        metrics["kl"] = kl.detach().mean()  # NaN (left out of the logged mean) when nothing is scored
    return token_loss, metrics


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, advantages: torch.Tensor, sequence: torch.Tensor, num_sequences: int,
                  objective: GRPOObjective, sampling_weights: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's per-completion Gamma weight phi(w) = exp(lambda + k log w - lambda w) (phi(1) = 1), w the
    completion's ratio exp(sum of its token log-ratios, each clamped to [-20, 20]) times the engine-to-trainer
    weights when vLLM's correction is on; k and lambda by the advantage's sign; log w kept in [log 1e-8, 20]."""
    floor = math.log(1e-8)
    log_w = per_sequence_sum(torch.clamp(log_ratio, -20.0, 20.0), sequence, num_sequences)
    if sampling_weights is not None:
        log_w = log_w + per_sequence_sum(torch.clamp(torch.log(sampling_weights.to(log_ratio.dtype)), floor, 20.0),
                                         sequence, num_sequences)
    log_w = torch.clamp(log_w, floor, 20.0)
    positive = advantages >= 0
    k = torch.full_like(log_w, objective.vespo_k_neg).masked_fill(positive, objective.vespo_k_pos)
    lam = torch.full_like(log_w, objective.vespo_lambda_neg).masked_fill(positive, objective.vespo_lambda_pos).clamp(
        min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def sampling_correction_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, sequence: torch.Tensor,
                                num_sequences: int, mode: str, clip_min: float | None,
                                clip_max: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token weights, the ratios they came from) for the gap between the engine that sampled the completions
    and the trainer: ratio = pi_old / pi_sampler per token (token_*) or per completion, the product over its tokens
    (sequence_*); *_truncate clamps it to [clip_min, clip_max], *_mask sets ratios outside that range to 0. A
    sampling log-prob the engine did not report (NaN) counts as no gap (ratio 1), as in TRL."""
    if mode not in VLLM_IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"`vllm_importance_sampling_mode` must be one of {VLLM_IMPORTANCE_SAMPLING_MODES}, "
                         f"got {mode!r}.")
    difference = torch.nan_to_num(old_logps - sampling_logps.to(old_logps.dtype), nan=0.0)
    per_sequence = mode.startswith("sequence")
    if per_sequence:
        difference = per_sequence_sum(difference, sequence, num_sequences)
    ratio = torch.exp(difference)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    if per_sequence:
        scored = tokens_per_sequence(old_logps, sequence, num_sequences) > 0
        return ratio.index_select(0, sequence), ratio[scored]
    return ratio, ratio


@torch.no_grad()
def off_policy_sequence_mask(logps: torch.Tensor, behaviour_logps: torch.Tensor, advantages: torch.Tensor,
                             sequence: torch.Tensor, num_sequences: int, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, per completion (1 keep, 0 drop): a completion with a negative
    advantage is dropped when the mean over its tokens of log pi_behaviour - log pi_current exceeds `threshold`.
    NaN behaviour log-probs (not reported by the engine) count as no divergence."""
    divergence = torch.nan_to_num(behaviour_logps.to(logps.dtype) - logps.detach(), nan=0.0)
    mean_divergence = per_sequence_mean(divergence, sequence, num_sequences)
    return ((advantages >= 0) | (mean_divergence <= threshold)).to(logps.dtype)


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, pooled_entropy: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """The tokens whose entropy is at least the (1 - top_quantile) quantile (linear interpolation) of
    `pooled_entropy`: the completion tokens of this micro-batch on every process (TRL's definition). 0.0 keeps the
    highest-entropy tokens only, 1.0 keeps all."""
    if pooled_entropy.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(pooled_entropy.float(), 1.0 - top_quantile)
    return entropy >= threshold
