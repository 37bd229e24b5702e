"""assistant_only_loss with chat templates whose prefixes cannot locate assistant turns (Qwen3, DeepSeek-R1-Distill,
Phi-3, Phi-3.5):
leantune recognises the template exactly and takes the mask from its own marked template (data/training_templates.py),
which must render every conversation to the same text and token ids as the original.

The original templates in tests/fixtures/chat_templates are the model vendors' own (Qwen/Qwen3-*, deepseek-ai/
DeepSeek-R1-Distill-*, microsoft/Phi-3-mini-*, microsoft/Phi-3.5-mini-instruct), byte for byte as shipped; they are test input only. The tokenizer is the shared 32k one
with the family's special tokens added, and the model a tiny Qwen3 built from a config (random weights)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from datasets import Dataset

from leantune import SFTConfig, SFTTrainer
from leantune.data.sft_preparation import prepare_sft_dataset
from leantune.data.training_templates import MASK_TEMPLATES, mask_template_for

from ..fixtures.paths import CHAT_TEMPLATES
from ..fixtures.tokenizers import load_tokenizer

ORIGINALS = CHAT_TEMPLATES
FAMILIES = {
    "Qwen3": ("qwen3.jinja", ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                              "<tool_response>", "</tool_response>"]),
    "DeepSeek-R1-Distill": ("deepseek_r1_distill.jinja", [
        "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
        "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]),
    "Phi-3": ("phi3.jinja", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "Phi-3.5": ("phi3_5.jinja", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
}
TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiply two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
COMMON = dict(report_to=[], save_strategy="no", use_cpu=True, per_device_train_batch_size=4, seed=0, logging_steps=1)


def original(family: str) -> str:
    return (ORIGINALS / FAMILIES[family][0]).read_text(encoding="utf-8")


def family_tokenizer(tokenizer_dir, family: str):

    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": FAMILIES[family][1]})
    tokenizer.chat_template = original(family)
    return tokenizer


@pytest.fixture
def qwen3_tokenizer(tokenizer_dir):
    tokenizer = family_tokenizer(tokenizer_dir, "Qwen3")
    tokenizer.eos_token = "<|im_end|>"  # as Qwen3's tokenizer
    return tokenizer


def tiny_qwen3(vocab_size: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).float()


def conversations():
    """Conversations over everything the templates read: system message or not, reasoning as a field, inline
    `<think>` or none, tool calls (dict or JSON-text arguments, several per turn, none with no content), runs of
    tool results, wrapped tool responses as user turns, and endings on each role."""
    def user(text):
        return {"role": "user", "content": text}

    def assistant(i, reasoning, calls):
        turn = {"role": "assistant", "content": f"Answer {i}."}
        if reasoning == "field":
            turn["reasoning_content"] = f"\nReasoning {i}.\n"
        elif reasoning == "empty":
            turn["reasoning_content"] = ""
        elif reasoning == "inline":
            turn["content"] = f"<think>\nInline reasoning {i}.\n</think>\n\nAnswer {i}."
        if calls:
            arguments = {"a": i, "b": 3} if calls == "dict" else '{"a": 2, "b": 3}'
            call = {"type": "function", "function": {"name": "multiply", "arguments": arguments}}
            turn["tool_calls"] = [call, call] if calls == "two" else [call]
            if calls == "bare":
                turn["content"] = None
        return turn

    for system, reasoning, calls, ending in itertools.product(
            (False, True), ("none", "field", "empty", "inline"), (None, "dict", "text", "two", "bare"),
            ("assistant", "user", "tool_response", "tool")):
        messages = [{"role": "system", "content": "Be brief."}] if system else []
        messages += [user("First question?"), assistant(1, reasoning, calls)]
        if calls:
            messages += [{"role": "tool", "content": "6"}, {"role": "tool", "content": "7"}, assistant(2, reasoning, None)]
        messages += [user("Second question?"), assistant(3, reasoning, calls)]
        if ending == "user":
            messages.append(user("Third question?"))
        elif ending == "tool_response":
            messages += [user("<tool_response>\n42\n</tool_response>"), assistant(4, reasoning, None)]
        elif ending == "tool" and calls:
            messages.append({"role": "tool", "content": "8"})
        yield messages
    yield [user("Only a question.")]
    yield [{"role": "system", "content": "S."}, user("a"), {"role": "system", "content": "Later."},
           assistant(1, "field", None)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mask_template_renders_exactly_the_original(family, tokenizer_dir):
    tokenizer = family_tokenizer(tokenizer_dir, family)
    known = mask_template_for(tokenizer.chat_template)
    assert known is not None and known.family == family
    compared = 0
    for messages, tools, generation_prompt, thinking in itertools.product(
            conversations(), (None, TOOLS), (False, True), ({}, {"enable_thinking": False}, {"enable_thinking": True})):
        settings = dict(tools=tools, add_generation_prompt=generation_prompt, **thinking)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **settings)
        except Exception:  # the original refuses it (DeepSeek's template concatenates arguments as text)
            continue
        assert tokenizer.apply_chat_template(messages, tokenize=False, chat_template=known.text, **settings) == text, (
            messages, settings)
        marked = tokenizer.apply_chat_template(messages, chat_template=known.text, return_dict=True,
                                               return_assistant_tokens_mask=True, **settings)
        ids = tokenizer.apply_chat_template(messages, return_dict=True, **settings)["input_ids"]
        assert list(marked["input_ids"]) == list(ids)
        assert any(marked["assistant_masks"]) == any(m["role"] == "assistant" for m in messages)
        compared += 1
    assert compared > 1000


def test_recognition_is_exact(tokenizer_dir):
    text = original("Qwen3")
    qwen3 = next(known for known in MASK_TEMPLATES if known.family == "Qwen3")
    assert mask_template_for(text) is qwen3
    assert mask_template_for(text.replace("\n", "\r\n") + "\n") is qwen3  # line endings, surrounding whitespace
    assert mask_template_for(text.replace("call one or more", "call one or two")) is None  # any other change
    assert mask_template_for(qwen3.text) is None  # a template with markers is used as it is
    assert mask_template_for(None) is None
    # An unknown template (here Qwen3's, changed without changing what it renders) is not recognised; its turns are
    # located in the whole conversation's rendering (data/template_spans.py), and the targets are those leantune's
    # marked Qwen3 template gives, per token.
    variant = text.replace("'<|im_start|>' + message.role + '\\n' + content }}",
                           "'<|im_start|>' + message.role + '\\n' + content + '' }}")
    assert variant != text and mask_template_for(variant) is None
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "<think>\nR.\n</think>\n\nA."},
                {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "<think>\nS.\n</think>\n\nB."}]
    args = SFTConfig(output_dir="unused", report_to=[], use_cpu=True, assistant_only_loss=True)
    labels = {}
    for name, template in (("known", text), ("unknown", variant)):
        tokenizer = family_tokenizer(tokenizer_dir, "Qwen3")
        tokenizer.chat_template = template
        prepared, _ = prepare_sft_dataset(Dataset.from_list([{"messages": messages}]), tokenizer, args)
        labels[name] = prepared[0]["labels"]
    assert labels["unknown"] == labels["known"] and any(label != -100 for label in labels["known"])


def trl_scenario(rows, n: int) -> Dataset:
    """TRL's test_train_assistant_only_and_completion_only: prompt-completion conversations whose completion goes on
    with the prompt's user turn again and the first assistant turn again."""
    data = []
    for row in rows[:n]:
        prompt = [{"role": "user", "content": row["question"]}]
        completion = [{"role": "assistant", "content": row["answer"]}]
        data.append({"prompt": prompt, "completion": completion + [prompt[0], completion[0]]})
    return Dataset.from_list(data)


