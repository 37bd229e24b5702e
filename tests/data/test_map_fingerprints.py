"""The tokenizer dataset maps hold (data/map_fingerprints.py): it tokenizes as the user's does, and a map's
fingerprint still follows every change that can change tokenization, so a cached map is reused exactly when valid."""

from __future__ import annotations

import pytest
from datasets.fingerprint import Hasher
from transformers import AutoTokenizer

from leantune.data.map_fingerprints import tokenizer_for_maps

from ..fixtures.paths import TOKENIZER_DIR

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds


@pytest.fixture(scope="module")
def loaded():
    """Loaded from disk as a user's script loads it: with its construction-time copies (the session fixture's
    tokenizer has them removed)."""
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def test_the_lean_copy_tokenizes_as_the_tokenizer_and_leaves_it_whole(loaded, gsm8k_rows):
    lean = tokenizer_for_maps(loaded)
    assert "_vocab" in vars(loaded) and "_vocab" not in vars(lean) and lean._tokenizer is loaded._tokenizer
    texts = [row["question"] + " " + row["answer"] for row in gsm8k_rows[:50]]
    assert lean(texts)["input_ids"] == loaded(texts)["input_ids"]
    chat = [{"role": "user", "content": texts[0]}, {"role": "assistant", "content": texts[1]}]
    assert lean.apply_chat_template(chat, tokenize=False) == loaded.apply_chat_template(chat, tokenize=False)
    assert tokenizer_for_maps(lean) is lean  # nothing left to drop


def test_the_fingerprint_is_stable_and_follows_the_vocabulary_and_template(loaded):
    fingerprint = Hasher.hash(tokenizer_for_maps(loaded))
    assert Hasher.hash(tokenizer_for_maps(AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)))) == fingerprint
    added = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    added.add_tokens(["<tool_call>"])
    templated = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    templated.chat_template = "{{ messages[0]['content'] }}"
    assert len({fingerprint, Hasher.hash(tokenizer_for_maps(added)), Hasher.hash(tokenizer_for_maps(templated))}) == 3
