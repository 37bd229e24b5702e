"""assistant_only_loss with chat templates that have no {% generation %} markers: the assistant tokens come from the
template's own prefixes, and must equal the marker-based masks of the same template with markers added by hand."""

from __future__ import annotations

import pytest
from datasets import Dataset

from leantune import SFTConfig
from leantune.data.sft_preparation import prepare_sft_dataset
from leantune.data.sft_tokenization import assistant_masks_from_prefixes

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Green, or perhaps\nteal."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact."}, {"role": "assistant", "content": "Water boils at 100 C."},
     {"role": "user", "content": "Thanks"}],  # ends with a user turn: nothing after the last assistant turn
]

# A Qwen-like ChatML template (default system prompt, generation prompt "<|im_start|>assistant\n"). GENERATION is
# where the hand-placed markers go: around what the assistant produces, its content and end of turn.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "GENERATION_START{{ message['content'] + '<|im_end|>\n' }}GENERATION_END"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml(marked: bool) -> str:
    start, end = ("{% generation %}", "{% endgeneration %}") if marked else ("", "")
    return CHATML.replace("GENERATION_START", start).replace("GENERATION_END", end)


def mistral(tokenizer, marked: bool) -> str:
    template = tokenizer.chat_template
    assert "{% generation %}" in template  # the shared tokenizer's template is the hand-marked one
    return template if marked else template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def with_chatml(tokenizer, marked: bool):
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = chatml(marked)
    return tokenizer


TEMPLATES = {
    "mistral": lambda tok, marked: setattr(tok, "chat_template", mistral(tok, marked)) or tok,
    "chatml": with_chatml,
}


def marker_masks(tokenizer, messages) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    return list(encoded["assistant_masks"])


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_prefix_masks_equal_hand_marked_masks(family, tokenizer_dir):
    from transformers import AutoTokenizer

    marked = TEMPLATES[family](AutoTokenizer.from_pretrained(str(tokenizer_dir)), True)
    plain = TEMPLATES[family](AutoTokenizer.from_pretrained(str(tokenizer_dir)), False)
    for messages in CONVERSATIONS:
        ids = list(plain.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        assert ids == list(marked.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        expected = marker_masks(marked, messages)
        assert sum(expected) > 0
        # Integer masks: exact equality, token by token.
        assert assistant_masks_from_prefixes(plain, messages, ids) == expected
        # What the masked tokens spell: every assistant reply, nothing of the prompts.
        learned = plain.decode([t for t, m in zip(ids, expected) if m])
        for message in messages:
            assert (message["content"] in learned) == (message["role"] == "assistant")


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_sft_preparation_uses_prefix_masks_without_markers(family, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    data = Dataset.from_list([{"messages": m} for m in CONVERSATIONS])
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, assistant_only_loss=True, max_length=None)
    rows = {}
    for marked in (True, False):
        tok = TEMPLATES[family](AutoTokenizer.from_pretrained(str(tokenizer_dir)), marked)
        prepared, _ = prepare_sft_dataset(data, tok, args)
        rows[marked] = prepared.to_list()
    assert [r["input_ids"] for r in rows[False]] == [r["input_ids"] for r in rows[True]]
    # the masks become labels (TRL's prepared form): the same targets either way, and some of each kind
    assert [r["labels"] for r in rows[False]] == [r["labels"] for r in rows[True]]
    labels = [label for r in rows[True] for label in r["labels"]]
    assert -100 in labels and any(label != -100 for label in labels)


# A template that renders an earlier assistant turn differently once later turns follow (as Qwen3's drops the
# reasoning of earlier turns): the conversation up to a turn is not a prefix of the whole conversation.
DROPS_EARLIER_REASONING = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' and not loop.last %}{{ message['content'].split('</think>')[-1] }}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# A generation prompt that is not how the template starts an assistant turn (an empty think block).
GENERATION_PROMPT_DIFFERS = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|><think></think>' }}{% endif %}"
)


# A template that shows an earlier assistant turn's text nowhere: no rendering locates that turn.
HIDES_EARLIER_TURNS = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] != 'assistant' or loop.last %}{{ message['content'] }}{% endif %}{{ '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
REASONING_TURNS = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"},
                   {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>add</think>6"}]


@pytest.mark.parametrize("template, trained", [
    (DROPS_EARLIER_REASONING, ["4<|end|>", "<think>add</think>6<|end|>"]),
    (GENERATION_PROMPT_DIFFERS, ["<think>add</think>4<|end|>", "<think>add</think>6<|end|>"])])
def test_inconsistent_prefixes_are_located_in_the_whole_rendering(template, trained, tokenizer, tmp_path):
    """The prefix method cannot locate these turns; the whole conversation's own rendering does
    (data/template_spans.py): each turn's tokens as that rendering shows them, from after the generation prompt
    (or its longest leading part present) through the turn's end-of-turn token."""
    import itertools

    tokenizer.chat_template = template
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, assistant_only_loss=True)
    prepared, _ = prepare_sft_dataset(Dataset.from_list([{"messages": REASONING_TURNS}]), tokenizer, args)
    row = prepared[0]
    runs = itertools.groupby(zip(row["input_ids"], row["labels"]), key=lambda pair: pair[1] != -100)
    assert [tokenizer.decode([token for token, _ in run]) for kept, run in runs if kept] == trained


def test_a_turn_no_rendering_locates_is_a_clear_error(tokenizer, tmp_path):
    tokenizer.chat_template = HIDES_EARLIER_TURNS
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, assistant_only_loss=True)
    with pytest.raises(ValueError) as error:
        prepare_sft_dataset(Dataset.from_list([{"messages": REASONING_TURNS}]), tokenizer, args)
    message = str(error.value)
    assert "not a prefix of the whole conversation" in message and "assistant message 1" in message
    assert "nor does the whole conversation's rendering show where the turn is" in message
    assert "{% generation %}" in message and "chat_template_path" in message
