"""SFTConfig: TRL's field names and meanings on top of transformers' TrainingArguments."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .config_utils import (
    non_default,
    positive_or_none,
    resolve_pad_to_multiple_of,
    resolve_shared_settings,
    validate_shared_options,
)
from .memory_options import MemoryOptions
from .trl_options import CausalLMOptions

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
TRUNCATION_MODES = ("keep_start", "keep_end")
SFT_LOSS_TYPES = ("nll", "dft")


@dataclass
class SFTConfig(MemoryOptions, CausalLMOptions, TrainingArguments):
    """Configuration of supervised fine-tuning. Defaults match TRL's, except where noted."""

    # Overridden TrainingArguments defaults (TRL's choices).
    learning_rate: float = field(default=2e-5, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps."})

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for from_pretrained when `model` is a string (dtype, attn_implementation, ...)."},
    )
    chat_template_path: str | None = field(
        default=None, metadata={"help": "A Jinja chat-template file (or tokenizer dir) to use instead of the tokenizer's."}
    )

    # Data preparation
    dataset_text_field: str = field(default="text", metadata={"help": "Column holding text for language-modelling data."})
    dataset_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Extra dataset options; {'skip_prepare_dataset': True} uses the data as given."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset tokenisation."})
    eos_token: str | None = field(default=None, metadata={"help": "EOS token appended to each example (default: tokenizer's)."})
    pad_token: str | None = field(default=None, metadata={"help": "Padding token (default: tokenizer's, else its EOS)."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Truncate tokenised examples to this many tokens (None: no truncation)."}
    )
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Deprecated alias of max_length."}
    )
    truncation_mode: str = field(default="keep_start", metadata={"help": "keep_start or keep_end."})
    shuffle_dataset: bool = field(default=False, metadata={
        "help": "Shuffle the training set before packing (a stream: a seeded shuffle buffer of 1000 rows)."})

    # Packing and padding
    packing: bool = field(default=False, metadata={"help": "Pack examples into rows of max_length tokens."})
    packing_strategy: str = field(
        default="bfd", metadata={"help": "bfd, bfd_split or wrapped (used when packing or eval_packing is on)."}
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Flatten each batch into one row with restarting position_ids (no padding). With packing: "
                  "the batch's packed rows are laid end to end in one row, every sequence keeping its own "
                  "positions (as TRL's bfd packing does); same targets and losses as packing alone, minus the "
                  "padding at the end of each packed row."},
    )
    pad_to_multiple_of: int | None = field(default=None, metadata={
        "help": "Pad each batch to a multiple of this (under context parallelism: default and required multiple "
                "2 x cp_size)."})
    eval_packing: bool | None = field(default=None, metadata={"help": "Pack the eval set (default: same as packing)."})

    # Loss
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "Loss on completion tokens only (default: on for prompt-completion data)."}
    )
    assistant_only_loss: bool = field(
        default=False,
        metadata={"help": "Loss on assistant turns only: the chat template's {%% generation %%} blocks, or, in a "
                  "template without them, the tokens each assistant turn adds to the rendered conversation. With "
                  "completion_only_loss on: assistant turns of the completion only."},
    )
    loss_type: str = field(default="nll", metadata={
        "help": "nll (token-mean cross-entropy) or dft (each token's NLL weighted by its detached probability)."})
    use_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Never hold the full logits: liger-kernel's fused kernels on CUDA (on CPU with TRITON_INTERPRET=1), else leantune's chunked loss."},
    )

    def __post_init__(self):
        if self.max_seq_length is not None:
            warnings.warn(
                "`max_seq_length` is deprecated; use `max_length` (same meaning). Using max_length="
                f"{self.max_seq_length}.",
                FutureWarning,
                stacklevel=3,
            )
            self.max_length = self.max_seq_length
            self.max_seq_length = None
        resolve_shared_settings(self)
        validate_sft_config(self)
        resolve_pad_to_multiple_of(self)  # context parallelism: 2 x cp_size, as TRL's CP guide asks
        super().__post_init__()


def validate_sft_config(args: SFTConfig) -> None:
    """Reject settings that cannot work, with the reason, before any data is touched."""
    validate_shared_options(args)
    positive_or_none(args.max_length, "max_length")
    positive_or_none(args.pad_to_multiple_of, "pad_to_multiple_of")
    positive_or_none(args.dataset_num_proc, "dataset_num_proc")
    if args.packing_strategy not in PACKING_STRATEGIES:
        raise ValueError(f"`packing_strategy` must be one of {PACKING_STRATEGIES}, got {args.packing_strategy!r}.")
    if args.truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"`truncation_mode` must be one of {TRUNCATION_MODES}, got {args.truncation_mode!r}.")
    if args.loss_type not in SFT_LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {SFT_LOSS_TYPES}, got {args.loss_type!r}.")
    for name in ("packing", "eval_packing"):
        if getattr(args, name) and args.max_length is None:
            raise ValueError(f"`{name}=True` needs `max_length`, the length of the packed rows; set `max_length`.")
    if not (args.packing or args.eval_packing) and non_default(args, "packing_strategy"):
        raise ValueError("`packing_strategy` has no effect without `packing=True` (or `eval_packing=True`); set "
                         "`packing=True` or leave `packing_strategy` at its default.")
    splits_long = args.packing_strategy in ("bfd_split", "wrapped")
    if non_default(args, "truncation_mode"):
        if args.max_length is None:
            raise ValueError("`truncation_mode` has no effect with `max_length=None` (nothing is truncated); set "
                             "`max_length` or leave `truncation_mode` at its default.")
        if args.packing and args.eval_packing is not False and splits_long:
            raise ValueError(f"`truncation_mode` has no effect with `packing_strategy={args.packing_strategy!r}`, "
                             f"which splits long examples instead of truncating them; use `packing_strategy='bfd'` "
                             f"or leave `truncation_mode` at its default.")
