"""OnlineDPOTrainer: Online Direct Preference Optimization, as a recipe over the online machinery (online_trainer.py).

Each prompt gets two completions sampled from the current policy; the reward functions score them (a completion
that ends without EOS loses `missing_eos_penalty`), the higher reward is chosen and a tie goes to the first. The pair
then trains with the DPO loss (losses/preference.py: sigmoid, or ipo) on the completions' summed log-probs under
the policy and the reference (the PEFT adapter disabled, or a frozen copy), scored through the memory engine at
temperature 1, as TRL does. `beta` may change per epoch.
"""

from __future__ import annotations

import torch

from ..losses.preference import chosen_and_rejected, dpo_loss, preferred_in_pairs
from ..losses.token_logprobs import TargetScores
from .online.round_builder import eos_penalised
from .online_trainer import OnlineTrainer, sequence_sums


class OnlineDPOTrainer(OnlineTrainer):
    method = "online_dpo"  # its entry in leantune/methods.py
    scores_at_temperature = False  # the DPO loss reads the model's own probabilities, not the sampling ones

    def __init__(self, model, ref_model=None, reward_funcs=None, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, peft_config=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None), preprocess_logits_for_metrics=None,
                 judge=None):
        if judge is not None:
            raise ValueError("`judge` is not supported by leantune's OnlineDPOTrainer (TRL 1.16 has no judges either): "
                             "pass `reward_funcs` (callables, reward model ids or paths, or reward models).")
        if ref_model is not None and callable(ref_model) and not isinstance(ref_model, torch.nn.Module):
            raise ValueError("`ref_model` (OnlineDPOTrainer's second argument, as in TRL) is a function: pass reward "
                             "functions as `reward_funcs=`.")
        if not reward_funcs:
            raise ValueError("`reward_funcs` must be provided: callables, reward model ids or paths, or reward models.")
        for name, value in (("data_collator", data_collator), ("compute_metrics", compute_metrics),
                            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics)):
            if value is not None:
                raise ValueError(f"`{name}` is not used by OnlineDPOTrainer: its batches are the sampled completions "
                                 "and its evaluation reports their rewards and loss; leave it None.")
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, ref_model=ref_model)

    def reference_wanted(self, args) -> bool:
        return True  # beta > 0 always: the loss is a log-ratio to the reference

    @property
    def beta(self) -> float:
        """TRL's attribute: this epoch's beta."""
        return self.args.beta_at(self.state.epoch or 0.0)

    # --- the round: rewards (with the missing-EOS penalty) -> which completion of each pair is chosen ----------------

    def attach_loss_inputs(self, batches: list[dict], scored: dict, group: int) -> None:
        """Which completion of each pair is chosen (`chosen`, per completion; pairs stay whole in every
        micro-batch), by the rewards minus `missing_eos_penalty` for a completion that did not end in EOS."""
        rewards, store = eos_penalised(scored, self.args.missing_eos_penalty), scored["store"]
        chosen = preferred_in_pairs(rewards)
        best, worst = chosen_and_rejected(torch.nan_to_num(rewards, nan=0.0), chosen)
        store["objective/scores"].append(torch.nan_to_num(rewards, nan=0.0).mean().item())
        store["objective/scores_margin"].append((best - worst).mean().item())
        store["val/contain_eos_token"].append(scored["ended"].float().mean().item())
        self.rounds.spread(batches, "chosen", chosen)

    def scored_prompts(self, prompts: list, completion_ids: list) -> list:
        """Prompt + completion within `max_length`: the start of a long prompt is cut (TRL's left truncation)."""
        room = [self.args.max_length - len(completion) for completion in completion_ids]
        cut = sum(len(prompt) > keep for prompt, keep in zip(prompts, room))
        if cut:
            self.round_counts["prompts_cut_to_max_length"] += cut
        return [list(prompt)[-keep:] if len(prompt) > keep else prompt for prompt, keep in zip(prompts, room)]

    # --- the loss ----------------------------------------------------------------------------------------------------

    def loss_items(self, batch: dict) -> int:
        return int(batch["num_sequences"]) // 2  # pairs: the loss is the mean over the step's pairs

    def policy_loss(self, scores: TargetScores, sequence: torch.Tensor, batch: dict):
        logps, count = scores.logps, int(batch["num_sequences"])
        policy = sequence_sums(logps, sequence, count, batch)
        reference = sequence_sums(batch["ref_logps"].to(logps.dtype), sequence, count, batch)
        chosen = batch["chosen"].to(logps.device)
        policy_chosen, policy_rejected = chosen_and_rejected(policy, chosen)
        ref_chosen, ref_rejected = chosen_and_rejected(reference, chosen)
        # TRL's Online DPO applies ipo to whole-completion sums (its offline DPO to per-token means): lengths of 1
        ones = torch.ones_like(policy_chosen)
        beta = self.beta
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, self.args.loss_type,
            chosen_lengths=ones, rejected_lengths=ones)
        margins = chosen_rewards - rejected_rewards
        kl = (policy - reference).detach()
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": margins.mean(),
            "rewards/accuracies": (margins > 0).float().mean(),
            "logps/chosen": policy_chosen.detach().mean(),
            "logps/rejected": policy_rejected.detach().mean(),
            "objective/kl": kl.mean(),
            "objective/non_score_reward": (-beta * kl).mean(),
            "objective/entropy": -policy.detach().mean(),
            "beta": torch.tensor(beta, device=logps.device),
        }
        return losses.sum(), metrics
