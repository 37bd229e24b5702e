"""Tool calls in the chat template's conventions: tool schemas, parsing what the policy wrote, running the tools, and
the tokens a tool result adds to the conversation.

- `tool_schemas`: TRL's `tools` are Python callables (sync or async) whose type hints and Google-style docstring
  describe them; transformers turns each into a JSON schema for the chat template. A callable it cannot describe is a
  ValueError naming it, when the trainer is built.
- `ToolCallParser`: a completion -> an assistant message (`content`, and `tool_calls` when it calls tools). The
  tokenizer's own response parser is used when it has one (`response_template` / `response_schema`); otherwise the
  Hermes / Qwen markup, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, when the chat template writes it.
  A call block that does not parse (bad JSON, no name, never closed) makes the completion plain text, as in TRL, and
  is counted as malformed (the trainer logs it) instead of vanishing.
- `call_tools`: each call of one assistant turn against that rollout's tools; an unknown tool or an exception is the
  tool's result `{"error": ...}` (the policy sees it) and counts as a failure (TRL's `tools/failure_frequency`).
- `tool_suffix_ids`: the tokens between the end of the policy's tool-calling turn and the start of its next turn (the
  tool results and the generation prompt), from two renderings of one conversation; the chat template must render a
  conversation's beginning the same whatever follows (checked when the trainer is built).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
from dataclasses import dataclass

from transformers.utils import get_json_schema

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def tool_name(tool) -> str:
    return getattr(tool, "__name__", None) or type(tool).__name__


def tool_schemas(tools: list, keyword: str) -> list[dict]:
    """The JSON schema of each tool (what the chat template shows the policy); a clear error for one that has none."""
    schemas = []
    for tool in tools:
        if not callable(tool):
            raise ValueError(f"`{keyword}`: {tool!r} is not callable; tools are Python functions (or an environment's "
                             "methods) with type hints and a Google-style docstring.")
        try:
            schemas.append(get_json_schema(tool))
        except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(f"`{keyword}`: tool {tool_name(tool)!r} cannot be described to the model ({error}). Give "
                             "it type hints for every argument and a Google-style docstring with an `Args:` entry "
                             "for each.") from error
    return schemas


@dataclass
class ParsedTurn:
    message: dict  # {"role": "assistant", "content": str, "tool_calls": [...] (only when it calls tools)}
    malformed: int = 0  # call blocks that did not parse (the turn is then plain text)


class ToolCallParser:
    """Reads tool calls out of generated token ids, in the conventions of the tokenizer's chat template."""

    def __init__(self, tokenizer, end_ids: tuple[int, ...], keyword: str):
        self.tokenizer = tokenizer
        self.drop_ids = set(end_ids) | ({tokenizer.pad_token_id} if tokenizer.pad_token_id is not None else set())
        template = getattr(tokenizer, "chat_template", None) or ""
        if getattr(tokenizer, "response_template", None) is not None:
            self.kind = "tokenizer"
        elif isinstance(template, str) and TOOL_CALL_OPEN in template:
            self.kind = "hermes"
        elif getattr(tokenizer, "response_schema", None) is not None:  # transformers' older response parser
            self.kind = "tokenizer"
        else:
            raise ValueError(
                f"`{keyword}`: leantune cannot read tool calls written in this tokenizer's chat template: it has no "
                "response parser (`tokenizer.response_template` / `response_schema`) and does not use the "
                f"`{TOOL_CALL_OPEN}` JSON markup (Hermes, Qwen). Set `tokenizer.response_schema` (transformers' "
                "response parsing), or use a model whose chat template calls tools with that markup.")

    def parse(self, ids: list[int], prefix: list[int] | None = None) -> ParsedTurn:
        """`prefix`: the tokens before this turn (what the tokenizer's own parser reads the turn's start from)."""
        if self.kind == "tokenizer":
            return self._parse_with_tokenizer(ids, prefix)
        return self._parse_markup(ids)

    def _text(self, ids: list[int], skip_special_tokens: bool) -> str:
        kept = [i for i in ids if i not in self.drop_ids]
        return self.tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)

    def _parse_with_tokenizer(self, ids: list[int], prefix: list[int] | None) -> ParsedTurn:
        try:
            if getattr(self.tokenizer, "response_template", None) is not None:
                parsed = dict(self.tokenizer.parse_response(list(ids), prefix=list(prefix or [])))
            else:
                parsed = dict(self.tokenizer.parse_response(list(ids)))
        except Exception:
            return ParsedTurn(self._plain(ids), malformed=1)
        calls = [_as_call(call) for call in parsed.get("tool_calls") or []]
        if any(call is None for call in calls):
            return ParsedTurn(self._plain(ids), malformed=sum(call is None for call in calls))
        message = {"role": "assistant", "content": parsed.get("content") or ""}
        if calls:
            message["tool_calls"] = calls
        return ParsedTurn(message)

    def _parse_markup(self, ids: list[int]) -> ParsedTurn:
        text = self._text(ids, skip_special_tokens=False)
        if TOOL_CALL_OPEN not in text:
            return ParsedTurn(self._plain(ids))
        calls, bad, rest, position = [], 0, [], 0
        for match in re.finditer(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|$)", text,
                                 flags=re.DOTALL):
            rest.append(text[position:match.start()])
            position = match.end()
            call = _as_call(_json_or_none(match.group(1))) if match.group(2) else None  # never closed: malformed
            if call is None:
                bad += 1
            else:
                calls.append(call)
        rest.append(text[position:])
        if bad:
            return ParsedTurn(self._plain(ids), malformed=bad)
        return ParsedTurn({"role": "assistant", "content": "".join(rest).strip(), "tool_calls": calls})

    def _plain(self, ids: list[int]) -> dict:
        return {"role": "assistant", "content": self._text(ids, skip_special_tokens=True)}


