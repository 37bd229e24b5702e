"""Batches as Trainer's loop hands them to the model, done by our own code instead of transformers' private helpers:
the dataset columns a trainer keeps, a collated batch placed on the training device, and its targets read from its
labels."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...data.collators import IGNORE_INDEX, sequence_starts
from ...losses.token_logprobs import Targets, select_targets, target_sequences
from .step_guards import ROW_INDEX


def kept_columns(trainer) -> list[str]:
    """The dataset columns Trainer keeps for the collator (`remove_unused_columns`): the trainer's own, and each
    train row's index (step_guards.py), in place of the model's forward arguments transformers would keep."""
    return [*trainer.dataset_columns, ROW_INDEX]


def deepspeed_float_dtype(accelerator):
    """The dtype DeepSpeed trains in, which Trainer casts a batch's floating tensors to (None without DeepSpeed)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else plugin.hf_ds_config.dtype()


def on_device(batch, device, float_dtype=None):
    """A collated batch (dicts, lists and tuples of tensors) on `device`, as Trainer's training step places it:
    `float_dtype` (`deepspeed_float_dtype`) is what floating tensors are cast to."""
    if isinstance(batch, Mapping):
        return type(batch)({key: on_device(value, device, float_dtype) for key, value in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(on_device(value, device, float_dtype) for value in batch)
    if isinstance(batch, torch.Tensor):
        if float_dtype is not None and (torch.is_floating_point(batch) or torch.is_complex(batch)):
            return batch.to(device=device, dtype=float_dtype)
        return batch.to(device=device)
    return batch


def placed(trainer, batch):
    """`batch` on the trainer's device, as its training step would place it."""
    return on_device(batch, trainer.args.device, deepspeed_float_dtype(trainer.accelerator))


def labelled_targets(batch: dict) -> Targets:
    """A micro-batch's targets from its labels (`shift_labels` once it is laid out for the ring)."""
    if "shift_labels" in batch:
        return select_targets(batch["shift_labels"], shifted=True)
    return select_targets(batch["labels"])


def labelled_sequences(batch: dict, targets: Targets) -> torch.Tensor:
    """Which example of the micro-batch each target belongs to (its rows, or its padding-free row's segments)."""
    return target_sequences(targets, sequence_starts(batch))


def count_labelled_targets(batch: dict) -> int:
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
