"""Config fields that DPO and KTO share (TRL declares them on each config), declared once, like MemoryOptions.

Each mixin comes before TrainingArguments in a config's bases and has its own validator, which the config calls from
its `__post_init__`. The fields keep TRL's names, defaults and order: `PreferenceOptions` first, then
`ReferenceOptions`, then the config's own fields (the command line lists them all as the method's own fields). A
config may restate a field to give it a help text of its own; its place and default stay the mixin's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config_utils import non_default, positive_or_none

TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class PreferenceOptions:
    """DPO, KTO: the policy and its reference loaded by name, and how their examples are prepared and laid out."""

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


@dataclass
class ReferenceOptions:
    """DPO, KTO: the reference's log-probs computed once before training instead of at every step."""

    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute the reference log-probs once before training; no reference is held while training."},
    )
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Batch size of that pass (default: per_device_train_batch_size)."}
    )


def validate_preference_options(args) -> None:
    """Bounds and truncation of prepared examples: PreferenceOptions' fields, and RewardConfig's of the same names."""
    for name in ("max_length", "max_prompt_length", "max_completion_length", "pad_to_multiple_of", "dataset_num_proc"):
        positive_or_none(getattr(args, name), name)
    if args.truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"`truncation_mode` must be one of {TRUNCATION_MODES}, got {args.truncation_mode!r}.")
    if args.max_length is None and non_default(args, "truncation_mode"):
        raise ValueError("`truncation_mode` has no effect with `max_length=None` (it says how `max_length` cuts); "
                         "set `max_length` or leave `truncation_mode` at its default.")


def validate_reference_options(args) -> None:
    positive_or_none(args.precompute_ref_batch_size, "precompute_ref_batch_size")
    if args.precompute_ref_batch_size is not None and not args.precompute_ref_log_probs:
        raise ValueError("`precompute_ref_batch_size` has no effect without `precompute_ref_log_probs=True`; set "
                         "`precompute_ref_log_probs=True` or leave `precompute_ref_batch_size` unset.")