def _json_or_none(text: str):
    try:
        return json.loads(text.strip())
    except (json.JSONDecodeError, ValueError):
        return None


def _as_call(value) -> dict | None:
    """A call in the chat template's form ({"type": "function", "function": {"name", "arguments": dict}}), or None."""
    if not isinstance(value, dict):
        return None
    function = value.get("function", value)
    if not isinstance(function, dict):
        return None
    name, arguments = function.get("name"), function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _json_or_none(arguments)
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# --- running the tools -------------------------------------------------------------------------------------------


def call_tools(calls: list[dict], tools: dict) -> tuple[list[dict], int]:
    """(the tool messages answering one assistant turn's calls, in order; how many calls failed)."""
    results: list = [None] * len(calls)
    failures = 0
    pending = {}
    for i, call in enumerate(calls):
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        tool = tools.get(name)
        if tool is None:
            results[i], failures = {"error": f"Tool {name} not found."}, failures + 1
            continue
        try:
            result = tool(**arguments)
        except Exception as error:
            results[i], failures = {"error": str(error)}, failures + 1
            continue
        if inspect.isawaitable(result):
            pending[i] = result
        else:
            results[i] = result
    if pending:
        for i, outcome in zip(pending, _await_all(list(pending.values()))):
            if isinstance(outcome, BaseException):
                results[i], failures = {"error": str(outcome)}, failures + 1
            else:
                results[i] = outcome
    messages = [{"role": "tool", "name": call["function"]["name"],
                 "content": result if isinstance(result, list) else str(result)}
                for call, result in zip(calls, results)]
    return messages, failures


def _await_all(awaitables: list) -> list:
    """Async tools of one turn run concurrently, in a private event loop on a worker thread (works inside a loop)."""

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


# --- the tokens of tool results ----------------------------------------------------------------------------------


