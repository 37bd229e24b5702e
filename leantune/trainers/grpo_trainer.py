"""GRPOTrainer: Group Relative Policy Optimization, as a recipe over the online machinery (online_trainer.py).

For each prompt, `num_generations` completions are sampled and rewarded; a completion's advantage is its reward
minus its group's mean (divided by the group's or batch's std, `scale_rewards`). The policy maximises the clipped
ratio objective per token (or per completion, GSPO), with beta x the k3 KL estimate to the reference added to each
token's loss; token losses are averaged as `loss_type` says (losses/policy_gradient.py, which also holds the
options that reshape the token loss: `delta`, `top_entropy_quantile`, `off_policy_mask_threshold`, vLLM's
importance-sampling correction, `use_bias_correction_kl`). `entropy_coef` subtracts an entropy bonus, fixed or
adapted to a target (losses/entropy_bonus.py); `multi_objective_aggregation="normalize_then_sum"` normalises each
reward function within its group before the weighted sum (losses/policy_gradient.py).

With `use_vllm` and `vllm_importance_sampling_correction` (TRL's default), the generation-time policy log-probs are
always computed, and each token's policy loss is weighted by pi_old / pi_vLLM of its sampled token, from the
log-probs vLLM returns with the completions. transformers' generate samples from the training model itself, so
there, as in TRL, nothing is corrected.

TRL's agentic keywords compose leantune/rollouts/: `tools` and `environment_factory` continue each rollout through the
multi-turn tool-calling loop (tool-result tokens stay in the sequence as context but are not trained), and
`rollout_func` replaces generation by the user's function (its `env_mask` marks what the policy sampled).
"""

from __future__ import annotations

import logging

import torch

from ..losses.entropy_bonus import EntropyBonus
from ..losses.policy_gradient import (
    GRPOObjective,
    group_relative_advantages,
    grpo_token_loss,
    high_entropy_mask,
    loss_aggregation,
    normalize_then_sum_advantages,
    off_policy_sequence_mask,
    sampling_correction_weights,
)
from ..losses.token_logprobs import TargetScores
from ..models.output_head import compute_head_in_fp32
from ..rollouts import AgentRollouts
from .online_trainer import PLACED_TARGETS, OnlineTrainer, ScoringNeeds

ENTROPY_TOKEN_MASK = "entropy_token_mask"  # top_entropy_quantile's tokens, where the entropy bonus acts too


