"""Recognise which of the accepted dataset formats a dataset is in, or say why it is none of them."""

from __future__ import annotations

import functools
import hashlib
import warnings
from enum import Enum
from pathlib import Path


class SFTFormat(str, Enum):
    LANGUAGE_MODELING = "language_modeling"  # {text}
    PROMPT_COMPLETION = "prompt_completion"  # {prompt, completion} strings
    CONVERSATIONAL = "conversational"  # {messages: [{role, content}, ...]}
    CONVERSATIONAL_PROMPT_COMPLETION = "conversational_prompt_completion"  # {prompt, completion} message lists
    TOKENIZED = "tokenized"  # {input_ids, [completion_mask], [assistant_masks]}


ACCEPTED_SFT_FORMATS = (
    "language modelling {'<dataset_text_field>': str}; "
    "prompt-completion {'prompt': str, 'completion': str}; "
    "conversational {'messages': [{'role', 'content'}, ...]} (or ShareGPT's {'conversations': [{'from', 'value'}]}); "
    "conversational prompt-completion {'prompt': [messages], 'completion': [messages]}; "
    "pre-tokenised {'input_ids': [int], optional 'completion_mask'/'assistant_masks'}"
)


@functools.lru_cache(maxsize=1)
def data_code_digest() -> str:
    """A digest of leantune's data code. The callables given to `Dataset.map` keep it in their state, so the
    fingerprint `datasets` caches a map's result under changes with the code: a cache written by other code (an
    older leantune) is never reused."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# What a chat message may carry besides its role: an assistant turn that only calls tools has `tool_calls` and no
# `content`; a reasoning model's turn may carry its reasoning apart (harmony's `thinking`, Qwen3's
# `reasoning_content`).
MESSAGE_PAYLOADS = ("content", "tool_calls", "thinking", "reasoning_content")


def is_message_list(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and "role" in m and any(key in m for key in MESSAGE_PAYLOADS) for m in value)


def message_has_payload(message: dict) -> bool:
    """Whether a message gives the model something to read or learn: text, reasoning, or a tool call."""
    return any(str(message.get(key) or "").strip() for key in ("content", "thinking", "reasoning_content")) or bool(
        message.get("tool_calls"))


def completion_text(completion) -> str:
    """A completion's text: the string itself, or the content of the last message of a conversational one."""
    return completion if isinstance(completion, str) else completion[-1].get("content") or ""


def _first_non_null(dataset, column: str):
    for value in dataset.select(range(min(len(dataset), 64)))[column]:
        if value is not None and value != []:
            return value
    return None


def detect_sft_format(dataset, text_field: str = "text") -> SFTFormat:
    """Decide the format from the columns and the type of the first non-empty values."""
    columns = set(dataset.column_names)
    if "input_ids" in columns:
        return SFTFormat.TOKENIZED
    if "messages" not in columns and "conversations" in columns and _is_sharegpt(
            _first_non_null(dataset, "conversations")):
        return SFTFormat.CONVERSATIONAL  # ShareGPT, read as messages (from_sharegpt)
    if "messages" in columns:
        sample = _first_non_null(dataset, "messages")
        if sample is None or is_message_list(sample) or _is_sharegpt(sample):
            return SFTFormat.CONVERSATIONAL
        raise ValueError(
            "Column 'messages' must hold lists of {'role': ..., 'content': ...} dicts; "
            f"found {type(sample).__name__}. Accepted formats: {ACCEPTED_SFT_FORMATS}."
        )
    if {"prompt", "completion"} <= columns:
        prompt, completion = _first_non_null(dataset, "prompt"), _first_non_null(dataset, "completion")
        if is_message_list(prompt) and is_message_list(completion):
            return SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION
        if isinstance(prompt, str) and isinstance(completion, str):
            return SFTFormat.PROMPT_COMPLETION
        raise ValueError(
            "Columns 'prompt' and 'completion' must both be strings or both be lists of messages; found "
            f"{type(prompt).__name__} and {type(completion).__name__}. Accepted formats: {ACCEPTED_SFT_FORMATS}."
        )
    if text_field in columns:
        sample = _first_non_null(dataset, text_field)
        if sample is None or isinstance(sample, str):
            return SFTFormat.LANGUAGE_MODELING
        if is_message_list(sample):
            raise ValueError(
                f"Column '{text_field}' holds messages; name the column 'messages' for conversational data."
            )
    raise ValueError(
        f"Could not recognise the dataset format. Columns found: {sorted(columns)}. "
        f"Accepted formats: {ACCEPTED_SFT_FORMATS}. For text in another column, set dataset_text_field."
    )


