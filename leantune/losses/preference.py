"""Preference losses, written once over per-sequence log-probabilities (summed target log-probs).

The log-probabilities come from the memory engine (full logits, chunked head or Liger), so every layout and path
feeds this same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .token_logprobs import Targets, TargetSequences

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Loss types built on the chosen - rejected score difference, where the f-DPO reparameterisation's log Z(x) cancels
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
LABEL_SMOOTHING_LOSS_TYPES = ("robust", "exo_pair", "aot", "aot_unpaired")
LENGTH_LOSS_TYPES = ("ipo", "sigmoid_norm", "sft")  # need the number of completion tokens of each sequence


@dataclass
class PairSequenceLogps:
    """Per-sequence quantities of a batch of pairs, every one ordered [chosen..., rejected...]."""

    logps: torch.Tensor  # summed target log-probs (LD-DPO weighted when ld_alpha is set)
    raw_logps: torch.Tensor  # plain sums (the same tensor without ld_alpha)
    lengths: torch.Tensor  # target (completion) tokens of each sequence
    weights: torch.Tensor | None = None  # WPO's per-sequence weights (wpo_weights), when asked for


def pair_sequence_logps(logps: torch.Tensor, targets: Targets, starts: torch.Tensor, num_pairs: int,
                        ld_alpha: float | None = None, placed: TargetSequences | None = None) -> PairSequenceLogps:
    """Sum the per-target log-probs of chosen and rejected sequences, and count their targets.

    LD-DPO (`ld_alpha`): a pair's first min(chosen length, rejected length) targets of each completion count fully,
    the targets beyond that shared length are weighted by `ld_alpha`. `placed`: each target's sequence and rank
    (default: from `starts`, targets of one sequence contiguous and in order, as in every one-process layout); under
    context parallelism its `total` makes each process's partial sums and lengths whole before they are used.
    """
    num_sequences = 2 * num_pairs
    placed = TargetSequences.contiguous(targets, starts) if placed is None else placed
    lengths = placed.lengths(num_sequences)
    raw = placed.sums(logps, num_sequences)
    if ld_alpha is None:
        return PairSequenceLogps(raw, raw, lengths)
    shared = torch.minimum(lengths[:num_pairs], lengths[num_pairs:]).repeat(2)
    weights = torch.where(placed.rank < shared[placed.sequence], 1.0, float(ld_alpha)).to(logps.dtype)
    weighted = placed.sums(logps * weights, num_sequences)
    return PairSequenceLogps(weighted, raw, lengths)


@torch.no_grad()
def wpo_weights(logps: torch.Tensor, log_sum_sq_probs: torch.Tensor, targets: Targets, starts: torch.Tensor,
                lengths: torch.Tensor, placed: TargetSequences | None = None) -> torch.Tensor:
    """WPO (arXiv 2406.11827, eq. 2), per sequence: exp(mean over its completion tokens of
    log p(y_t) - log sum_v p(v)^2), i.e. the token probabilities normalised by the distribution's own sharpness.
    A pair's loss is weighted by its chosen weight times its rejected weight; no gradient flows through them.
    `placed` as in `pair_sequence_logps`."""
    aligned = logps.detach() - log_sum_sq_probs
    placed = TargetSequences.contiguous(targets, starts) if placed is None else placed
    sums = placed.sums(aligned, lengths.numel())
    return torch.exp(sums / lengths.clamp(min=1).to(sums.dtype))


def f_divergence_scores(logratios: torch.Tensor, f_divergence_type: str = "reverse_kl",
                        alpha: float = 0.5) -> torch.Tensor:
    """f'(pi / ref) of the f-DPO paper, from log(pi / ref); reverse KL (standard DPO) is the log-ratio itself."""
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":  # f'(u) = 1 - 1/u
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":  # f'(u) = log(2u / (1 + u)) = log 2 + log sigmoid(log u)
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":  # f'(u) = (u^(alpha - 1) - 1) / (alpha - 1); alpha -> 1: log u
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        exponent = (alpha - 1.0) * logratios
        if exponent.dtype in (torch.float16, torch.bfloat16):
            exponent = exponent.float()
        exponent = exponent.clamp(max=11.0 if logratios.dtype == torch.float16 else 80.0)  # exp stays finite
        return (torch.expm1(exponent) / (alpha - 1.0)).to(logratios.dtype)
    raise ValueError(f"Unknown f_divergence_type {f_divergence_type!r}; choose from {F_DIVERGENCE_TYPES}.")


