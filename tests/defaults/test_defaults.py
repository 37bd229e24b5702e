"""Tests for the self-contained defaults behind the no-argument ``leantune sft`` run."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from leantune.defaults import (
    DEFAULT_TRAINING,
    build_default_dataset,
    build_default_model_config,
    build_default_tokenizer,
    evaluate_exact_match,
    exact_match_score,
    is_exact_match,
    solve_prompt,
)
from leantune.defaults.tasks import TASKS

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds


@pytest.fixture(scope="module")
def tok():
    return build_default_tokenizer()


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text",
    ["reverse: cat = tac", "  two  spaces ", "Line one\nline two!", "add: 12 + 34 = 46", "{[(~`^|)]}"],
)
def test_tokenizer_round_trips_text(tok, text):
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.unk_token_id not in ids
    assert len(ids) == len(text) + 1  # one token per character, plus bos
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_special_tokens(tok):
    ids = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}
    assert None not in ids and len(ids) == 4
    assert len(tok) < 128
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    assert tok("ab", add_special_tokens=False)["input_ids"] == tok.convert_tokens_to_ids(["a", "b"])
    assert tok.padding_side == "right"


def test_tokenizer_is_deterministic_and_survives_save(tmp_path, tok):
    from transformers import AutoTokenizer

    assert build_default_tokenizer().get_vocab() == tok.get_vocab()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "sort: dcba = abcd"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.chat_template == tok.chat_template


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "reverse: cat ="},
    {"role": "assistant", "content": "tac"},
    {"role": "user", "content": "and dog?"},
    {"role": "assistant", "content": "god, of course"},
]


def test_chat_template_assistant_mask_covers_reply_and_eos_exactly(tok):
    out = tok.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    # Contiguous masked spans, in order, must be exactly "<reply><eos>" for each assistant turn.
    spans, current = [], []
    for token_id, m in zip(ids, mask):
        if m:
            current.append(token_id)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    expected = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert [tok.decode(s) for s in spans] == [e + tok.eos_token for e in expected]
    # Everything that is not masked contains no assistant text or eos.
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert tok.eos_token not in unmasked and "tac" not in unmasked
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_chat_template_generation_prompt(tok):
    history = CONVERSATION[:2]
    prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    without = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=False)
    full = tok.apply_chat_template(CONVERSATION[:3], tokenize=False)
    assert prompt.endswith("<|assistant|>") and not without.endswith("<|assistant|>")
    assert full.startswith(prompt) and full[len(prompt) :] == "tac" + tok.eos_token
    ids = tok.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")


# ---------------------------------------------------------------- dataset


@pytest.mark.parametrize("task", sorted(TASKS))
def test_dataset_splits_disjoint_and_sized(task):
    ds = build_default_dataset(300, 50, seed=0, task=task)
    assert set(ds) == {"train", "test"}
    assert ds["train"].column_names == ["prompt", "completion"]
    assert len(ds["train"]) == 300 and len(ds["test"]) == 50
    train, test = set(ds["train"]["prompt"]), set(ds["test"]["prompt"])
    assert len(train) == 300 and len(test) == 50  # no duplicates inside a split
    assert not train & test


def test_dataset_is_deterministic_for_a_seed():
    a = build_default_dataset(200, 40, seed=3)
    b = build_default_dataset(200, 40, seed=3)
    c = build_default_dataset(200, 40, seed=4)
    assert a["train"].to_dict() == b["train"].to_dict()
    assert a["test"].to_dict() == b["test"].to_dict()
    assert a["test"]["prompt"] != c["test"]["prompt"]
    # The held-out split does not depend on how much training data is requested.
    assert build_default_dataset(500, 40, seed=3)["test"].to_dict() == a["test"].to_dict()


def _ground_truth(prompt: str) -> str:
    """Independent re-implementation of each task's answer."""
    if m := re.fullmatch(r"reverse: ([a-z]+) =", prompt):
        return "".join(reversed(list(m.group(1))))
    if m := re.fullmatch(r"sort: ([a-z]+) =", prompt):
        letters = list(m.group(1))
        letters.sort(key=ord)
        return "".join(letters)
    if m := re.fullmatch(r"add: (\d+) \+ (\d+) =", prompt):
        return f"{int(m.group(1)) + int(m.group(2))}"
    raise AssertionError(f"unexpected prompt format: {prompt!r}")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_completions_are_correct(task):
    ds = build_default_dataset(400, 100, seed=1, task=task)
    for split in ("train", "test"):
        for row in ds[split]:
            assert row["completion"] == " " + _ground_truth(row["prompt"]), row
            assert solve_prompt(row["prompt"]) == _ground_truth(row["prompt"])
    with pytest.raises(ValueError):
        solve_prompt("multiply: 2 * 3 =")


def test_default_task_reads_naturally(tok):
    row = build_default_dataset(1, 1, seed=0)["test"][0]
    assert re.fullmatch(r"reverse: [a-z]{3,6} =", row["prompt"])
    # every character is in the tokenizer's alphabet
    assert tok.unk_token_id not in tok(row["prompt"] + row["completion"])["input_ids"]


def test_dataset_rejects_impossible_requests():
    with pytest.raises(ValueError):
        build_default_dataset(10, 10, task="nope")
    with pytest.raises(ValueError):
        build_default_dataset(9000, 10, task="add")  # only 90*90 distinct additions exist


# ---------------------------------------------------------------- model config + recipe