def expected_targets(tokenizer, spans: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """The rendered text built by hand, piece by piece, with whether each piece is the assistant's; a token is a
    target exactly when it lies in an assistant piece."""
    text, marked, at = "", [], 0
    for piece, is_assistant in spans:
        if is_assistant:
            marked.append((at, at + len(piece)))
        text += piece
        at += len(piece)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [any(start <= a and b <= end for start, end in marked) for a, b in encoded["offset_mapping"]]
    straddling = [any(a < start < b or a < end < b for start, end in marked) for a, b in encoded["offset_mapping"]]
    assert not any(straddling)  # every piece boundary is a token boundary
    return encoded["input_ids"], inside


def test_mask_marks_the_assistant_tokens_of_the_completion(qwen3_tokenizer, gsm8k_rows, tmp_path):
    data = trl_scenario(gsm8k_rows, 3)
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, completion_only_loss=True, max_length=None,
                     **COMMON)
    prepared, _ = prepare_sft_dataset(data, qwen3_tokenizer, args)
    for row, source in zip(prepared, data):
        question, answer = source["prompt"][0]["content"], source["completion"][0]["content"]
        ids, targets = expected_targets(qwen3_tokenizer, [
            (f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", False),
            # before the last user query: Qwen3 renders the turn without its (empty) reasoning block
            (f"{answer}<|im_end|>\n", True),
            (f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", False),  # the completion's user turn
            (f"<think>\n\n</think>\n\n{answer}<|im_end|>\n", True),  # the last turn: the model writes its block
        ])
        assert row["input_ids"] == ids
        assert [label != -100 for label in row["labels"]] == targets
        assert [label for label in row["labels"] if label != -100] == [t for t, m in zip(ids, targets) if m]


def test_earlier_reasoning_and_prefilled_thinking(qwen3_tokenizer, tmp_path):
    """Reasoning of a turn before the last query is not rendered, so not a target; the last turn's is. With
    enable_thinking=False the empty block is the prompt's prefill, not the assistant's."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4.", "reasoning_content": "Add."},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n6."}]
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=None, **COMMON)
    head = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
             False), ("4.<|im_end|>\n", True), ("<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n", False)]
    thinking = Dataset.from_list([{"messages": messages}])
    prepared, _ = prepare_sft_dataset(thinking, qwen3_tokenizer, args)
    ids, targets = expected_targets(qwen3_tokenizer, head + [("<think>\nAdd.\n</think>\n\n6.<|im_end|>\n", True)])
    assert prepared[0]["input_ids"] == ids and [label != -100 for label in prepared[0]["labels"]] == targets

    messages[-1] = {"role": "assistant", "content": "6."}
    prefilled = Dataset.from_list([{"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}])
    prepared, _ = prepare_sft_dataset(prefilled, qwen3_tokenizer, args)
    ids, targets = expected_targets(qwen3_tokenizer, head + [("<think>\n\n</think>\n\n", False),
                                                             ("6.<|im_end|>\n", True)])
    assert prepared[0]["input_ids"] == ids and [label != -100 for label in prepared[0]["labels"]] == targets


def test_deepseek_r1_distill_targets_what_the_turn_renders(tokenizer_dir, tmp_path):
    """The original renders an assistant turn after its cue without its reasoning (its generation prompt opens a
    <think> block the turn never shows): the targets are the rendered answer and the end-of-sentence token."""
    tokenizer = family_tokenizer(tokenizer_dir, "DeepSeek-R1-Distill")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4."},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6."}]
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=None, **COMMON)
    prepared, _ = prepare_sft_dataset(Dataset.from_list([{"messages": messages}]), tokenizer, args)
    ids, targets = expected_targets(tokenizer, [
        (f"{tokenizer.bos_token}Be brief.<｜User｜>2+2?<｜Assistant｜>", False), ("\n\n4.<｜end▁of▁sentence｜>", True),
        ("<｜User｜>3+3?<｜Assistant｜>", False), ("6.<｜end▁of▁sentence｜>", True)])
    assert prepared[0]["input_ids"] == ids and [label != -100 for label in prepared[0]["labels"]] == targets


@pytest.mark.parametrize("family", ["Phi-3", "Phi-3.5"])
def test_phi3_targets_turns_not_the_closing_end_of_text(family, tokenizer_dir, tmp_path):
    tokenizer = family_tokenizer(tokenizer_dir, family)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4."}, {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6."}]
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=None, **COMMON)
    prepared, _ = prepare_sft_dataset(Dataset.from_list([{"messages": messages}]), tokenizer, args)
    ids, targets = expected_targets(tokenizer, [
        ("<|system|>\nBe brief.<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n", False), ("4.<|end|>\n", True),
        ("<|user|>\n3+3?<|end|>\n<|assistant|>\n", False), ("6.<|end|>\n", True), (tokenizer.eos_token, False)])
    assert prepared[0]["input_ids"] == ids and [label != -100 for label in prepared[0]["labels"]] == targets


def assert_every_parameter_changed(before: dict, model) -> None:
    for name, value in before.items():
        assert not torch.equal(value, model.get_parameter(name)), f"{name} did not change"


def test_trl_assistant_only_and_completion_only_trains(qwen3_tokenizer, gsm8k_rows, tmp_path, caplog):
    model = tiny_qwen3(len(qwen3_tokenizer))
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, completion_only_loss=True, max_length=256,
                     max_steps=2, **COMMON)
    with caplog.at_level(logging.INFO, logger="leantune.data"):
        trainer = SFTTrainer(model=model, args=args, train_dataset=trl_scenario(gsm8k_rows, 8),
                             processing_class=qwen3_tokenizer)
    announced = [r.getMessage() for r in caplog.records if "leantune/data/templates/qwen3.jinja" in r.getMessage()]
    assert len(announced) == 1 and "Qwen3" in announced[0]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_every_parameter_changed(before, trainer.model)


def test_assistant_only_on_a_stream_trains(qwen3_tokenizer, gsm8k_rows, tmp_path):
    rows = [{"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]},
                          {"role": "user", "content": "And again?"}, {"role": "assistant", "content": r["answer"]}]}
            for r in gsm8k_rows[:8]]
    stream = Dataset.from_list(rows).to_iterable_dataset()
    model = tiny_qwen3(len(qwen3_tokenizer))
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=256, max_steps=2, **COMMON)
    trainer = SFTTrainer(model=model, args=args, train_dataset=stream, processing_class=qwen3_tokenizer)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_every_parameter_changed(before, trainer.model)