def _render(tokenizer, messages: list[dict], generation_prompt: bool, template_kwargs: dict) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                        return_dict=False, **template_kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def tool_suffix_ids(tokenizer, tool_messages: list[dict], end_ids: tuple[int, ...], template_kwargs: dict,
                    keyword: str = "tools") -> list[int]:
    """The tokens that follow a policy turn ending in a tool call (at its end-of-turn token): the tool results, then
    the generation prompt of the policy's next turn.

    They are read from the template's own rendering of a conversation that goes on with the results: everything
    after the end-of-turn token that closes the tool-calling turn. That turn's end is the last end-of-turn token
    before the first result's text, found by rendering the conversation a second time with that text changed (the
    first token that differs is where the results' text starts). So a template that renders the calling turn
    differently once results follow (Qwen3 drops its empty <think> block) still gives the results' tokens, and the
    policy's own tokens, which it generated, stay as it generated them."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = _render(tokenizer, conversation, False, template_kwargs)
    after = _render(tokenizer, conversation + tool_messages, True, template_kwargs)
    ends = [i for i, token in enumerate(before) if token in end_ids]
    if ends:  # the policy's turn stops at its end-of-turn token; what the template writes after it belongs to the suffix
        before = before[: ends[-1] + 1]
    if after[: len(before)] == before:
        return after[len(before):]
    turn_end = _calling_turn_end(tokenizer, conversation, tool_messages, after, end_ids, template_kwargs)
    if turn_end is None:
        raise ValueError(f"`{keyword}`: the chat template renders the beginning of a conversation differently once tool "
                         "results follow it, and leantune cannot find where the tool-calling turn ends in that "
                         "rendering (no end-of-turn token of the policy's before the results' text), so tool results "
                         "cannot be appended to generated tokens. Use a chat template that ends each assistant turn "
                         "with an end-of-turn token (set `tokenizer.chat_template`).")
    return after[turn_end + 1:]


def _calling_turn_end(tokenizer, conversation: list[dict], tool_messages: list[dict], after: list[int],
                      end_ids: tuple[int, ...], template_kwargs: dict) -> int | None:
    """The index in `after` of the end-of-turn token that closes the tool-calling turn, or None."""
    content = tool_messages[0].get("content")
    probe_text = "leantune probe 7" if content != "leantune probe 7" else "leantune probe 8"
    probe = [dict(tool_messages[0], content=probe_text), *tool_messages[1:]]
    other = _render(tokenizer, conversation + probe, True, template_kwargs)
    results_start = next((i for i, (a, b) in enumerate(zip(after, other)) if a != b), None)
    if results_start is None:
        return None
    user_end = _render(tokenizer, conversation[:1], True, template_kwargs)
    ends = [i for i in range(results_start) if after[i] in end_ids]
    # the end must lie after the generation prompt of the calling turn, not close the user's turn before it
    common = next((i for i, (a, b) in enumerate(zip(user_end, after)) if a != b), min(len(user_end), len(after)))
    return ends[-1] if ends and ends[-1] >= common else None


def check_tool_template(tokenizer, end_ids: tuple[int, ...], template_kwargs: dict, keyword: str) -> None:
    """The chat template must show the policy its tool calls and the tools' results, and leantune must find the
    results' tokens in its rendering (tool_suffix_ids); checked once, when the trainer is built."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"`{keyword}` needs a chat template that renders tool calls; the tokenizer has none (set "
                         "`tokenizer.chat_template` or `chat_template_path=`).")
    name, key, value, content = "leantune_tool_x1", "leantune_key_x2", "leantune_value_x3", "leantune_result_x4"
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
                {"role": "tool", "name": name, "content": content}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    except Exception as error:
        raise ValueError(f"`{keyword}`: the tokenizer's chat template cannot render a tool-calling conversation "
                         f"(user -> assistant with tool_calls -> tool): {error}") from error
    missing = [what for what, sentinel in (("the call's name", name), ("its arguments", value),
                                           ("the tool's result", content)) if sentinel not in text]
    if missing:
        raise ValueError(f"`{keyword}`: the tokenizer's chat template drops {', '.join(missing)} when it renders a "
                         "tool-calling conversation, so the policy would never see them. Use a chat template that "
                         "supports tools.")
    tool_suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": content}], end_ids, template_kwargs, keyword)
