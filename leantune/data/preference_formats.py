"""Preference (chosen / rejected) data: recognise its format, find the prompt, tokenise prompt and completions.

Shared by everything that reads preference pairs (the length profiler now, the DPO trainer later), so that
they all see the same prompt and the same completion tokens.

Accepted formats:

- explicit prompt: ``{prompt, chosen, rejected}`` strings, or message lists (conversational);
- implicit prompt: ``{chosen, rejected}`` only, whole strings or whole message lists that share a beginning;
  the shared beginning, cut back to a turn boundary, is the prompt (see `split_shared_prompt_text` and
  `split_shared_prompt_messages`);
- pre-tokenised: ``{prompt_ids, chosen_ids, rejected_ids}``.
"""

from __future__ import annotations

import os
from enum import Enum

from .chat_template import row_template_kwargs
from .formats import current_column_names, data_code_digest, is_message_list, message_has_payload
from .template_spans import split_after_prompt


class PreferenceFormat(str, Enum):
    EXPLICIT_PROMPT = "explicit_prompt"  # {prompt, chosen, rejected} strings
    CONVERSATIONAL_EXPLICIT_PROMPT = "conversational_explicit_prompt"  # same, message lists
    IMPLICIT_PROMPT = "implicit_prompt"  # {chosen, rejected} strings sharing a prefix
    CONVERSATIONAL_IMPLICIT_PROMPT = "conversational_implicit_prompt"  # same, message lists
    TOKENIZED = "tokenized"  # {prompt_ids, chosen_ids, rejected_ids}

    @property
    def conversational(self) -> bool:
        return self in (PreferenceFormat.CONVERSATIONAL_EXPLICIT_PROMPT, PreferenceFormat.CONVERSATIONAL_IMPLICIT_PROMPT)

    @property
    def implicit_prompt(self) -> bool:
        return self in (PreferenceFormat.IMPLICIT_PROMPT, PreferenceFormat.CONVERSATIONAL_IMPLICIT_PROMPT)


ACCEPTED_PREFERENCE_FORMATS = (
    "explicit prompt {'prompt': str, 'chosen': str, 'rejected': str} or the same with message lists; "
    "implicit prompt {'chosen': str, 'rejected': str} (whole dialogues sharing all but the last reply) or the same "
    "with message lists; pre-tokenised {'prompt_ids', 'chosen_ids', 'rejected_ids'}"
)
TOKENIZED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
# Where an assistant turn starts in dialogues written as text (Anthropic HH-RLHF style).
ASSISTANT_MARKERS = ("\n\nAssistant:",)


def is_preference_dataset(column_names) -> bool:
    columns = current_column_names(column_names)
    return {"chosen", "rejected"} <= columns or set(TOKENIZED_COLUMNS) <= columns


def _first_non_null(dataset, column: str):
    for value in dataset.select(range(min(len(dataset), 64)))[column]:
        if value is not None and value != [] and value != "":
            return value
    return None


def _kind(value) -> str:
    if isinstance(value, str):
        return "text"
    if is_message_list(value):
        return "messages"
    return type(value).__name__


def detect_preference_format(dataset) -> PreferenceFormat:
    """Decide the preference format from the columns and the types of the first non-empty values."""
    columns = current_column_names(dataset.column_names)
    if set(TOKENIZED_COLUMNS) <= columns:
        return PreferenceFormat.TOKENIZED
    if not {"chosen", "rejected"} <= columns:
        raise ValueError(
            f"Not preference data: no 'chosen' and 'rejected' columns. Columns found: {sorted(columns)}. "
            f"Accepted formats: {ACCEPTED_PREFERENCE_FORMATS}."
        )
    names = ["prompt", "chosen", "rejected"] if "prompt" in columns else ["chosen", "rejected"]
    kinds = {name: _kind(_first_non_null(dataset, name)) for name in names}
    if set(kinds.values()) - {"text", "messages", "NoneType"} or len(set(kinds.values()) - {"NoneType"}) > 1:
        found = ", ".join(f"'{name}' holds {kind}" for name, kind in kinds.items())
        raise ValueError(
            f"Preference columns must all be strings or all be lists of {{'role', 'content'}} messages; {found}. "
            f"Accepted formats: {ACCEPTED_PREFERENCE_FORMATS}."
        )
    conversational = "messages" in kinds.values()
    if "prompt" in columns:
        return PreferenceFormat.CONVERSATIONAL_EXPLICIT_PROMPT if conversational else PreferenceFormat.EXPLICIT_PROMPT
    return PreferenceFormat.CONVERSATIONAL_IMPLICIT_PROMPT if conversational else PreferenceFormat.IMPLICIT_PROMPT