def _cdpo(delta: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing


def _per_token(values: torch.Tensor, lengths: torch.Tensor | None, loss_type: str) -> torch.Tensor:
    if lengths is None:
        raise ValueError(f"loss_type {loss_type!r} needs the completion lengths (chosen_lengths, rejected_lengths).")
    return values / lengths.to(values.dtype).clamp(min=1.0)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: str | Sequence[str] = "sigmoid",
             label_smoothing: float = 0.0, *, loss_weights: Sequence[float] | None = None,
             chosen_lengths: torch.Tensor | None = None, rejected_lengths: torch.Tensor | None = None,
             chosen_raw_logps: torch.Tensor | None = None, f_divergence_type: str = "reverse_kl",
             f_alpha_divergence_coef: float = 0.5, discopop_tau: float = 0.05):
    """Per-pair loss (the weighted sum over `loss_type`s) and the implicit rewards beta * (log pi - log ref).

    Inputs are per-pair summed completion log-probs. `chosen_lengths` / `rejected_lengths` (completion tokens)
    are needed by ipo, sigmoid_norm and sft; `chosen_raw_logps` (sums without LD-DPO weighting, default
    `policy_chosen`) by sft. Every type's value is per pair, so the mean over pairs is TRL's per-type loss.
    """
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"`loss_weights` has {len(weights)} weights for {len(loss_types)} loss types.")
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    chosen_score = f_divergence_scores(chosen_ratio, f_divergence_type, f_alpha_divergence_coef)
    rejected_score = f_divergence_scores(rejected_ratio, f_divergence_type, f_alpha_divergence_coef)
    delta = chosen_score - rejected_score
    total = None
    for name, weight in zip(loss_types, weights):
        if f_divergence_type != "reverse_kl" and name not in F_DIVERGENCE_LOSS_TYPES:
            raise ValueError(f"f_divergence_type {f_divergence_type!r} does not apply to loss_type {name!r}.")
        if name == "sigmoid":
            losses = -F.logsigmoid(beta * delta)
        elif name == "hinge":
            losses = torch.relu(1 - beta * delta)
        elif name == "ipo":  # on per-token averages, as TRL (confirmed with the IPO authors)
            per_token = (_per_token(chosen_score, chosen_lengths, name)
                         - _per_token(rejected_score, rejected_lengths, name))
            losses = (per_token - 1 / (2 * beta)) ** 2
        elif name == "exo_pair":  # KL(softmax(beta * scores) || [1 - eps, eps]) over {chosen, rejected}
            if not 0.0 < label_smoothing < 1.0:
                raise ValueError("loss_type 'exo_pair' needs 0 < label_smoothing < 1 (the EXO paper: 1e-3).")
            losses = (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - math.log1p(-label_smoothing))
                      + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - math.log(label_smoothing)))
        elif name == "nca_pair":
            chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
            losses = (-F.logsigmoid(chosen_reward) - 0.5 * F.logsigmoid(-chosen_reward)
                      - 0.5 * F.logsigmoid(-rejected_reward))
        elif name == "robust":  # unbiased under labels flipped with probability label_smoothing
            losses = ((-(1 - label_smoothing) * F.logsigmoid(beta * delta)
                       + label_smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * label_smoothing))
        elif name == "bco_pair":
            losses = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
        elif name == "sppo_hard":
            losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        elif name == "aot":  # sorted policy margins against sorted reference margins, over the batch
            sorted_policy = torch.sort(policy_chosen - policy_rejected, dim=0).values
            sorted_ref = torch.sort(ref_chosen - ref_rejected, dim=0).values
            losses = _cdpo(sorted_policy - sorted_ref, beta, label_smoothing)
        elif name == "aot_unpaired":  # sorted chosen log-ratios against sorted rejected ones, over the batch
            losses = _cdpo(torch.sort(chosen_ratio, dim=0).values - torch.sort(rejected_ratio, dim=0).values,
                           beta, label_smoothing)
        elif name == "apo_zero":
            losses = 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
        elif name == "apo_down":
            losses = torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
        elif name == "discopop":  # logistic and exponential losses blended by sigmoid(logits / tau)
            logits = beta * delta
            mix = torch.sigmoid(logits / discopop_tau)
            losses = -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
        elif name == "sft":  # NLL per chosen token over the whole batch, the same value for every pair
            if chosen_lengths is None:
                raise ValueError("loss_type 'sft' needs the completion lengths (chosen_lengths).")
            raw = policy_chosen if chosen_raw_logps is None else chosen_raw_logps
            nll = -raw.sum() / chosen_lengths.sum().to(raw.dtype)
            losses = nll.expand(raw.shape[0])
        elif name == "sigmoid_norm":  # sigmoid on per-token averages of the scores
            per_token = (_per_token(chosen_score, chosen_lengths, name)
                         - _per_token(rejected_score, rejected_lengths, name))
            losses = -F.logsigmoid(beta * per_token)
        else:
            raise ValueError(f"Unknown DPO loss_type {name!r}; choose from {DPO_LOSS_TYPES}.")
        total = losses * weight if total is None else total + losses * weight
    if total is None:
        raise ValueError("`loss_type` is empty; give at least one of " + ", ".join(DPO_LOSS_TYPES) + ".")
    return total, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def preferred_in_pairs(rewards: torch.Tensor) -> torch.Tensor:
    """Online DPO's choice: rewards of consecutive pairs [a0, b0, a1, b1, ...] -> [N] bool, True for each pair's
    chosen completion: the higher reward, the first one on a tie (as TRL). A completion no reward function scored
    (NaN) counts as 0, as in TRL's sum over the functions (the online trainer counts and logs such completions)."""
    if rewards.numel() % 2:
        raise ValueError(f"Online DPO pairs completions two by two; got {rewards.numel()} rewards.")
    pairs = torch.nan_to_num(rewards.float(), nan=0.0).view(-1, 2)
    first_wins = pairs[:, 0] >= pairs[:, 1]
    return torch.stack([first_wins, ~first_wins], dim=1).reshape(-1)


def chosen_and_rejected(values: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion values of consecutive pairs and their `preferred_in_pairs` mask -> (chosen, rejected) per pair."""
    pairs, first_wins = values.view(-1, 2), chosen.view(-1, 2)[:, 0]
    return torch.where(first_wins, pairs[:, 0], pairs[:, 1]), torch.where(first_wins, pairs[:, 1], pairs[:, 0])
