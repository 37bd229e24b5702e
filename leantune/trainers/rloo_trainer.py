"""RLOOTrainer: REINFORCE Leave-One-Out, as a recipe over the online machinery (online_trainer.py).

Each completion's reward is lowered by beta x its summed log-ratio to the reference (KL in the reward, measured
with the policy at generation time), and its advantage is that reward minus the mean of the other completions of
its prompt (optionally normalised over the batch). The objective is the clipped ratio of whole-sequence
probabilities, averaged over completions.
"""

from __future__ import annotations

import torch

from ..losses.policy_gradient import clipped_surrogate, leave_one_out_advantages
from ..losses.token_logprobs import TargetScores, per_sequence_sum
from .online_trainer import OnlineTrainer, sequence_sums


class RLOOTrainer(OnlineTrainer):
    method = "rloo"  # its entry in leantune/methods.py

    @property
    def kl_in_reward(self) -> bool:
        """RLOO's reward is lowered by beta x the completion's log-ratio to the reference (beta = 0: no KL)."""
        return self.args.beta != 0.0

    scores_policy_on_policy = kl_in_reward  # the KL in the reward is measured with the generation-time policy

    def attach_loss_inputs(self, batches: list[dict], scored: dict, group: int) -> None:
        """Each completion's advantage: its (clipped, KL-lowered) reward minus the mean of its group's others."""
        args = self.args
        rewards = scored["rewards"]
        if args.reward_clip_range is not None:
            rewards = rewards.clamp(*args.reward_clip_range)
        if self.kl_in_reward:
            kl = torch.cat([self._sequence_kl(batch) for batch in batches])
            kl = self.rounds.share.gather(kl)  # every process's, in round order (the round's share, chosen once)
            scored["store"]["kl"].append(kl.mean().item())
            rewards = rewards - args.beta * kl
        advantages, _ = leave_one_out_advantages(rewards, group, args.normalize_advantages)
        self.rounds.spread(batches, "advantages", advantages)

    def _sequence_kl(self, batch: dict) -> torch.Tensor:
        """Summed log-ratio log pi_old - log pi_ref of each completion (first-order estimate, as in RLOO)."""
        reading = self.target_reading
        sequence = reading.sequences(batch, reading.targets(batch)).to(batch["old_logps"].device)
        delta = batch["old_logps"] - batch["ref_logps"]
        return per_sequence_sum(delta, sequence, int(batch["num_sequences"])).float().cpu()

    def loss_items(self, batch: dict) -> int:
        return int(batch["num_sequences"])

    def policy_loss(self, scores: TargetScores, sequence: torch.Tensor, batch: dict):
        args, logps = self.args, scores.logps
        count = int(batch["num_sequences"])
        sequence_logps = sequence_sums(logps, sequence, count, batch)
        if "old_logps" in batch:
            old = sequence_sums(batch["old_logps"].to(logps.dtype), sequence, count, batch)
        else:
            old = sequence_logps.detach()
        advantages = batch["advantages"].to(logps.device, logps.dtype)
        terms = clipped_surrogate(sequence_logps, old, advantages, args.epsilon, args.upper_epsilon)
        return terms.loss.sum(), terms.clip_metrics()
