"""KTOConfig: TRL's field names and meanings on top of transformers' TrainingArguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..data.kto_preparation import KL_PAIRINGS
from ..losses.kto import KTO_LOSS_TYPES
from .config_utils import resolve_pad_to_multiple_of, resolve_shared_settings, validate_shared_options
from .memory_options import MemoryOptions
from .preference_options import (
    PreferenceOptions,
    ReferenceOptions,
    validate_preference_options,
    validate_reference_options,
)
from .trl_options import CausalLMOptions, ReferenceSyncOptions


@dataclass
class KTOConfig(MemoryOptions, CausalLMOptions, ReferenceSyncOptions, ReferenceOptions, PreferenceOptions,
                TrainingArguments):
    """Kahneman-Tversky Optimization: desirable / undesirable completions, each judged on its own.

    Defaults match TRL's, except: batches are sampled at random (TRL: sequential), because the mismatched
    completions of the KL term are fixed per example in data preparation rather than by batch position
    (`kl_pairing="batch"` with `train_sampling_strategy="sequential"` pairs them as TRL does); and the
    truncation fields of DPOConfig (max_prompt_length, max_completion_length, truncation_mode) and padding_free
    are accepted with DPO's meanings.
    """

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps."})

    # Models, data, reference: PreferenceOptions and ReferenceOptions (preference_options.py); KTO's own words here.
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute the reference log-probs (of the completions and of the KL term's mismatched "
                          "completions) once before training; no reference is held while training."},
    )

    # Loss
    loss_type: str = field(
        default="kto", metadata={"help": "kto (KTO paper, eq. 7) or apo_zero_unpaired (APO-zero, no KL term)."}
    )
    beta: float = field(default=0.1, metadata={"help": "Strength of the pull towards the reference."})
    kl_pairing: str = field(
        default="permutation",
        metadata={"help": "Whose completion each prompt's KL sequence takes. permutation: the next example's in a "
                          "seeded permutation of the dataset (batches may then be shuffled); batch: the previous "
                          "example's within each block of per_device_train_batch_size examples, as TRL (needs "
                          "train_sampling_strategy='sequential', so that a block is a batch)."},
    )
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
        resolve_pad_to_multiple_of(self)  # context parallelism: 2 x cp_size, as SFT's
        super().__post_init__()

    @property
    def uses_kl(self) -> bool:
        """Whether the loss needs the KL reference point (and so the mismatched completions)."""
        return self.loss_type == "kto"


def validate_kto_config(args: KTOConfig) -> None:
    validate_shared_options(args)
    validate_preference_options(args)
    validate_reference_options(args)
    if args.loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {KTO_LOSS_TYPES}, got {args.loss_type!r}.")
    if args.beta <= 0:
        raise ValueError(f"`beta` must be positive, got {args.beta}.")
    if args.kl_pairing not in KL_PAIRINGS:
        raise ValueError(f"`kl_pairing` must be one of {KL_PAIRINGS}, got {args.kl_pairing!r}.")
    if args.kl_pairing == "batch" and args.uses_kl and args.train_sampling_strategy != "sequential":
        raise ValueError("`kl_pairing='batch'` pairs each prompt with a neighbour of its batch, which holds only if "
                         f"batches are drawn in order: set `train_sampling_strategy='sequential'` (got "
                         f"{args.train_sampling_strategy!r}), or keep `kl_pairing='permutation'`.")
    for name in ("desirable_weight", "undesirable_weight"):
        if getattr(args, name) < 0:
            raise ValueError(f"`{name}` must be >= 0, got {getattr(args, name)}.")
    if args.desirable_weight == 0 and args.undesirable_weight == 0:
        raise ValueError("`desirable_weight` and `undesirable_weight` are both 0: nothing would be learned.")
