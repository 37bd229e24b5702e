"""RewardConfig: TRL's field names and meanings on top of transformers' TrainingArguments."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .config_utils import resolve_pad_to_multiple_of, resolve_shared_settings, validate_shared_options
from .memory_options import MemoryOptions
from .preference_options import (
    TRUNCATION_MODES,  # noqa: F401  (importable from here, as before)
    validate_preference_options,
)
from .trl_options import ModelLoadingOptions


@dataclass
class RewardConfig(MemoryOptions, ModelLoadingOptions, TrainingArguments):
    """Reward modelling (a sequence-classification model scoring chosen above rejected). Defaults match TRL's,
    except where noted: TRL drops pairs longer than `max_length`; leantune truncates them (counted), by default
    keeping the end of each sequence, since that is where the reward is read."""

    learning_rate: float = field(default=1e-4, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps."})

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for AutoModelForSequenceClassification.from_pretrained when `model` is "
                          "a string (num_labels=1 is always set; dtype defaults to float32, as in TRL)."},
    )
    chat_template_path: str | None = field(
        default=None, metadata={"help": "A Jinja chat-template file (or tokenizer dir) to use instead of the tokenizer's."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model."})

    # Data
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset tokenisation."})
    eos_token: str | None = field(default=None, metadata={"help": "EOS token ending each completion (default: tokenizer's)."})
    pad_token: str | None = field(default=None, metadata={"help": "Padding token (default: tokenizer's, else its EOS)."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Bound on prompt + completion tokens of each sequence (None: no bound)."}
    )
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Bound on prompt tokens (keeps the end of the prompt); applied first."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Bound on completion tokens (keeps the start); applied first."}
    )
    truncation_mode: str = field(
        default="keep_end",
        metadata={"help": "keep_end (cut the shared prompt's start; default) or keep_start (cut completions' ends; a "
                          "pair whose prompt alone fills max_length is dropped)."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "All chosen and rejected sequences of a batch in one row with restarting position_ids "
                          "(decoder models with a per-token `score` head)."},
    )
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad each batch to a multiple of this."})

    # Loss
    center_rewards_coefficient: float | None = field(
        default=None,
        metadata={"help": "Weight of mean((r_chosen + r_rejected)^2), which keeps rewards centred on zero "
                          "(arXiv:2312.09244, Eq. 2). Recommended: 0.01."},
    )

    def __post_init__(self):
        resolve_shared_settings(self)
        validate_reward_config(self)
        resolve_pad_to_multiple_of(self)  # context parallelism: 2 x cp_size, as SFT's
        super().__post_init__()


def validate_reward_config(args: RewardConfig) -> None:
    validate_shared_options(args)
    validate_preference_options(args)  # its fields of the same names: bounds and truncation of the pairs
    coefficient = args.center_rewards_coefficient
    if coefficient is not None and (not isinstance(coefficient, (int, float)) or isinstance(coefficient, bool)
                                    or not math.isfinite(coefficient) or coefficient < 0):
        raise ValueError(f"`center_rewards_coefficient` must be a number >= 0 or None, got {coefficient!r}.")
