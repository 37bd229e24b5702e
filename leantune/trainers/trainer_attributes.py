"""The attributes read from a trainer from outside (TRL's names, leantune's reports), each read from the part that
holds it: the trainer answers for its parts without holding their state twice."""

from __future__ import annotations


class TrainerAttributes:
    @property
    def logprob_path(self):
        """The chosen log-prob path (full logits, the chunked head or Liger's kernel): parts/logprob_engine.py."""
        return self.logprobs.path

    @logprob_path.setter
    def logprob_path(self, path) -> None:  # tests compare the paths on one trainer
        self.logprobs.path = path

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's attribute: whether the MoE router loss is added (base.py's StepLoss)."""
        return self.step_loss.router_loss_enabled

    @property
    def router_aux_loss_coef(self) -> float:
        """TRL's attribute: the router loss's coefficient."""
        return self.step_loss.router_loss_coef

    @property
    def memory_breakdown(self):
        """One optimizer step's memory by part, when `memory_breakdown` measured it (metrics/run_metrics.py)."""
        return self.run_metrics.memory_breakdown

    @property
    def data_reports(self) -> dict:
        """The preparation report of each split (drops, truncation, packing), by split name."""
        return self.splits.reports

    @property
    def stream_reports(self) -> dict:
        return self.splits.stream_reports
