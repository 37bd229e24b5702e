"""Sequence-length profiler: numbers against brute force, real data and tokenizer, figure, JSON, CLI, bad input."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest
from datasets import Dataset

from leantune import LengthProfile, profile_dataset
from leantune.data.packing import plan_packing
from leantune.data.preference_formats import (
    split_shared_prompt_messages,
    split_shared_prompt_text,
)
from leantune.profiling import length_summary_line, write_length_figure
from leantune.profiling.lengths import DatasetLengths
from leantune.profiling.profiler import build_profile

from ..fixtures.data import gsm8k_rows, hh_rows
from ..fixtures.paths import TOKENIZER_DIR
from ..fixtures.tokenizers import load_tokenizer

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

# --- brute force, one Python loop at a time ---------------------------------------------------------------------


def brute_percentile(lengths, q):
    ordered = sorted(lengths)
    return ordered[max(1, math.ceil(q * len(ordered) / 100)) - 1]


def brute_truncation(lengths, max_length):
    over = [x for x in lengths if x > max_length]
    return len(over), sum(x - max_length for x in over)


def brute_batches(num_items, batch_size, seed):
    order = list(np.random.default_rng(seed).permutation(num_items))
    return [order[i: i + batch_size] for i in range(0, num_items, batch_size)]


def brute_padding(items, max_length, batch_size, seed, multiple=None):
    """(padded waste, padding-free waste): items are lists of rows (1 per SFT example, 2 per preference pair)."""
    real = padded = flat = 0
    for batch in brute_batches(len(items), batch_size, seed):
        rows = [min(x, max_length) for i in batch for x in items[i]]
        width = max(rows)
        tokens = sum(rows)
        if multiple:
            width = -(-width // multiple) * multiple
            tokens_padded = -(-tokens // multiple) * multiple
        else:
            tokens_padded = tokens
        real += sum(rows)
        padded += width * len(rows)
        flat += tokens_padded
    return (padded - real) / padded, (flat - real) / flat


def brute_recommendation(lengths, threshold=0.99):
    total = sum(lengths)
    length = 64
    while sum(min(x, length) for x in lengths) / total < threshold:
        length += 64
    return length


def brute_bfd_rows(sizes, capacity):
    """Plain best-fit-decreasing: each item into the fullest bin it fits in."""
    free = []
    for size in sorted(sizes, reverse=True):
        fitting = [i for i, space in enumerate(free) if space >= size]
        if fitting:
            best = min(fitting, key=lambda i: free[i])
            free[best] -= size
        else:
            free.append(capacity - size)
    return len(free)


def check_against_brute_force(profile: LengthProfile, items, seed=42, multiple=None):
    sequences = [x for item in items for x in item]
    stats = profile.stats["sequences"]
    assert stats.count == len(sequences) and stats.total_tokens == sum(sequences)
    # here and below: float64 ratios of integer counts computed two ways: a few ulps (default rel 1e-6)
    assert stats.mean == pytest.approx(sum(sequences) / len(sequences))
    for q in (50, 90, 95, 99):
        assert getattr(stats, f"p{q}") == brute_percentile(sequences, q), q
    assert stats.max == max(sequences) and stats.min == min(sequences)
    for row in profile.candidates:
        num_over, lost = brute_truncation(sequences, row.max_length)
        assert (row.num_truncated, row.tokens_lost) == (num_over, lost)
        assert row.truncated_share == pytest.approx(num_over / len(sequences))
        assert row.lost_share == pytest.approx(lost / sum(sequences))
        padded, padding_free = brute_padding(items, row.max_length, profile.batch_size, seed, multiple)
        assert row.padded_waste == pytest.approx(padded) and row.padding_free_waste == pytest.approx(padding_free)
        kept = [min(x, row.max_length) for x in sequences]
        bfd = row.packing["bfd"]
        assert bfd.tokens_kept == sum(kept)
        assert math.ceil(sum(kept) / row.max_length) <= bfd.rows <= brute_bfd_rows(kept, row.max_length)
        assert bfd.fill_ratio == pytest.approx(sum(kept) / (bfd.rows * row.max_length))
        wrapped = row.packing["wrapped"]
        assert wrapped.rows == math.ceil(sum(sequences) / row.max_length) and wrapped.tokens_kept == sum(sequences)
        split = row.packing["bfd_split"]
        assert split.tokens_kept == sum(sequences)
        assert split.fill_ratio == pytest.approx(sum(sequences) / (split.rows * row.max_length))
        for strategy in ("bfd", "bfd_split", "wrapped"):  # the trainer's own packing arithmetic
            lengths = np.minimum(sequences, row.max_length) if strategy == "bfd" else np.array(sequences)
            plan = plan_packing(lengths, row.max_length, strategy)
            assert (row.packing[strategy].rows, row.packing[strategy].fill_ratio) == (plan.num_rows, plan.fill_ratio)
    rec = profile.recommendation
    assert rec.max_length == brute_recommendation(sequences, rec.keep_threshold)
    assert rec.max_length in [row.max_length for row in profile.candidates]
    assert f"max_length: {rec.max_length}" in rec.config_lines


# --- numbers on synthetic lengths ---------------------------------------------------------------------------------


def test_sft_numbers_match_brute_force():
    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(5, 0.7)) + 1 for _ in range(997)]
    profile = build_profile(DatasetLengths("sft", "prompt_completion", 1000, np.array(lengths), num_empty=3),
                            batch_size=7, seed=42)
    check_against_brute_force(profile, [[x] for x in lengths])
    assert profile.num_empty == 3 and profile.num_rows == 1000
    powers = [row.max_length for row in profile.candidates if row.max_length & (row.max_length - 1) == 0]
    assert powers[-1] >= max(lengths) and all(b == 2 * a for a, b in itertools.pairwise(powers))


def test_preference_numbers_use_both_rows_of_a_pair_and_match_brute_force():
    rng = random.Random(1)
    prompt = np.array([rng.randint(5, 300) for _ in range(301)])
    chosen = np.array([rng.randint(1, 200) for _ in range(301)])
    rejected = np.array([rng.randint(1, 200) for _ in range(301)])
    sequences = np.stack([prompt + chosen, prompt + rejected], axis=1).reshape(-1)
    parts = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "prompt+chosen": prompt + chosen,
             "prompt+rejected": prompt + rejected}
    lengths = DatasetLengths("preference", "implicit_prompt", 301, sequences, parts=parts)
    profile = build_profile(lengths, max_lengths=[100, 256, 300], batch_size=4, pad_to_multiple_of=16, seed=3)
    check_against_brute_force(profile, [[int(c), int(r)] for c, r in zip(prompt + chosen, prompt + rejected)],
                              seed=3, multiple=16)
    assert {100, 256, 300} <= {row.max_length for row in profile.candidates}
    for name, values in parts.items():
        assert profile.stats[name].p90 == brute_percentile(list(values), 90)
    assert profile.recommendation.mode in ("padding_free", "padded")  # pairs are not packed


def test_keep_threshold_moves_the_recommendation():
    lengths = np.array([100] * 90 + [1000] * 10)
    loose = build_profile(DatasetLengths("sft", "x", 100, lengths), keep_threshold=0.5)
    strict = build_profile(DatasetLengths("sft", "x", 100, lengths), keep_threshold=1.0)
    assert loose.recommendation.max_length == brute_recommendation(list(lengths), 0.5)
    assert strict.recommendation.max_length == 1024
    with pytest.raises(ValueError, match="keep_threshold"):
        build_profile(DatasetLengths("sft", "x", 100, lengths), keep_threshold=0)


def test_length_summary_line_counts_truncation():
    line = length_summary_line([10, 20, 30, 300], 25, "train")
    assert "4 examples" in line and "p50 20" in line and "max 300" in line
    assert "truncates 2 (50.00%)" in line and "loses 280 tokens" in line
    assert "split across rows" in length_summary_line([10, 300], 25, truncates=False)
    assert "nothing truncated" in length_summary_line([10, 300], None)


def test_sft_preparation_logs_the_length_summary_before_truncating(mistral, tmp_path, caplog):
    import logging

    from leantune import SFTConfig
    from leantune.data.sft_preparation import prepare_sft_dataset

    rows = [{"prompt": "Q:" + " word" * n, "completion": " A"} for n in (1, 5, 40)]
    args = SFTConfig(output_dir=str(tmp_path), max_length=16, use_cpu=True, report_to=[])
    with caplog.at_level(logging.INFO, logger="leantune.data"):
        prepare_sft_dataset(Dataset.from_list(rows), mistral, args)
    lengths = [len(mistral(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in rows]
    expected = length_summary_line(lengths, 16, "train")
    assert expected in caplog.text and "truncates 1 " in expected


# --- real tokenizer and data ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral(tokenizer_dir):

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def gsm8k_300(tokenizer_dir):
    return gsm8k_rows(300)


@pytest.fixture(scope="module")
def hh_300(tokenizer_dir):
    return hh_rows(300)


def test_gsm8k_lengths_are_the_sft_trainers_and_the_recommendation_the_brute_force_one(mistral, gsm8k_300, tmp_path):
    from leantune import SFTConfig
    from leantune.data.sft_preparation import prepare_sft_dataset

    data = Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in gsm8k_300])
    profile = profile_dataset(data, mistral, column_mapping={"question": "prompt", "answer": "completion"})
    renamed = data.rename_columns({"question": "prompt", "answer": "completion"})
    args = SFTConfig(output_dir=str(tmp_path), max_length=None, use_cpu=True, report_to=[])
    prepared, _ = prepare_sft_dataset(renamed, mistral, args)
    trainer_lengths = [len(ids) for ids in prepared["input_ids"]]
    assert sorted(profile.lengths.tolist()) == sorted(trainer_lengths)
    check_against_brute_force(profile, [[x] for x in profile.lengths.tolist()])
    assert profile.data_format == "prompt_completion" and profile.kind == "sft"


def test_hh_pairs_split_at_the_last_shared_assistant_turn(mistral, hh_300):
    profile = profile_dataset(hh_300, mistral)
    assert profile.kind == "preference" and profile.data_format == "implicit_prompt"
    eos = mistral.eos_token_id
    items, num_empty = [], 0
    for pair in hh_300:
        chosen, rejected = pair["chosen"], pair["rejected"]
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        cut = chosen[:shared].rfind("\n\nAssistant:") + len("\n\nAssistant:")
        if not chosen[cut:].strip() or not rejected[cut:].strip():
            num_empty += 1  # the DPO trainer drops such a pair
            continue
        prompt = len(mistral(chosen[:cut])["input_ids"])
        items.append([prompt + len(mistral(text[cut:], add_special_tokens=False)["input_ids"] + [eos])
                      for text in (chosen, rejected)])
    assert profile.lengths.tolist() == [x for item in items for x in item]
    check_against_brute_force(profile, items)
    assert num_empty == profile.num_empty == 1 and profile.num_identical_pairs == 0
    assert profile.stats["prompt"].count == 299 and profile.stats["prompt+chosen"].count == 299
    assert profile.stats["sequences"].count == 598


def test_conversational_sft_and_preference_go_through_the_chat_template(mistral):
    user = {"role": "user", "content": "What is 2+2?"}
    answer = {"role": "assistant", "content": "It is 4."}
    wrong = {"role": "assistant", "content": "Five, I think, but let me check."}
    sft = profile_dataset([{"messages": [user, answer]}, {"messages": [user, wrong]}], mistral)
    expected = [len(mistral.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"])
                for m in ([user, answer], [user, wrong])]
    assert sorted(sft.lengths.tolist()) == sorted(expected) and sft.data_format == "conversational"

    explicit = profile_dataset([{"prompt": [user], "chosen": [answer], "rejected": [wrong]}], mistral)
    implicit = profile_dataset([{"chosen": [user, answer], "rejected": [user, wrong]}], mistral)
    assert explicit.lengths.tolist() == implicit.lengths.tolist() == expected
    assert implicit.data_format == "conversational_implicit_prompt"
    prompt_ids = mistral.apply_chat_template([user], tokenize=True, return_dict=True, add_generation_prompt=True)
    assert implicit.stats["prompt"].max == len(prompt_ids["input_ids"])


def test_prompt_splitting_of_identical_and_diverging_pairs():
    text = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye\n\nAssistant: I'm off"
    assert split_shared_prompt_text(text, text) == (text[: -len(" I'm off")], " I'm off", " I'm off")
    prompt, chosen, rejected = split_shared_prompt_text(text, text[: -len(" I'm off")] + " I'm staying")
    assert prompt.endswith("\n\nAssistant:") and chosen == " I'm off" and rejected == " I'm staying"
    user, reply = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    assert split_shared_prompt_messages([user, reply], [user, reply]) == ([user], [reply], [reply])
    assert split_shared_prompt_messages([user, reply], [user]) == ([user], [reply], [])


def test_preference_pairs_with_identical_or_empty_completions_are_counted_not_profiled(mistral):
    rows = [{"prompt": "Q: hi", "chosen": " A", "rejected": " A"},
            {"prompt": "Q: hi", "chosen": " A", "rejected": "  "},
            {"prompt": "Q: yo", "chosen": " B", "rejected": " C"}]
    profile = profile_dataset(rows, mistral)  # both odd pairs dropped, as the DPO trainer drops them, and counted
    assert profile.num_identical_pairs == 1 and profile.num_empty == 1 and profile.num_rows == 3
    assert profile.stats["sequences"].count == 2 and profile.stats["prompt"].count == 1
    assert "1 pairs with chosen == rejected, 1 pairs with an empty completion" in profile.format_text()
    with pytest.raises(ValueError, match="No pair of 2 is left"):
        profile_dataset(rows[:2], mistral)


def test_empty_sft_rows_are_counted_not_profiled(mistral):
    rows = [{"prompt": "Q: hi", "completion": " A"}, {"prompt": "Q: yo", "completion": "   "}]
    profile = profile_dataset(rows, mistral)
    assert profile.num_empty == 1 and profile.stats["sequences"].count == 1
    assert "1 empty examples" in profile.format_text()


def test_pre_tokenised_data_needs_no_tokenisation(mistral):
    sft = profile_dataset([{"input_ids": [1] * n} for n in (3, 0, 70)], mistral)
    assert sorted(sft.lengths.tolist()) == [3, 70] and sft.num_empty == 1
    pref = profile_dataset([{"prompt_ids": [1] * 5, "chosen_ids": [2] * 3, "rejected_ids": [3]}],
                           mistral)
    assert pref.lengths.tolist() == [8, 6]


# --- outputs: figure, JSON, report, CLI --------------------------------------------------------------------------


def test_figure_is_a_valid_png_and_json_holds_the_objects_numbers(tmp_path):
    from PIL import Image

    lengths = np.random.default_rng(0).integers(1, 900, size=500)
    profile = build_profile(DatasetLengths("sft", "language_modeling", 500, lengths), pad_to_multiple_of=8)
    path = write_length_figure(profile, tmp_path / "profile.png")
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 1000
    profile.to_json(tmp_path / "profile.json")
    loaded = json.loads((tmp_path / "profile.json").read_text())
    assert loaded == json.loads(json.dumps(profile.to_dict()))
    assert loaded["recommendation"]["max_length"] == profile.recommendation.max_length
    row = profile.candidate(profile.recommendation.max_length)
    stored = next(c for c in loaded["candidates"] if c["max_length"] == row.max_length)
    assert stored["padded_waste"] == row.padded_waste and stored["packing"]["bfd"]["rows"] == row.packing["bfd"].rows
    assert loaded["stats"]["sequences"]["p99"] == profile.stats["sequences"].p99
    assert "pad_to_multiple_of: 8" in profile.recommendation.config_lines


def test_cli_profiles_gsm8k_and_writes_figure_and_json(gsm8k_300, tmp_path, capsys):
    from leantune.cli.main import main

    data_file = tmp_path / "gsm8k.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in gsm8k_300))
    out = tmp_path / "out"
    code = main(["profile", "--dataset_name", str(data_file), "--model_name_or_path", str(TOKENIZER_DIR),
                 "--prompt_column", "question", "--completion_column", "answer", "--max_lengths", "200", "300",
                 "--batch_size", "4", "--output_dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    saved = json.loads((out / "length_profile.json").read_text())
    assert (out / "length_profile.png").read_bytes()[:4] == b"\x89PNG"
    assert f"recommendation: max_length {saved['recommendation']['max_length']}" in printed
    assert "p99" in printed and "bfd_split" in printed and "max_length: " in printed
    assert {200, 300} <= {row["max_length"] for row in saved["candidates"]} and saved["batch_size"] == 4


def test_cli_help_and_missing_arguments(capsys):
    from leantune.cli.main import main

    assert main(["profile", "--help"]) == 0
    helped = capsys.readouterr().out
    for flag in ("--dataset_name", "--tokenizer", "--max_lengths", "--keep_threshold", "--batch_size",
                 "--pad_to_multiple_of", "--prompt_column", "--output_dir", "--num_proc"):
        assert flag in helped, flag
    assert main(["profile", "--dataset_name", "x.jsonl"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


# --- bad input -----------------------------------------------------------------------------------------------------


def test_empty_dataset_is_a_clear_error(mistral):
    with pytest.raises(ValueError, match="empty"):
        profile_dataset(Dataset.from_dict({"prompt": [], "completion": []}), mistral)
    with pytest.raises(ValueError, match="Every one of the 2 examples is empty"):
        profile_dataset([{"text": ""}, {"text": "  "}], mistral)


def test_unknown_format_lists_columns_and_accepted_formats(mistral):
    with pytest.raises(ValueError) as error:
        profile_dataset([{"question": "a", "reply": "b"}], mistral)
    message = str(error.value)
    assert "['question', 'reply']" in message and "prompt-completion" in message and "chosen" in message
    assert "--prompt_column" in message
    with pytest.raises(ValueError, match="strings or all be lists"):
        profile_dataset([{"chosen": "a", "rejected": [{"role": "user", "content": "b"}]}], mistral)
    with pytest.raises(ValueError, match="not found"):
        profile_dataset([{"question": "a"}], mistral, column_mapping={"missing": "prompt"})


def test_missing_tokenizer_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="Tokenizer folder not found"):
        profile_dataset([{"text": "hello"}], str(tmp_path / "no-such-tokenizer"))
    with pytest.raises(ValueError, match="tokenizer is needed"):
        profile_dataset([{"text": "hello"}], None)
    from leantune.cli.main import main

    data_file = tmp_path / "data.jsonl"
    data_file.write_text('{"text": "hello"}\n')
    assert main(["profile", "--dataset_name", str(data_file), "--tokenizer", str(tmp_path / "nope")]) == 2
    assert "Tokenizer folder not found" in capsys.readouterr().err