def test_model_config_matches_tokenizer(tok):
    cfg = build_default_model_config(tok)
    assert isinstance(cfg, LlamaConfig)
    assert cfg.vocab_size == len(tok)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert cfg.max_position_embeddings >= DEFAULT_TRAINING["max_length"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    batch = tok(["reverse: abc = cba"], return_tensors="pt")
    out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (1, batch["input_ids"].shape[1], len(tok))
    assert torch.isfinite(out.loss)


def test_default_training_recipe_is_consistent(tok):
    d = DEFAULT_TRAINING
    for key in (
        "learning_rate",
        "per_device_train_batch_size",
        "num_train_epochs",
        "max_steps",
        "warmup_steps",
        "lr_scheduler_type",
        "max_length",
        "num_train",
        "num_eval",
        "logging_steps",
    ):
        assert key in d, key
    # Every key is either a run-only knob or a real TrainingArguments / TRL SFTConfig field.
    import dataclasses

    from transformers import TrainingArguments

    from leantune.defaults import RUN_ONLY_KEYS

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    sft_only = {"max_length", "completion_only_loss"}
    assert set(d) - RUN_ONLY_KEYS - sft_only <= fields, set(d) - RUN_ONLY_KEYS - sft_only - fields
    steps = d["num_train"] * d["num_train_epochs"] // d["per_device_train_batch_size"]
    assert 100 <= steps <= 1000 and d["warmup_steps"] < steps
    # The longest default example must fit in max_length (prompt + completion + eos).
    ds = build_default_dataset(d["num_train"], d["num_eval"], seed=0)
    longest = max(
        len(tok(p + c)["input_ids"]) + 1
        for p, c in zip(ds["train"]["prompt"], ds["train"]["completion"])
    )
    assert longest <= d["max_length"]


# ---------------------------------------------------------------- evaluation


def test_exact_match_scoring_on_hand_made_strings():
    assert is_exact_match(" tac", "tac") and is_exact_match("tac\n", " tac")
    assert not is_exact_match("tacx", "tac") and not is_exact_match("ta c", "tac")
    assert not is_exact_match("TAC", "tac") and not is_exact_match("", "tac")
    assert exact_match_score(["tac", " god", "x"], [" tac", " god", " olleh"]) == pytest.approx(2 / 3)
    assert exact_match_score(["a", "b"], ["a", "b"]) == 1.0
    assert exact_match_score(["b", "a"], ["a", "b"]) == 0.0
    assert exact_match_score([], []) == 0.0
    with pytest.raises(ValueError):
        exact_match_score(["a"], ["a", "b"])


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core box
    OpenMP spin-waiting makes 2 threads many times slower than 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_model(tok, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return AutoModelForCausalLM.from_config(cfg)


def test_evaluate_exact_match_on_random_model(tok, one_thread):
    model = _tiny_model(tok)
    model.train()
    ds = build_default_dataset(0, 13, seed=0)["test"]
    result = evaluate_exact_match(model, tok, ds, max_new_tokens=4, batch_size=5)
    assert set(result) >= {"exact_match", "num_examples", "examples"}
    assert isinstance(result["exact_match"], float) and 0.0 <= result["exact_match"] <= 1.0
    assert result["num_examples"] == 13
    assert 1 <= len(result["examples"]) <= 13
    prompt, expected, got = result["examples"][0]
    assert prompt == ds[0]["prompt"] and expected == ds[0]["completion"].strip()
    assert isinstance(got, str) and len(tok(got, add_special_tokens=False)["input_ids"]) <= 4
    # state is restored
    assert model.training and tok.padding_side == "right"


def test_evaluate_exact_match_scores_a_model_that_knows_the_answers(tok, one_thread):
    """Overfit a tiny model on a few prompts of different lengths, then evaluate them
    in one left-padded batch: greedy decoding must reproduce every answer."""
    ds = build_default_dataset(0, 6, seed=5)["test"]
    assert len({len(p) for p in ds["prompt"]}) > 1  # mixed lengths exercise left padding
    model = _tiny_model(tok, seed=1)
    enc = [tok(p + c)["input_ids"] + [tok.eos_token_id] for p, c in zip(ds["prompt"], ds["completion"])]
    n_prompt = [len(tok(p)["input_ids"]) for p in ds["prompt"]]
    width = max(map(len, enc))
    ids = torch.full((len(enc), width), tok.pad_token_id)
    labels = torch.full((len(enc), width), -100)
    attn = torch.zeros((len(enc), width), dtype=torch.long)
    for i, (e, n) in enumerate(zip(enc, n_prompt)):
        ids[i, : len(e)] = torch.tensor(e)
        labels[i, n : len(e)] = torch.tensor(e[n:])
        attn[i, : len(e)] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(60):  # lr 1e-2: exact match reaches 1.0 by ~40 steps across seeds
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05
    result = evaluate_exact_match(model, tok, ds, batch_size=6)
    assert result["exact_match"] == 1.0, result["examples"]
    assert result["num_examples"] == 6
    # and the same model scores 0 against deliberately wrong references
    wrong = ds.map(lambda r: {"completion": r["completion"] + "x"})
    assert evaluate_exact_match(model, tok, wrong, batch_size=6)["exact_match"] == 0.0


def test_evaluate_exact_match_conversational_rows(tok):
    model = _tiny_model(tok)
    rows = [
        {
            "prompt": [{"role": "user", "content": "reverse: abc ="}],
            "completion": [{"role": "assistant", "content": "cba"}],
        }
    ]
    result = evaluate_exact_match(model, tok, rows, max_new_tokens=3)
    assert result["num_examples"] == 1
    prompt, expected, _ = result["examples"][0]
    assert prompt.startswith(tok.bos_token) and prompt.endswith("<|assistant|>") and expected == "cba"
