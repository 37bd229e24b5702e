"""DPOConfig: TRL's field names and meanings on top of transformers' TrainingArguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..losses.preference import DPO_LOSS_TYPES
from .config_utils import (
    non_default,
    positive_or_none,
    resolve_bf16,
    resolve_checkpointing,
    validate_batch_sizes,
)
from .memory_options import MemoryOptions, validate_memory_options

TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class DPOConfig(MemoryOptions, TrainingArguments):
    """Direct Preference Optimization. Defaults match TRL's, except where noted."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps."})

    # Models
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when `model` is a string."}
    )
    ref_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when `ref_model` is a string."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model and reference."})

    # Data
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset tokenisation."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Bound on prompt + completion tokens of each sequence (None: no bound)."}
    )
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Older bound on prompt tokens (keeps the end of the prompt); applied first."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Older bound on completion tokens (keeps the start); applied first."}
    )
    truncation_mode: str = field(
        default="keep_start", metadata={"help": "keep_start (cut completions' ends) or keep_end (cut prompts' starts)."}
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "All chosen and rejected sequences of a batch in one row with restarting position_ids."},
    )
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad each batch to a multiple of this."})

    # Reference
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute the reference log-probs once before training; no reference is held while training."},
    )
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Batch size of that pass (default: per_device_train_batch_size)."}
    )

    # Loss
    loss_type: str = field(default="sigmoid", metadata={"help": "sigmoid, ipo or hinge."})
    beta: float = field(default=0.1, metadata={"help": "Strength of the pull towards the reference (IPO: tau)."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Probability that a preference label is flipped (robust DPO; sigmoid loss)."}
    )

    def __post_init__(self):
        if isinstance(self.loss_type, (list, tuple)):
            if len(self.loss_type) != 1:
                raise ValueError(f"One loss_type at a time is supported, got {self.loss_type}.")
            self.loss_type = self.loss_type[0]
        resolve_bf16(self)
        resolve_checkpointing(self)
        validate_dpo_config(self)
        super().__post_init__()


def validate_dpo_config(args: DPOConfig) -> None:
    validate_memory_options(args)
    validate_batch_sizes(args)
    for name in ("max_length", "max_prompt_length", "max_completion_length", "pad_to_multiple_of",
                 "dataset_num_proc", "precompute_ref_batch_size"):
        positive_or_none(getattr(args, name), name)
    if args.truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"`truncation_mode` must be one of {TRUNCATION_MODES}, got {args.truncation_mode!r}.")
    if args.max_length is None and non_default(args, "truncation_mode"):
        raise ValueError("`truncation_mode` has no effect with `max_length=None` (it says how `max_length` cuts); "
                         "set `max_length` or leave `truncation_mode` at its default.")
    if args.precompute_ref_batch_size is not None and not args.precompute_ref_log_probs:
        raise ValueError("`precompute_ref_batch_size` has no effect without `precompute_ref_log_probs=True`; set "
                         "`precompute_ref_log_probs=True` or leave `precompute_ref_batch_size` unset.")
    if args.loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {DPO_LOSS_TYPES}, got {args.loss_type!r}.")
    if args.beta <= 0:
        raise ValueError(f"`beta` must be positive, got {args.beta}.")
    if not 0.0 <= args.label_smoothing < 0.5:
        raise ValueError(f"`label_smoothing` must be in [0, 0.5), got {args.label_smoothing}.")
    if args.label_smoothing and args.loss_type != "sigmoid":
        raise ValueError(f"`label_smoothing` applies to the sigmoid loss only, not to {args.loss_type!r}.")
