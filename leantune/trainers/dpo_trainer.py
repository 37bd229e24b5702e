"""DPOTrainer: Direct Preference Optimization, as a recipe over leantune's shared data, loss and memory pieces."""

from __future__ import annotations

import logging

import torch

from ..data.collators import MODEL_INPUTS, sequence_starts
from ..data.preference_collator import REFERENCE_COLUMNS, PreferenceCollator
from ..data.preference_preparation import prepare_preference_dataset
from ..losses.preference import PairSequenceLogps, dpo_loss, pair_sequence_logps, wpo_weights
from .base import LeantuneTrainer
from .dpo_config import DPOConfig, dpo_loss_types, dpo_loss_weights
from .reference import ReferenceModelMixin

logger = logging.getLogger("leantune.dpo")


class DPOTrainer(ReferenceModelMixin, LeantuneTrainer):
    """Train a causal LM to prefer chosen over rejected completions, relative to a frozen reference."""

    dataset_columns = ("prompt_ids", "chosen_ids", "rejected_ids", *REFERENCE_COLUMNS)
    prepared_columns = ("prompt_ids", "chosen_ids", "rejected_ids")
    method = "dpo"  # its entry in leantune/methods.py

    def __init__(
        self,
        model,
        ref_model=None,
        args: DPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
    ):
        # policy, tokenizer and reference; pairs -> prompt / chosen / rejected ids, truncated and counted; batches
        # of chosen then rejected sequences, padded or padding-free
        self.construct(model, args, train_dataset, eval_dataset, processing_class, data_collator,
                       peft_config=peft_config, quantization_config=quantization_config, ref_model=ref_model,
                       compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                       optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                       preprocess_logits_for_metrics=preprocess_logits_for_metrics)

    def liger_notes(self, args) -> list[tuple[int, str]]:
        if not args.use_weighting:
            return []
        return [(logging.INFO, "use_liger_loss=True with use_weighting: WPO's weights need sum_v p_v^2 of every "
                               "target, which Liger's fused kernel does not compute, so the policy is scored through "
                               "leantune's chunked head (exact); the reference goes through Liger.")]

    def prepare_split(self, dataset, split, tokenizer, args):
        return prepare_preference_dataset(dataset, tokenizer, args, split)

    def make_collator(self, tokenizer, args, train_dataset):
        return PreferenceCollator(tokenizer.pad_token_id, self.layout.padding_free, self.layout.pad_to_multiple_of)

    # --- log-probabilities ----------------------------------------------------------------------------------------

    def items_in(self, batch: dict) -> torch.Tensor:
        return torch.as_tensor(batch["num_pairs"])

    def sequence_logps(self, model, batch: dict) -> torch.Tensor:
        """Summed completion log-probs of every sequence of the batch: [chosen..., rejected...] (LD-DPO weighted
        when `ld_alpha` is set, for the policy and the reference alike)."""
        return self.pair_logps(model, batch).logps

    def pair_logps(self, model, batch: dict, wpo: bool = False) -> PairSequenceLogps:
        """Per-sequence sums, plain sums and completion lengths, all from the one set of per-target log-probs (and,
        for `wpo`, each sequence's WPO weight from the same forward pass)."""
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        starts = sequence_starts(batch)
        # under context parallelism the targets arrive shifted and split, each with its sequence and rank
        shifted = "shift_labels" in batch
        if shifted:
            self.context_parallel.check_layout(inputs)
        scores = self.logprobs.target_logprobs(model, inputs, batch["shift_labels" if shifted else "labels"],
                                               stats=("log_sum_sq_probs",) if wpo else (), shifted=shifted)
        logps, targets = scores.logps, scores.targets
        placed = self.context_parallel.placed_targets(batch, targets)
        sequences = pair_sequence_logps(logps, targets, starts, int(batch["num_pairs"]), self.args.ld_alpha, placed)
        if wpo:
            sequences.weights = wpo_weights(logps, scores.stats["log_sum_sq_probs"], targets, starts,
                                            sequences.lengths, placed)
        return sequences

    @torch.no_grad()
    def reference_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if all(name in batch for name in REFERENCE_COLUMNS):
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        with self.reference.scope(self.model) as model:
            logps = self.sequence_logps(model, batch)
        pairs = int(batch["num_pairs"])
        return logps[:pairs], logps[pairs:]

    def reference_columns(self, dataset) -> tuple[str, ...]:
        return REFERENCE_COLUMNS

    def reference_values(self, model, batch: dict, rows: int) -> dict[str, torch.Tensor]:
        logps = self.sequence_logps(model, batch)
        return {"ref_chosen_logps": logps[:rows], "ref_rejected_logps": logps[rows:]}

    # --- the loss -------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = dict(inputs)
        self.run_metrics.count_tokens(model, batch)
        pairs = int(batch["num_pairs"])
        ref_chosen, ref_rejected = self.reference_logps(batch)
        sequences = self.pair_logps(model, batch, wpo=self.args.use_weighting)
        policy, lengths = sequences.logps, sequences.lengths
        args = self.args
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy[:pairs], policy[pairs:], ref_chosen.to(policy.device), ref_rejected.to(policy.device),
            args.beta, dpo_loss_types(args), args.label_smoothing, loss_weights=dpo_loss_weights(args),
            chosen_lengths=lengths[:pairs], rejected_lengths=lengths[pairs:],
            chosen_raw_logps=sequences.raw_logps[:pairs], f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef, discopop_tau=args.discopop_tau,
        )
        if args.use_weighting:  # WPO: each pair's loss times its chosen and rejected weights
            losses = losses * (sequences.weights[:pairs] * sequences.weights[pairs:]).to(losses.dtype)
        loss = self.step_loss.normalise(self.model, losses.sum(), pairs, num_items_in_batch,
                                        whole_sequences="shift_labels" in batch)
        self.run_metrics.record(model, **{
            "rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": policy[:pairs], "logps/rejected": policy[pairs:],
        })
        return (loss, {"chosen_logps": policy[:pairs]}) if return_outputs else loss
