"""Chat data TRL trains that the prefix method cannot split: harmony (gpt-oss) conversations, whose template drops an
earlier assistant turn's analysis channel once a final answer follows and names a tool's answer after the call, and
messages that only call tools. leantune locates the trained tokens in the whole conversation's own rendering
(data/template_spans.py); each test names, per token, what is trained.

tests/fixtures/chat_templates/gpt_oss.jinja is the gpt-oss models' own chat template (openai/gpt-oss-20b, Apache-2.0),
test input only. The tokenizer is the shared 32k one with harmony's special tokens added."""

from __future__ import annotations

import itertools
import re

import pytest
from datasets import Dataset

from leantune import DPOConfig, KTOConfig, RewardConfig, SFTConfig
from leantune.data.kto_preparation import prepare_kto_dataset
from leantune.data.preference_preparation import prepare_preference_dataset
from leantune.data.sft_preparation import prepare_sft_dataset

from ..fixtures.paths import CHAT_TEMPLATES

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

HARMONY = (CHAT_TEMPLATES / "gpt_oss.jinja").read_text()
IGNORE = -100
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "thinking": "Need the tool.", "tool_calls": CALL},
              {"role": "tool", "name": "get_weather", "content": "22 C"},
              {"role": "assistant", "thinking": "Got it.", "content": "It is 22 C."}]
FINAL = "<|channel|>analysis<|message|>Got it.<|end|><|start|>assistant<|channel|>final<|message|>It is 22 C.<|return|>"


@pytest.fixture
def harmony(tokenizer):
    tokenizer.chat_template = HARMONY
    tokenizer.add_special_tokens({"additional_special_tokens": sorted(set(re.findall(r"<\|[a-z_]+\|>", HARMONY)))})
    return tokenizer


def args(config=SFTConfig, **kwargs):
    return config(output_dir="/tmp/leantune-test-template-spans", report_to=[], **kwargs)


def trained_runs(tokenizer, row) -> list[str]:
    """The trained tokens of a prepared SFT row, one decoded text per contiguous run."""
    ids, labels = row["input_ids"], row["labels"]
    runs = itertools.groupby(zip(ids, labels), key=lambda pair: pair[1] != IGNORE)
    return [tokenizer.decode([token for token, _ in run]) for trained, run in runs if trained]


def test_harmony_assistant_turns_are_located_in_the_whole_rendering(harmony):
    """The first turn's analysis is not in the rendering once a final answer follows, so the conversation up to it is
    not a prefix of the whole (the prefix method refuses it). Trained: each turn as the whole rendering shows it, from
    after the generation prompt `<|start|>assistant` through its end-of-turn token."""
    messages = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "thinking": "Greet back.", "content": "Hello."},
                {"role": "user", "content": "Better than ugly?"},
                {"role": "assistant", "thinking": "Beauty.", "content": "Beautiful."}]
    prepared, _ = prepare_sft_dataset(Dataset.from_list([{"messages": messages}]), harmony,
                                      args(assistant_only_loss=True))
    assert trained_runs(harmony, prepared[0]) == [
        "<|channel|>final<|message|>Hello.<|end|>",
        "<|channel|>analysis<|message|>Beauty.<|end|><|start|>assistant<|channel|>final<|message|>Beautiful.<|return|>"]


def test_harmony_tool_calling_turns(harmony):
    """A tool-calling turn (its recipient ` to=functions.get_weather` is the model's to write) and the final turn are
    trained; the tool's answer and the user's turn are not."""
    prepared, _ = prepare_sft_dataset(Dataset.from_list([{"messages": TOOL_TURNS, "tools": TOOLS}]), harmony,
                                      args(assistant_only_loss=True))
    assert trained_runs(harmony, prepared[0]) == [
        'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>', FINAL]


def test_harmony_completion_after_a_tool_result(harmony):
    """The prompt (up to the tool's answer) renders its calling turn with its analysis when alone and without it
    before a final answer; the completion is located in the whole rendering, and its prompt is that rendering's."""
    row = {"prompt": TOOL_TURNS[:3], "completion": TOOL_TURNS[3:], "tools": TOOLS}
    prepared, _ = prepare_sft_dataset(Dataset.from_list([row]), harmony, args())
    assert trained_runs(harmony, prepared[0]) == [FINAL]
    rejected = [{"role": "assistant", "content": "No idea."}]
    pairs, _ = prepare_preference_dataset(
        Dataset.from_list([{"prompt": TOOL_TURNS[:3], "chosen": TOOL_TURNS[3:], "rejected": rejected}]), harmony,
        args(DPOConfig))
    prompt = harmony.decode(pairs[0]["prompt_ids"])
    assert prompt.endswith('<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"22 C"'
                           "<|end|><|start|>assistant") and "Need the tool." not in prompt
    assert harmony.decode(pairs[0]["chosen_ids"]) == FINAL
    assert harmony.decode(pairs[0]["rejected_ids"]) == "<|channel|>final<|message|>No idea.<|return|>"


@pytest.mark.parametrize("config", [DPOConfig, RewardConfig, KTOConfig])
def test_completions_that_only_call_a_tool_are_kept(harmony, config):
    """An assistant message with `tool_calls` and no `content` is a message (TRL's toolcall data), and a completion
    that only calls a tool is not empty: every pair is kept, its completion tokens are the call."""
    other = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
    rows = [{"prompt": TOOL_TURNS[:1], "chosen": [{"role": "assistant", "tool_calls": CALL}],
             "rejected": [{"role": "assistant", "tool_calls": other}], "tools": TOOLS}] * 2
    if config is KTOConfig:
        prepared, report = prepare_kto_dataset(Dataset.from_list(rows), harmony, args(config))
        assert report.num_empty_dropped == 0 and len(prepared) == 4
        completions = [harmony.decode(ids) for ids in prepared["completion_ids"]]
    else:
        prepared, report = prepare_preference_dataset(Dataset.from_list(rows), harmony, args(config))
        assert report.num_empty_dropped == 0 and len(prepared) == 2
        completions = [harmony.decode(prepared[0]["chosen_ids"]), harmony.decode(prepared[0]["rejected_ids"])]
    assert sum('{"city": "Paris"}<|call|>' in text for text in completions) == len(completions) // 2
    assert sum('{"city": "Rome"}<|call|>' in text for text in completions) == len(completions) // 2