# Pre-tokenised columns under the names older TRL releases (and leantune before TRL 1.16's names) used.
LEGACY_TOKEN_COLUMNS = {"prompt_input_ids": "prompt_ids", "chosen_input_ids": "chosen_ids",
                        "rejected_input_ids": "rejected_ids", "completion_input_ids": "completion_ids",
                        "kl_completion_input_ids": "KL_completion_ids"}


def current_column_names(column_names) -> set[str]:
    """The column names as `rename_legacy_token_columns` will leave them (for format checks before renaming)."""
    columns = set(column_names)
    return {LEGACY_TOKEN_COLUMNS.get(c, c) if LEGACY_TOKEN_COLUMNS.get(c) not in columns else c for c in columns}


def rename_legacy_token_columns(dataset):
    """Read `prompt_input_ids`-style columns as TRL 1.16's `prompt_ids`-style ones, with a FutureWarning, so data
    tokenised for an older TRL still trains; a column whose new name is present too is left alone."""
    columns = set(dataset.column_names or ())
    renames = {old: new for old, new in LEGACY_TOKEN_COLUMNS.items() if old in columns and new not in columns}
    if not renames:
        return dataset

    listed = ", ".join(f"`{old}` -> `{new}`" for old, new in renames.items())
    warnings.warn(f"Pre-tokenised columns under their old names are read as the new ones ({listed}); the old names "
                  "are deprecated and will not be supported in v1: rename the columns.", FutureWarning, stacklevel=3)
    return dataset.rename_columns(renames)


# ShareGPT's message lists: {"from": "human" | "gpt" | "system" | ..., "value": text}, in a `conversations` column.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
MESSAGE_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages", "conversations")


def _is_sharegpt(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "from" in m and "value" in m for m in value)


def from_sharegpt(dataset):
    """ShareGPT data as leantune's (and TRL's) messages: `from`/`value` become `role`/`content` (human -> user,
    gpt -> assistant, other roles as they are) in every message-list column, and `conversations` becomes
    `messages`. Other data is returned as it is."""
    columns = [c for c in MESSAGE_COLUMNS if c in (dataset.column_names or ())]
    sharegpt = [c for c in columns if _is_sharegpt(_first_non_null(dataset, c))]
    if not sharegpt:
        return dataset

    def convert(batch):
        return {c: [[{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]} for m in messages]
                    if messages is not None else None for messages in batch[c]] for c in sharegpt}

    converted = dataset.map(convert, batched=True, remove_columns=sharegpt, desc="Reading ShareGPT messages")
    if "conversations" in sharegpt and "messages" not in dataset.column_names:
        converted = converted.rename_column("conversations", "messages")
    return converted


def last_message_as_completion(dataset):
    """A conversational `messages` dataset as conversational prompt-completion: the last message is the completion
    and the ones before it the prompt, as TRL's GKD collator reads `messages`. Any other dataset is returned as is."""
    columns = set(getattr(dataset, "column_names", None) or ())
    if "messages" not in columns or "prompt" in columns or "completion" in columns:
        return dataset
    return dataset.map(lambda row: {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]},
                       remove_columns=["messages"])
