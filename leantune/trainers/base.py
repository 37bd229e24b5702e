"""What every leantune trainer shares on top of transformers' Trainer.

- The loss of an optimizer step is the mean over the real target tokens of that whole step (all micro-batches of
  gradient accumulation and, with `average_tokens_across_devices`, all processes), so micro-batch size,
  accumulation, padding and packing do not change it.
- Real tokens/s, padding fraction and peak memory are logged with the loss and reported at the end of training.
"""

from __future__ import annotations

import logging

import torch
from transformers import Trainer

from ..losses.causal_lm import count_targets
from ..metrics.memory import memory_kind, peak_memory_bytes, reset_peak_memory
from ..metrics.throughput import TokenThroughput

logger = logging.getLogger("leantune.trainer")

MIB = 1024 * 1024


class LeantuneTrainer(Trainer):
    # compute_loss divides by the target count of the whole step, so the Trainer must not divide again.
    loss_is_scaled_for_ga = True
    # Dataset columns the collators read; everything else is removed by Trainer.
    dataset_columns: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        self.throughput = TokenThroughput()
        self.data_reports: dict = {}
        super().__init__(*args, **kwargs)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(self.dataset_columns)

    # --- loss normalisation over the whole optimizer step -------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        count = sum((count_targets(b["labels"]) for b in batch_samples if "labels" in b), torch.tensor(0))
        count = count.to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return batch_samples, count

    def normalise(self, loss_sum: torch.Tensor, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """Divide a summed token loss by the step's target count (per-batch count outside training)."""
        if num_items_in_batch is None:
            return loss_sum / count_targets(labels).clamp(min=1)
        loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            loss = loss * self.args.world_size  # DDP averages gradients over processes
        return loss

    def count_tokens(self, model, inputs: dict) -> None:
        real = inputs.pop("num_real_tokens", None)
        if model.training and real is not None:
            self.throughput.add(int(real), int(inputs["input_ids"].numel()))

    # --- metrics ------------------------------------------------------------------------------------------------

    def train(self, *args, **kwargs):
        reset_peak_memory(self.args.device)
        self.throughput.restart()
        output = super().train(*args, **kwargs)
        summary = self.training_summary()
        output.metrics.update(summary)
        self.log_metrics("train", summary)
        return output

    def training_summary(self) -> dict:
        return {
            "real_tokens": self.throughput.real_tokens,
            "real_tokens_per_second": round(self.throughput.overall_rate(), 2),
            "padding_fraction": round(self.throughput.padding_fraction, 4),
            "peak_memory_mb": round(peak_memory_bytes(self.args.device) / MIB, 1),
            "peak_memory_kind": memory_kind(self.args.device),
        }

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if self.model is not None and self.model.training and "loss" in logs:
            logs["real_tokens_per_second"] = round(self.throughput.window_rate(), 2)
            logs["padding_fraction"] = round(self.throughput.padding_fraction, 4)
            logs["peak_memory_mb"] = round(peak_memory_bytes(self.args.device) / MIB, 1)
        super().log(logs, start_time)