def split_shared_prompt_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen completion, rejected completion) of two dialogues written as text.

    The prompt is the shared beginning cut back to just after the last assistant-turn marker it contains
    ("\\n\\nAssistant:"), so it ends where the model starts to answer and the completions keep every word of
    the replies (even words both replies start with). Without a marker, the shared beginning is cut back to
    the last whitespace, so no word is split between prompt and completion.
    """
    shared = os.path.commonprefix([chosen, rejected])
    cut = -1
    for marker in ASSISTANT_MARKERS:
        at = shared.rfind(marker)
        if at >= 0:
            cut = max(cut, at + len(marker))
    if cut < 0:
        if len(shared) == min(len(chosen), len(rejected)):  # one text is a prefix of the other
            cut = len(shared)
        else:
            cut = max(shared.rfind(" "), shared.rfind("\n"), 0)
    return chosen[:cut], chosen[cut:], rejected[cut:]


def split_shared_prompt_messages(chosen: list, rejected: list) -> tuple[list, list, list]:
    """(prompt, chosen completion, rejected completion) of two conversations given as message lists.

    The prompt is the leading messages both share, cut back so that each completion starts at an assistant
    message (two identical conversations give their last assistant turn as both completions).
    """
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1

    def reply_starts_at(messages, at):
        return at == len(messages) or messages[at].get("role") == "assistant"

    def is_split_point(at):
        both_replies = reply_starts_at(chosen, at) and reply_starts_at(rejected, at)
        return both_replies and (at < len(chosen) or at < len(rejected))

    cut = shared
    while cut > 0 and not is_split_point(cut):
        cut -= 1
    return list(chosen[:cut]), list(chosen[cut:]), list(rejected[cut:])


def explicit_prompt_example(example: dict, fmt: PreferenceFormat) -> dict:
    """The example as {prompt, chosen, rejected}, with the prompt split off when it is implicit."""
    empty = [] if fmt.conversational else ""
    chosen = example.get("chosen") or empty
    rejected = example.get("rejected") or empty
    if not fmt.implicit_prompt:
        return {"prompt": example.get("prompt") or empty, "chosen": chosen, "rejected": rejected}
    split = split_shared_prompt_messages if fmt.conversational else split_shared_prompt_text
    prompt, chosen, rejected = split(chosen, rejected)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def is_empty_completion(completion) -> bool:
    """A completion with nothing to learn from (None, blank, or messages without content, reasoning or tool
    calls)."""
    if completion is None:
        return True
    if isinstance(completion, str):
        return not completion.strip()
    return not any(message_has_payload(m) for m in completion)


class PreferenceTokenizer:
    """Batched tokenisation of preference pairs: prompt, chosen and rejected completion token ids.

    Conversational pairs go through the chat template: the prompt rendered with add_generation_prompt=True,
    each completion the tokens of the whole conversation that follow the prompt's. Text pairs: the prompt
    with the tokenizer's special tokens, each completion without them and with EOS appended.
    """

    def __init__(self, tokenizer, fmt: PreferenceFormat, eos_token_id):
        if fmt is PreferenceFormat.TOKENIZED:
            raise ValueError("Pre-tokenised preference data needs no tokenisation.")
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.eos_token_id = eos_token_id
        self.columns = TOKENIZED_COLUMNS
        self.code = data_code_digest()  # a datasets cache written by other code is not reused

    def __call__(self, batch: dict) -> dict:
        return self.encode(self.explicit_rows(batch))

    def explicit_rows(self, batch: dict) -> list[dict]:
        """The rows of a `Dataset.map` batch as {prompt, chosen, rejected} dicts."""
        size = len(next(iter(batch.values())))
        rows = [{k: batch[k][i] for k in batch} for i in range(size)]
        return [{**explicit_prompt_example(row, self.fmt), "template_kwargs": row_template_kwargs(row)} for row in rows]

    def encode(self, rows: list[dict]) -> dict:
        """Token ids of {prompt, chosen, rejected} rows, as three list columns."""
        if self.fmt.conversational:
            encoded = [self._conversation(row) for row in rows]
            prompt_ids, chosen_ids, rejected_ids = (list(column) for column in zip(*encoded))
        else:
            prompt_ids = self.tokenizer([r["prompt"] for r in rows])["input_ids"]
            chosen_ids = self._completions([r["chosen"] for r in rows])
            rejected_ids = self._completions([r["rejected"] for r in rows])
        return dict(zip(self.columns, (prompt_ids, chosen_ids, rejected_ids)))

    def _completions(self, texts: list[str]) -> list[list[int]]:
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        if self.eos_token_id is None:
            return [list(ids) for ids in encoded]
        return [list(ids) + [self.eos_token_id] for ids in encoded]

    def _conversation(self, row: dict) -> tuple[list[int], list[int], list[int]]:
        kwargs = row.get("template_kwargs") or {}  # the row's `tools` and `chat_template_kwargs`, as in TRL

        def template(messages, **options):
            return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options, **kwargs)

        prompt_ids = list(template(row["prompt"], add_generation_prompt=True)["input_ids"]) if row["prompt"] else []
        prompts, completions = [], []
        for completion in (row["chosen"], row["rejected"]):
            prompt, ids = split_after_prompt(self.tokenizer, row["prompt"], completion, prompt_ids, **kwargs)
            prompts.append(prompt)
            completions.append(ids)
        if prompts[0] != prompts[1]:
            raise ValueError(
                "The chat template renders the prompt differently before the chosen completion than before the "
                "rejected one (it re-renders earlier turns depending on what follows), so the pair has no one prompt "
                "to share. Give both completions the same shape (e.g. both with or both without a final answer), or "
                "use a template that renders earlier turns the same whatever follows.")
        return prompts[0], completions[0], completions[1]