class GRPOTrainer(OnlineTrainer):
    method = "grpo"  # its entry in leantune/methods.py

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        # TRL's agentic keywords (rollouts/): multi-turn tool calling, environments, or the user's own rollouts
        agent = AgentRollouts(tools, environment_factory, rollout_func) \
            if tools or rollout_func is not None or environment_factory is not None else None
        if not reward_funcs and not (agent is not None and agent.reward_functions()):
            raise ValueError("No reward source provided: pass `reward_funcs` (callables, reward model ids or paths, "
                             "or reward models), or an `environment_factory` whose environment defines a "
                             "`get_reward` method.")
        args = self.default_args(model, args)
        # the entropy bonus and the high-entropy token mask read per-token entropies (the loss, Liger's notices);
        # the bonus differentiates them
        bonus = args.entropy_coef != 0.0 or args.use_adaptive_entropy
        self.scoring_needs = ScoringNeeds(entropies=bonus or args.top_entropy_quantile < 1, entropy_grad=bonus)
        # vLLM's importance-sampling correction (TRL: only when generating with vLLM, whose log-probs it reads): its
        # pi_old, even on-policy
        self.corrects_sampling = bool(args.vllm_importance_sampling_correction and args.needs_sampling_logprobs)
        self.scores_policy_on_policy = self.corrects_sampling
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, quantization_config=quantization_config,
                         peft_config=peft_config, agent=agent)
        self.rollout_func = rollout_func
        self.tools = list(agent.tools) if agent is not None else []  # TRL's attribute: every tool the policy may call
        self.entropy_bonus = EntropyBonus.from_config(self.args)  # added to the normalised loss: `regularised`
        self.objective = GRPOObjective.from_config(self.args)  # what shapes the per-token loss (policy_gradient.py)
        self.aggregation = loss_aggregation(self.args.loss_type)  # the loss type's sum and divisor, taken once
        if self.args.cast_lm_head_to_fp32:
            for model in (self.model, self.ref_model):
                if model is not None:
                    compute_head_in_fp32(model)

    @property
    def _env_tools(self) -> dict | None:
        """TRL's attribute: the tools each environment's rollouts see, by environment name (None: one environment)."""
        environments = self.agent.environments if self.agent is not None else None
        return environments.tools if environments is not None else None

    @property
    def _environment_pool(self) -> dict | None:
        """TRL's attribute: the reusable environment instances, by environment name."""
        environments = self.agent.environments if self.agent is not None else None
        return environments.pool if environments is not None else None

    def attach_loss_inputs(self, batches: list[dict], scored: dict, group: int) -> None:
        """Each completion's advantage: its reward against its group's (losses/policy_gradient.py)."""
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            advantages = normalize_then_sum_advantages(scored["per_function"], self.rewards.weights, group)
        else:
            advantages, _ = group_relative_advantages(scored["rewards"], group, self.args.scale_rewards)
        self.rounds.spread(batches, "advantages", advantages)

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's padded form of the off-policy mask: [B, 1] from [B, T] log-probs and completion mask (the loss uses
        `off_policy_sequence_mask` on the flat targets; this is the same rule, for code written against TRL)."""
        keep = mask.bool()
        rows = mask.shape[0]
        sequence = torch.arange(rows, device=mask.device).unsqueeze(1).expand_as(keep)[keep]
        result = off_policy_sequence_mask(per_token_logps[keep], sampling_per_token_logps[keep],
                                          advantages.reshape(-1), sequence, rows, off_policy_threshold)
        return result.reshape(rows, 1)

    def loss_items(self, batch: dict) -> int:
        return self.aggregation.items(int(batch["num_sequences"]), self.target_reading.count(batch),
                                      self.args.max_completion_length)

    def policy_loss(self, scores: TargetScores, sequence: torch.Tensor, batch: dict):
        args, logps = self.args, scores.logps
        count = int(batch["num_sequences"])
        old = batch["old_logps"].to(logps.dtype) if "old_logps" in batch else logps.detach()
        advantages = batch["advantages"].to(logps.device, logps.dtype)
        metrics, sampling_weights, sequence_mask, token_mask = {}, None, None, None
        if self.corrects_sampling:
            sampling_weights, ratios = sampling_correction_weights(
                old, batch["sampling_logps"], sequence, count, args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
            metrics.update(sampling_metrics(old, batch["sampling_logps"], ratios))
        if args.off_policy_mask_threshold is not None:
            behaviour = batch["sampling_logps"] if "sampling_logps" in batch else old
            sequence_mask = off_policy_sequence_mask(logps, behaviour, advantages, sequence, count,
                                                     args.off_policy_mask_threshold)
        if args.top_entropy_quantile < 1.0:
            entropy = scores.entropy.detach()
            token_mask = high_entropy_mask(entropy, self._pooled_over_processes(entropy), args.top_entropy_quantile)
            batch[ENTROPY_TOKEN_MASK] = token_mask  # the entropy bonus acts on the same tokens
        token_loss, loss_metrics = grpo_token_loss(
            logps, old, advantages, sequence, count, self.objective,
            ref_logps=batch.get("ref_logps"), sampling_weights=sampling_weights, token_mask=token_mask,
            sequence_mask=sequence_mask)
        metrics.update(loss_metrics)
        placed = batch.get(PLACED_TARGETS)  # context parallelism: this process's part of every sequence's tokens
        whole = () if placed is None else (placed.total, int(self.context_parallel.batch_targets))
        return self.aggregation.total(token_loss, sequence, count, *whole), metrics

    def regularised(self, loss: torch.Tensor, scores: TargetScores, batch: dict, model):
        """The entropy bonus (losses/entropy_bonus.py) over the tokens the policy term acts on (top_entropy_quantile's
        mask), after the loss type's normalisation."""
        if self.entropy_bonus is None:
            return loss, {}
        mask = batch.get(ENTROPY_TOKEN_MASK)
        steps = getattr(self, "current_gradient_accumulation_steps", 1) if model.training else 1
        return self.entropy_bonus.added(loss, scores.entropy if mask is None else scores.entropy[mask], steps,
                                        model.training, self.accelerator.sync_gradients, self._summed_over_processes)

    def _summed_over_processes(self, totals: torch.Tensor) -> torch.Tensor:
        """The adaptive entropy coefficient's step totals summed over all processes (on CPU)."""
        return self.accelerator.reduce(totals.to(self.accelerator.device), reduction="sum").cpu()

    def split_problem(self) -> str | None:
        """The options whose loss averages or pools over each micro-batch's own tokens."""
        args = self.args
        if args.loss_type == "bnpo":
            return "loss_type='bnpo' averages over each micro-batch's own tokens, so a smaller one changes the loss"
        if args.top_entropy_quantile < 1.0:
            return "top_entropy_quantile < 1 takes its quantile over each micro-batch's tokens"
        if self.entropy_bonus is not None:
            return "an entropy bonus (entropy_coef / use_adaptive_entropy) averages over each micro-batch"
        return None

    def context_parallel_problem(self, args) -> str | None:
        """Under context parallelism GRPO's loss is summed token by token over each process's part (per-sequence
        token counts made whole); the options below read per-sequence or pooled values of the loss's own log-probs
        or entropies, which this does not make whole."""
        problem = super().context_parallel_problem(args)
        if problem is not None:
            return problem
        for refused, option in ((args.importance_sampling_level == "sequence", "importance_sampling_level='sequence'"),
                                (args.loss_type == "vespo", "loss_type='vespo'"),
                                (args.off_policy_mask_threshold is not None, "off_policy_mask_threshold"),
                                (args.top_entropy_quantile < 1.0, "top_entropy_quantile < 1"),
                                (self.scoring_needs.entropies,
                                 "an entropy bonus (entropy_coef / use_adaptive_entropy)")):
            if refused:
                return f"`{option}` (it reads whole-sequence or pooled values of the loss's own terms)"
        return None

    def liger_notes(self, args) -> list[tuple[int, str]]:
        if not self.scoring_needs.entropies:
            return super().liger_notes(args)
        return [(logging.INFO, "use_liger_loss=True: the loss reads per-token entropies (entropy_coef / "
                               "use_adaptive_entropy / top_entropy_quantile), which Liger's fused kernel does not "
                               "compute, so the training forward passes score through leantune's chunked head (exact, "
                               "never the full logits); generation-time and reference log-probs go through Liger's "
                               "fused linear cross-entropy.")]

    @property
    def entropy_coef(self) -> float | None:
        """The entropy bonus's coefficient now (it moves with use_adaptive_entropy); TRL's attribute."""
        return None if self.entropy_bonus is None else self.entropy_bonus.coef

    def save_extra_state(self, folder: str) -> None:
        if self.entropy_bonus is not None and self.entropy_bonus.adaptive:
            self.entropy_bonus.save(folder)

    def load_extra_state(self, folder: str) -> None:
        if self.entropy_bonus is not None and self.entropy_bonus.adaptive:
            self.entropy_bonus.load(folder)

    def _pooled_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        """Every process's values of this micro-batch (lengths differ between processes)."""
        if self.accelerator.num_processes == 1:
            return values
        padded = self.accelerator.pad_across_processes(values.float(), dim=0, pad_index=float("nan"))
        gathered = self.accelerator.gather(padded)
        return gathered[~torch.isnan(gathered)]


@torch.no_grad()
def sampling_metrics(old_logps: torch.Tensor, sampling_logps: torch.Tensor, ratios: torch.Tensor) -> dict:
    """TRL's names: how far the engine's log-probs are from the trainer's, and the correction's ratios."""
    gap = (old_logps.float() - sampling_logps.float()).abs()
    gap = gap[~torch.isnan(gap)]
    nan = torch.tensor(float("nan"), device=old_logps.device)
    return {
        "sampling/sampling_logp_difference/mean": gap.mean() if gap.numel() else nan,
        "sampling/sampling_logp_difference/max": gap.max() if gap.numel() else nan,
        "sampling/importance_sampling_ratio/min": ratios.min() if ratios.numel() else nan,
        "sampling/importance_sampling_ratio/mean": ratios.mean() if ratios.numel() else nan,
        "sampling/importance_sampling_ratio/max": ratios.max() if ratios.numel() else nan,
    }
