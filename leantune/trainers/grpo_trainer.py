"""GRPOTrainer: Group Relative Policy Optimization, as a recipe over the online machinery (online_trainer.py).

For each prompt, `num_generations` completions are sampled and rewarded; a completion's advantage is its reward
minus its group's mean (divided by the group's or batch's std, `scale_rewards`). The policy maximises the clipped
ratio objective per token, with beta x the k3 KL estimate to the reference added to each token's loss; token losses
are averaged as `loss_type` says (losses/policy_gradient.py).
"""

from __future__ import annotations

import torch

from ..losses.advantages import group_relative_advantages
from ..losses.causal_lm import count_targets
from ..losses.policy_gradient import clipped_surrogate, grpo_loss_items, grpo_loss_sum, k3_kl
from .grpo_config import GRPOConfig
from .online_trainer import OnlineTrainer


class GRPOTrainer(OnlineTrainer):
    method = "grpo"
    config_class = GRPOConfig

    def round_advantages(self, rewards: torch.Tensor, batches: list[dict]) -> torch.Tensor:
        advantages, _ = group_relative_advantages(rewards, self.args.num_generations, self.args.scale_rewards)
        return advantages

    def loss_items(self, batch: dict) -> int:
        return grpo_loss_items(self.args.loss_type, int(batch["num_sequences"]), int(count_targets(batch["labels"])),
                               self.args.max_completion_length)

    def policy_loss(self, logps: torch.Tensor, sequence: torch.Tensor, batch: dict):
        args = self.args
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        advantages = batch["advantages"].to(logps.device, logps.dtype).index_select(0, sequence)
        terms = clipped_surrogate(logps, old, advantages, args.epsilon, args.upper_epsilon)
        token_loss = terms.loss
        metrics = {}
        if args.beta != 0.0:
            kl = k3_kl(logps, batch["ref_logps"])
            token_loss = token_loss + args.beta * kl
            metrics["kl"] = kl.detach().mean()  # NaN (left out of the logged mean) when nothing is scored
        loss_sum = grpo_loss_sum(token_loss, sequence, int(batch["num_sequences"]), args.loss_type,
                                 args.max_completion_length)
        metrics.update(terms.clip_metrics())
        return loss_sum, metrics
