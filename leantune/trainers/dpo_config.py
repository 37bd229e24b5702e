"""DPOConfig: TRL's field names and meanings on top of transformers' TrainingArguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..losses.preference import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    F_DIVERGENCE_TYPES,
    LABEL_SMOOTHING_LOSS_TYPES,
)
from .config_utils import resolve_pad_to_multiple_of, resolve_shared_settings, validate_shared_options
from .memory_options import MemoryOptions
from .preference_options import (
    TRUNCATION_MODES,  # noqa: F401  (importable from here, as before)
    PreferenceOptions,
    ReferenceOptions,
    validate_preference_options,
    validate_reference_options,
)
from .trl_options import CausalLMOptions, ReferenceSyncOptions


@dataclass
class DPOConfig(MemoryOptions, CausalLMOptions, ReferenceSyncOptions, ReferenceOptions, PreferenceOptions,
                TrainingArguments):
    """Direct Preference Optimization. Defaults match TRL's, except where noted."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps."})

    # Models, data, reference: PreferenceOptions and ReferenceOptions (preference_options.py); DPO's own words and
    # fields here.
    padding_free: bool = field(
        default=False,
        metadata={"help": "All chosen and rejected sequences of a batch in one row with restarting position_ids."},
    )
    pad_token: str | None = field(default=None, metadata={"help": "Padding token (default: tokenizer's, else its EOS)."})

    # Loss
    loss_type: list[str] | str = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": "One or several of " + ", ".join(DPO_LOSS_TYPES) + "; several are summed with "
                          "`loss_weights`."},
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per loss_type; the loss is the weighted sum (default: all 1)."}
    )
    ld_alpha: float | None = field(
        default=None,
        metadata={"help": "LD-DPO: weight in [0, 1] of completion log-probs beyond the pair's shared length (None: 1)."},
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        metadata={"help": "f-DPO regulariser: " + ", ".join(F_DIVERGENCE_TYPES) + " (loss types "
                          + ", ".join(F_DIVERGENCE_LOSS_TYPES) + ")."},
    )
    f_alpha_divergence_coef: float = field(
        default=0.5, metadata={"help": "alpha of f_divergence_type='alpha_divergence'."}
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "Label-flip probability in [0, 0.5) of robust, aot and aot_unpaired; EXO's epsilon."},
    )
    beta: float = field(default=0.1, metadata={"help": "Strength of the pull towards the reference (IPO: tau)."})
    use_weighting: bool = field(
        default=False, metadata={"help": "WPO: weight each pair's loss by the policy's (detached) length-normalised "
                                 "probability of its chosen and of its rejected completion."}
    )
    discopop_tau: float = field(default=0.05, metadata={"help": "Temperature of the discopop loss."})

    def __post_init__(self):
        resolve_shared_settings(self)
        validate_dpo_config(self)
        resolve_pad_to_multiple_of(self)  # context parallelism: 2 x cp_size, as SFT's
        super().__post_init__()


def validate_dpo_config(args: DPOConfig) -> None:
    validate_shared_options(args)
    validate_preference_options(args)
    validate_reference_options(args)
    validate_dpo_loss(args)


def dpo_loss_types(args) -> tuple[str, ...]:
    """`loss_type` as a tuple (a string or a list in the config, as in TRL; the config itself is left as given)."""
    loss_type = args.loss_type
    return (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)


def dpo_loss_weights(args) -> tuple[float, ...]:
    return tuple(float(w) for w in args.loss_weights) if args.loss_weights is not None else \
        (1.0,) * len(dpo_loss_types(args))


def validate_dpo_loss(args) -> None:
    types = dpo_loss_types(args)
    if not types or any(name not in DPO_LOSS_TYPES for name in types):
        raise ValueError(f"`loss_type` must be one or more of {DPO_LOSS_TYPES}, got {args.loss_type!r}.")
    if args.loss_weights is not None and len(args.loss_weights) != len(types):
        raise ValueError(f"`loss_weights` must have one weight per loss_type: {len(args.loss_weights)} weights for "
                         f"{len(types)} loss types.")
    if args.beta <= 0:
        raise ValueError(f"`beta` must be positive, got {args.beta}.")
    if not 0.0 <= args.label_smoothing < 0.5:
        raise ValueError(f"`label_smoothing` must be in [0, 0.5), got {args.label_smoothing}.")
    smoothed = [name for name in types if name in LABEL_SMOOTHING_LOSS_TYPES]
    if args.label_smoothing and not smoothed:
        raise ValueError(f"`label_smoothing` has no effect on loss_type {list(types)} (as in TRL it applies to "
                         f"{', '.join(LABEL_SMOOTHING_LOSS_TYPES)}); leave it at 0.")
    if "exo_pair" in types and args.label_smoothing == 0.0:
        raise ValueError("`label_smoothing` must be > 0 with loss_type 'exo_pair' (the EXO paper recommends 1e-3).")
    if args.f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(f"`f_divergence_type` must be one of {F_DIVERGENCE_TYPES}, got {args.f_divergence_type!r}.")
    other = [name for name in types if name not in F_DIVERGENCE_LOSS_TYPES]
    if args.f_divergence_type != "reverse_kl" and other:
        raise ValueError(f"`f_divergence_type={args.f_divergence_type!r}` applies only to loss types "
                         f"{F_DIVERGENCE_LOSS_TYPES}, not to {other}.")
    if args.ld_alpha is not None and not 0.0 <= args.ld_alpha <= 1.0:
        raise ValueError(f"`ld_alpha` must be in [0, 1] or None, got {args.ld_alpha}.")
    if args.discopop_tau <= 0:
        raise ValueError(f"`discopop_tau` must be positive, got {args.discopop_tau}.")
    if args.use_weighting and {"aot", "aot_unpaired"} & set(types):
        raise ValueError("`use_weighting` (WPO) cannot weight the aot / aot_unpaired losses: they sort the batch's "
                         "margins, so a pair's weight has no pair loss to go to. Use another loss_type.")
