"""Where a message lies in a chat template's rendering of a whole conversation, read from that rendering itself.

The prefix method (render the conversation up to a message, then through it, and subtract) needs a template that
renders a conversation's beginning the same whatever follows. Some do not: harmony (gpt-oss) drops an earlier
assistant turn's analysis channel once a final answer follows, Qwen3 drops an earlier turn's <think> block, and both
render a tool-calling turn differently once its results follow. For those, the tokens trained are the whole
conversation's own, and a message is located in them by rendering the conversation a second time with only that
message's text changed: the first token that differs is where its text starts, the last one where it ends. The
message's tokens then run from the end of the generation prompt before its text (the cue the model is given, never a
target, as in the prefix method) through the first special token after its text (its end-of-turn token, which the
model must learn to emit).
"""

from __future__ import annotations

import json
import logging

PROBE = "leantune probe"


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **template_kwargs) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            add_generation_prompt=add_generation_prompt, **template_kwargs)
    return list(encoded["input_ids"])


def common_prefix_length(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _probe(message: dict) -> dict:
    """The message with every text it carries changed: content, reasoning, its calls' arguments (not the tools' names:
    harmony names the tool's answer after them, so the change would reach the next message)."""
    probe = dict(message)
    for key in ("content", "thinking", "reasoning_content"):
        if isinstance(probe.get(key), str) and probe[key]:
            probe[key] = PROBE if probe[key] != PROBE else PROBE + " 2"
    if probe.get("tool_calls"):
        def changed(function):
            arguments = {"leantune": "probe"} if function.get("arguments") != {"leantune": "probe"} else {"x": 1}
            return {**function, "arguments": arguments if not isinstance(function.get("arguments"), str)
                    else json.dumps(arguments)}

        probe["tool_calls"] = [{**call, "function": changed(call.get("function") or {})}
                               for call in probe["tool_calls"]]
    return probe


def message_span(tokenizer, messages: list[dict], index: int, ids: list[int], last: int | None = None,
                 **template_kwargs) -> tuple[int, int] | None:
    """(start, end) of messages[index]'s tokens in `ids`, the rendering of `messages`; messages[index:last] are located
    as one block (last=None: through the end of the conversation). None when the template's rendering does not show
    where they are (their text changes nothing, or the tokens before them are not a generation prompt)."""
    last = len(messages) if last is None else last
    probed = messages[:index] + [_probe(m) for m in messages[index:last]] + messages[last:]
    other = render_ids(tokenizer, probed, **template_kwargs)
    text_start = common_prefix_length(ids, other)
    if text_start == len(ids) == len(other):
        return None
    text_end = len(ids) - common_prefix_length(ids[::-1], other[::-1])
    text_end = max(text_end, text_start)
    start = _after_generation_prompt(tokenizer, messages, index, ids, text_start, template_kwargs)
    if start is None:
        return None
    if last == len(messages):
        return start, len(ids)
    closing = _closing_tokens(tokenizer, messages[:last], template_kwargs)
    if closing and ids[text_end:text_end + len(closing)] == closing:  # the turn closes as it does when it is last
        return start, text_end + len(closing)
    special = set(tokenizer.all_special_ids)
    end = next((i + 1 for i in range(text_end, len(ids)) if ids[i] in special), text_end)
    return start, end


def _closing_tokens(tokenizer, messages: list[dict], template_kwargs: dict) -> list[int]:
    """What the template writes after the last message's text when it ends the conversation (e.g. `<|im_end|>\n`)."""
    whole = render_ids(tokenizer, messages, **template_kwargs)
    probed = render_ids(tokenizer, messages[:-1] + [_probe(messages[-1])], **template_kwargs)
    same = common_prefix_length(whole[::-1], probed[::-1])
    return whole[len(whole) - same:] if same < len(whole) else []


def _after_generation_prompt(tokenizer, messages: list[dict], index: int, ids: list[int], text_start: int,
                             template_kwargs: dict) -> int | None:
    """Where the model's own tokens start: just after the last occurrence, before `text_start`, of the generation
    prompt the template writes after `before` (or of its longest leading part that occurs: DeepSeek-R1's opens a
    <think> its rendered turns never show)."""
    before = messages[:index]
    if not before:
        return 0
    plain = render_ids(tokenizer, before, **template_kwargs)
    cued = render_ids(tokenizer, before, add_generation_prompt=True, **template_kwargs)
    cue = cued[common_prefix_length(plain, cued):]
    # only between the previous message's text and this one's: an earlier turn's header is not this turn's
    previous = before[:-1] + [_probe(before[-1])] + messages[len(before):]
    after_previous = len(ids) - common_prefix_length(ids[::-1], render_ids(tokenizer, previous,
                                                                           **template_kwargs)[::-1])
    floor = after_previous if after_previous <= text_start else 0
    for size in range(len(cue), 0, -1):
        part = cue[:size]
        for at in range(text_start - size, floor - 1, -1):
            if ids[at:at + size] == part:
                return at + size
    return None


_announced: set[str] = set()


def announce_located(what: str) -> None:
    """Log once per process and case that the template's own rendering located a completion or turn."""
    if what not in _announced:
        _announced.add(what)
        logging.getLogger("leantune.data").info(
            "The chat template renders a conversation's beginning differently once later messages follow, so the "
            "prefix method cannot locate %s; leantune locates it in the whole conversation's own rendering (the tokens "
            "trained are that rendering's; data/template_spans.py).", what)


def split_after_prompt(tokenizer, prompt: list[dict], completion: list[dict], prompt_ids: list[int],
                       **template_kwargs) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of prompt + completion rendered as one conversation. With a template whose prompt
    alone (with its generation prompt) starts the whole rendering, they are that prompt and the rest; otherwise the
    whole rendering is cut where the completion's tokens start in it (message_span), so the prompt's ids are how the
    template renders it before this completion."""
    full = render_ids(tokenizer, list(prompt) + list(completion), **template_kwargs)
    if full[: len(prompt_ids)] == prompt_ids:
        return prompt_ids, full[len(prompt_ids):]
    span = message_span(tokenizer, list(prompt) + list(completion), len(prompt), full, **template_kwargs)
    if span is None:
        raise ValueError(
            "The chat template renders the prompt differently alone (with add_generation_prompt=True) than as the "
            "start of the whole conversation, and the whole conversation's rendering does not show where the "
            "completion starts (its text changes no token, or no generation prompt precedes it), so the completion "
            "cannot be located. Use a template whose generation prompt is a prefix of the rendered assistant turn.")
    announce_located("where the completion starts")
    return full[: span[0]], full[span[0]:]
