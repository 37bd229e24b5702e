"""Recognise which of the accepted dataset formats a dataset is in, or say why it is none of them."""

from __future__ import annotations

from enum import Enum


class SFTFormat(str, Enum):
    LANGUAGE_MODELING = "language_modeling"  # {text}
    PROMPT_COMPLETION = "prompt_completion"  # {prompt, completion} strings
    CONVERSATIONAL = "conversational"  # {messages: [{role, content}, ...]}
    CONVERSATIONAL_PROMPT_COMPLETION = "conversational_prompt_completion"  # {prompt, completion} message lists
    TOKENIZED = "tokenized"  # {input_ids, [completion_mask], [assistant_masks]}


ACCEPTED_SFT_FORMATS = (
    "language modelling {'<dataset_text_field>': str}; "
    "prompt-completion {'prompt': str, 'completion': str}; "
    "conversational {'messages': [{'role', 'content'}, ...]}; "
    "conversational prompt-completion {'prompt': [messages], 'completion': [messages]}; "
    "pre-tokenised {'input_ids': [int], optional 'completion_mask'/'assistant_masks'}"
)


def is_message_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def completion_text(completion) -> str:
    """A completion's text: the string itself, or the content of the last message of a conversational one."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


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
    if "messages" in columns:
        sample = _first_non_null(dataset, "messages")
        if sample is None or is_message_list(sample):
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
