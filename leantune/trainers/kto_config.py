"""KTOConfig: TRL's field names and meanings on top of transformers' TrainingArguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..losses.kto import KTO_LOSS_TYPES
from .config_utils import non_default, positive_or_none, resolve_shared_settings, validate_shared_options
from .dpo_config import TRUNCATION_MODES
from .memory_options import MemoryOptions
from .trl_options import CausalLMOptions, ReferenceSyncOptions


@dataclass
class KTOConfig(MemoryOptions, CausalLMOptions, ReferenceSyncOptions, TrainingArguments):
    """Kahneman-Tversky Optimization: desirable / undesirable completions, each judged on its own.

    Defaults match TRL's, except: batches are sampled at random (TRL: sequential), because the mismatched
    completions of the KL term are fixed per example in data preparation rather than by batch position; and the
    truncation fields of DPOConfig (max_prompt_length, max_completion_length, truncation_mode) and padding_free
    are accepted with DPO's meanings.
    """

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
        metadata={"help": "All sequences of a batch in one row with restarting position_ids (no padding)."},
    )
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad each batch to a multiple of this."})

    # Reference
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute the reference log-probs (of the completions and of the KL term's mismatched "
                          "completions) once before training; no reference is held while training."},
    )
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Batch size of that pass (default: per_device_train_batch_size)."}
    )

    # Loss
    loss_type: str = field(
        default="kto", metadata={"help": "kto (KTO paper, eq. 7) or apo_zero_unpaired (APO-zero, no KL term)."}
    )
    beta: float = field(default=0.1, metadata={"help": "Strength of the pull towards the reference."})
    desirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of desirable examples' losses (balances unequal counts)."}
    )
    undesirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of undesirable examples' losses (balances unequal counts)."}
    )

    def __post_init__(self):
        if isinstance(self.loss_type, (list, tuple)):
            if len(self.loss_type) != 1:
                raise ValueError(f"One loss_type at a time is supported, got {self.loss_type}.")
            self.loss_type = self.loss_type[0]
        resolve_shared_settings(self)
        validate_kto_config(self)
        super().__post_init__()

    @property
    def uses_kl(self) -> bool:
        """Whether the loss needs the KL reference point (and so the mismatched completions)."""
        return self.loss_type == "kto"


def validate_kto_config(args: KTOConfig) -> None:
    validate_shared_options(args)
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
    if args.loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {KTO_LOSS_TYPES}, got {args.loss_type!r}.")
    if args.beta <= 0:
        raise ValueError(f"`beta` must be positive, got {args.beta}.")
    for name in ("desirable_weight", "undesirable_weight"):
        if getattr(args, name) < 0:
            raise ValueError(f"`{name}` must be >= 0, got {getattr(args, name)}.")
    if args.desirable_weight == 0 and args.undesirable_weight == 0:
        raise ValueError("`desirable_weight` and `undesirable_weight` are both 0: nothing would be learned.")
