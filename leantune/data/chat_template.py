"""Chat-template checks and loading, shared by every trainer that reads conversations."""

from __future__ import annotations

import json
import os
import re

from transformers import AutoTokenizer

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and bool(GENERATION_BLOCK.search(template))


def require_chat_template(tokenizer, purpose: str = "conversational data") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{purpose} needs a chat template, and the tokenizer ({type(tokenizer).__name__}, "
            f"{getattr(tokenizer, 'name_or_path', '?')!r}) has none. Pass `chat_template_path=` (a .jinja file or a "
            "tokenizer folder that has one), or set `tokenizer.chat_template`."
        )


def load_chat_template(tokenizer, path: str) -> None:
    """Set tokenizer.chat_template from a .jinja file or from a tokenizer folder."""
    if os.path.isdir(path):
        template = AutoTokenizer.from_pretrained(path).chat_template
        if not template:
            raise ValueError(f"The tokenizer in {path!r} has no chat template.")
    else:
        with open(path, encoding="utf-8") as handle:
            template = handle.read()
    tokenizer.chat_template = template


def row_template_kwargs(row: dict) -> dict:
    """A row's own chat-template arguments, read as TRL reads them: a `tools` column (a list of tool schemas, or its
    JSON text) and a `chat_template_kwargs` column (a dict, e.g. {"enable_thinking": False})."""
    kwargs = {}
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(f"Column 'tools' holds text that is not JSON ({error}); give the tool schemas as a "
                             "list, or as their JSON text.") from error
    if tools:
        kwargs["tools"] = tools
    extra = row.get("chat_template_kwargs")
    if extra:
        kwargs.update({key: value for key, value in dict(extra).items() if value is not None})
    return kwargs
