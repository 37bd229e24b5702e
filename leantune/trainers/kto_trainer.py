"""KTOTrainer: Kahneman-Tversky Optimization, as a recipe over leantune's shared data, loss and memory pieces.

Each step runs the policy over the batch's prompt + completion sequences (with gradient) and, for the KL reference
point, over its prompt + mismatched-completion sequences (without: the KL term is not differentiated through);
the reference gives both log-probs from a frozen copy, the policy with its adapter disabled, or a precomputed pass.
"""

from __future__ import annotations

import logging

import torch

from ..data.collators import MODEL_INPUTS, sequence_starts
from ..data.kto_preparation import KL_COLUMN, REFERENCE_COLUMNS, KTOCollator, kl_view, prepare_kto_dataset
from ..losses.kto import kl_estimate, kto_loss
from ..losses.token_logprobs import per_sequence_sum, target_sequences
from .base import LeantuneTrainer
from .kto_config import KTOConfig
from .parts.context_parallel import KL_PREFIX
from .reference import ReferenceModelMixin

logger = logging.getLogger("leantune.kto")


class KTOTrainer(ReferenceModelMixin, LeantuneTrainer):
    """Train a causal LM towards desirable and away from undesirable completions, relative to a frozen reference."""

    dataset_columns = ("prompt_ids", "completion_ids", "label", KL_COLUMN, *REFERENCE_COLUMNS)
    method = "kto"  # its entry in leantune/methods.py

    def __init__(
        self,
        model,
        ref_model=None,
        args: KTOConfig | None = None,
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
        # policy, tokenizer and reference; unpaired (or unpaired pairs) -> prompt / completion ids, label, KL
        # completion, counted; batches of the completions' sequences and the KL term's mismatched ones
        self.construct(model, args, train_dataset, eval_dataset, processing_class, data_collator,
                       peft_config=peft_config, quantization_config=quantization_config, ref_model=ref_model,
                       compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                       optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                       preprocess_logits_for_metrics=preprocess_logits_for_metrics)

    def prepare_split(self, dataset, split, tokenizer, args):
        return prepare_kto_dataset(dataset, tokenizer, args, split)

    def is_prepared(self, dataset) -> bool:
        columns = set(getattr(dataset, "column_names", None) or ())
        return super().is_prepared(dataset) or ({"prompt_ids", "completion_ids", "label"} <= columns and (
            not self.args.uses_kl or KL_COLUMN in columns))

    def make_collator(self, tokenizer, args, train_dataset):
        return KTOCollator(tokenizer.pad_token_id, self.layout.padding_free, self.layout.pad_to_multiple_of)

    def reference_note(self, loaded, args) -> str:
        kl = "KL reference point from mismatched completions" if args.uses_kl else "no KL term (apo_zero_unpaired)"
        return f"KTO reference: {loaded.description()}; {kl}."

    # --- log-probabilities ----------------------------------------------------------------------------------------

    def items_in(self, batch: dict) -> torch.Tensor:
        return torch.as_tensor(batch["num_examples"])

    def sequence_logps(self, model, batch: dict, kl: bool = False) -> torch.Tensor:
        """Summed completion log-probs of every sequence of the batch (kl=True: of its mismatched sequences)."""
        view = kl_view(batch) if kl else batch
        inputs = {k: view[k] for k in MODEL_INPUTS if k in view}
        # under context parallelism the targets arrive shifted and split, each with its sequence
        shifted = "shift_labels" in view
        if shifted:
            self.context_parallel.check_layout(inputs, KL_PREFIX if kl else "")
        scores = self.logprobs.target_logprobs(model, inputs, view["shift_labels" if shifted else "labels"],
                                               shifted=shifted)
        placed = self.context_parallel.placed_targets(view, scores.targets)
        if placed is not None:
            return placed.sums(scores.logps, int(batch["num_examples"]))
        sequence = target_sequences(scores.targets, sequence_starts(view))
        return per_sequence_sum(scores.logps, sequence, int(batch["num_examples"]))

    @torch.no_grad()
    def reference_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(reference log-probs of the completions, of the mismatched KL completions or None)."""
        with_kl = "kl_input_ids" in batch
        if "ref_logps" in batch and (not with_kl or "ref_kl_logps" in batch):
            return batch["ref_logps"], batch.get("ref_kl_logps")
        with self.reference.scope(self.model) as model:
            logps = self.sequence_logps(model, batch)
            kl_logps = self.sequence_logps(model, batch, kl=True) if with_kl else None
        return logps, kl_logps

    def kl_reference_point(self, model, batch: dict, ref_kl_logps) -> torch.Tensor:
        """z0: mean policy/reference log-ratio of the mismatched sequences, averaged over processes, >= 0; detached."""
        device = batch["input_ids"].device
        if not self.args.uses_kl:
            return torch.zeros((), device=device)
        with torch.no_grad():
            policy_kl = self.sequence_logps(model, batch, kl=True)
            kl = kl_estimate(policy_kl, ref_kl_logps.to(policy_kl.device))
        return self.accelerator.gather(kl.reshape(1)).mean().clamp(min=0)

    # --- the loss -------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = dict(inputs)
        self.run_metrics.count_tokens(model, batch)
        self.run_metrics.count_tokens(model, batch, prefix=KL_PREFIX)
        count = int(batch["num_examples"])
        ref_logps, ref_kl_logps = self.reference_logps(batch)
        kl = self.kl_reference_point(model, batch, ref_kl_logps)
        policy = self.sequence_logps(model, batch)
        desirable = batch["desirable"].to(policy.device)
        args = self.args
        losses, rewards = kto_loss(policy, ref_logps.to(policy.device), desirable, kl, args.beta,
                                   args.desirable_weight, args.undesirable_weight, args.loss_type)
        loss = self.step_loss.normalise(self.model, losses.sum(), count, num_items_in_batch,
                                        whole_sequences="shift_labels" in batch)
        self._record(model, policy.detach(), rewards, desirable, kl)
        return (loss, {"logps": policy.detach()}) if return_outputs else loss

    def _record(self, model, logps, rewards, desirable, kl) -> None:
        self.run_metrics.record(model, reward=rewards, logp=logps, desirable=desirable.float(),
                            kl=torch.full_like(rewards, float(kl)))

    def summarise_metrics(self, store: dict[str, list[float]]) -> dict[str, float]:
        """Rewards and log-probs split by label, their margin, the KL reference point, and the label counts."""
        good = [flag > 0.5 for flag in store["desirable"]]

        def mean_of(name, want):
            values = [v for v, g in zip(store[name], good) if g == want]
            return sum(values) / len(values) if values else None

        summary = {"rewards/chosen": mean_of("reward", True), "rewards/rejected": mean_of("reward", False),
                   "logps/chosen": mean_of("logp", True), "logps/rejected": mean_of("logp", False)}
        if summary["rewards/chosen"] is not None and summary["rewards/rejected"] is not None:
            summary["rewards/margins"] = summary["rewards/chosen"] - summary["rewards/rejected"]
        summary["kl"] = sum(store["kl"]) / len(store["kl"])
        summary = {name: round(value, 6) for name, value in summary.items() if value is not None}
        # under context parallelism every process of a group recorded the same examples (the means are unchanged)
        copies = self.context_parallel.size
        summary.update({"count/desirable": sum(good) // copies, "count/undesirable": (len(good) - sum(good)) // copies})
        return summary

    # --- precomputed reference ------------------------------------------------------------------------------------

    def reference_columns(self, dataset) -> tuple[str, ...]:
        return ("ref_logps", "ref_kl_logps") if KL_COLUMN in dataset.column_names else ("ref_logps",)

    def reference_values(self, model, batch: dict, rows: int) -> dict[str, torch.Tensor]:
        values = {"ref_logps": self.sequence_logps(model, batch)}
        if "kl_input_ids" in batch:
            values["ref_kl_logps"] = self.sequence_logps(model, batch, kl=True)
        return values
