"""Planning long rows: a chunked loss in the fake step runs only the chunks whose memory can differ
(losses/token_logprobs.py), so the planner's time does not grow with the length, and the plan is the same to the byte
as the trace of every chunk; `--solve max_length` finds the longest that fits a budget (planning/max_length.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig

from leantune.losses.token_logprobs import chunk_starts, chunk_tokens_for, repeated_chunks_skipped
from leantune.planning import plan_memory, planned_run

# The tiny test models' shape with a longer context; its 32k vocabulary makes the chunked loss's chunk 524 tokens
# (64 MiB of fp32 logits), so 4,096 and 8,192 tokens are 8 and 16 chunks: most of them are repeats
TINY_LONG = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=16384, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _profile(method: str, length: int) -> dict:
    if method == "sft":  # one row, its first quarter prompt: targets are a part of the row, as in real data
        return {"kind": "sft", "row_lengths": {"sequences": [length], "prompts": [length // 4]}}
    # a pair whose prompt + chosen and prompt + rejected are `length` and a little less
    return {"kind": "preference", "row_lengths": {"prompt": [length // 4], "chosen": [length - length // 4],
                                                  "rejected": [length - length // 4 - 100]}}


@pytest.mark.quick
def test_only_a_fake_tensor_skips_its_repeated_chunks():
    real = torch.zeros(10 * 16, 4)
    assert list(chunk_starts(real, 16)) == list(range(0, 160, 16))
    with repeated_chunks_skipped():
        assert list(chunk_starts(real, 16)) == list(range(0, 160, 16))  # a real loss always runs every chunk
        with FakeTensorMode() as mode:
            fake = mode.from_tensor(torch.zeros(10 * 16 + 3, 4))
            assert list(chunk_starts(fake, 16)) == [0, 16, 160]  # the first, the first steady one, the short last
            assert list(chunk_starts(fake[:48], 16)) == [0, 16, 32]
    with FakeTensorMode() as mode:  # outside the planner a fake tensor runs every chunk too
        assert len(chunk_starts(mode.from_tensor(torch.zeros(160, 4)), 16)) == 10


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_skipping_repeated_chunks_plans_the_same_bytes(method, tokenizer, monkeypatch):
    config = LlamaConfig(**TINY_LONG)
    for length in (4096, 8192):
        fields = dict(processing_class=tokenizer, lengths=_profile(method, length), max_length=length,
                      per_device_train_batch_size=1, measured_step=False, max_batches=1)
        skipped = plan_memory(config, None, method, **fields)
        monkeypatch.setattr(planned_run, "SKIP_REPEATED_CHUNKS", False)
        every_chunk = plan_memory(config, None, method, **fields)
        monkeypatch.undo()
        # peak and every part, to the byte: skipping the steady chunk too (runs [0, last]) plans 4,192 bytes less at
        # 4,096 tokens of SFT (negative control), so a chunk whose memory differs is seen here
        assert skipped.worst == every_chunk.worst, (method, length)
    assert 3 * chunk_tokens_for(TINY_LONG["vocab_size"]) < length // 2  # most chunks are repeats: skips happened


def test_skipping_repeated_tiles_plans_the_same_bytes(tokenizer, monkeypatch):
    """The tiled MLP's tiles in the fake step: first, second and last only (losses/token_logprobs.py), the plan the same
    to the byte as every tile's (a 8B plan at 500,000 tokens ran 489 fake tiles a layer per trace before)."""
    config = LlamaConfig(**TINY_LONG)
    fields = dict(processing_class=tokenizer, lengths=_profile("sft", 4096), max_length=4096,
                  per_device_train_batch_size=1, measured_step=False, max_batches=1, tiled_mlp=True,
                  tiled_mlp_tile_size=256)  # 16 tiles a layer
    skipped = plan_memory(config, None, "sft", **fields)
    monkeypatch.setattr(planned_run, "SKIP_REPEATED_CHUNKS", False)
    every_tile = plan_memory(config, None, "sft", **fields)
    assert skipped.worst == every_tile.worst


def test_solve_max_length_finds_the_longest_that_fits(tokenizer, tmp_path, capsys):
    from leantune.cli.main import main
    from leantune.planning.length_profile import dataset_from_lengths

    model_dir, profile = tmp_path / "model", tmp_path / "lengths.json"
    config = LlamaConfig(**TINY_LONG)
    config.save_pretrained(model_dir)
    profile.write_text(json.dumps({"kind": "sft", "row_lengths": {"sequences": [2048]}}))  # every token a target
    rows = dataset_from_lengths(str(profile), "sft")

    def device_total(length):  # the plan of the run as the command plans it: one process, this machine's CPU
        return plan_memory(config, rows, "sft", processing_class=tokenizer, per_device_train_batch_size=1,
                           max_length=length, device="cpu").device_total_bytes

    budget = device_total(1000) + 1  # between the totals at 1,000 and 2,048 tokens: the answer is in between
    capsys.readouterr()
    assert main(["plan", "--model_name_or_path", str(model_dir), "--tokenizer", str(tokenizer.name_or_path),
                 "--lengths", str(profile), "--per_device_train_batch_size", "1", "--max_length", "512",
                 "--memory_budget", f"{budget}B", "--solve", "max_length"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"longest max_length within .*: (\d+) \(peak .*; (\d+) plans .*most of the peak: "
                      r"(\w[\w ]*) .*lengths in steps of (\d+)", out)
    assert found, out
    length, beyond, part, step = int(found[1]), int(found[2]), found[3], int(found[4])
    assert step == 16 and beyond == length + step and 1000 - step < length <= 1000  # the budget: 1,000 tokens + 1 byte
    assert device_total(length) <= budget < device_total(length + step)
    assert part in ("activations", "parameters", "temporaries", "optimizer states")


def test_solve_max_length_of_an_online_method_is_its_longest_prompt_and_completions(tokenizer, tmp_path, capsys):
    """GRPO's rows are its prompts and their completions: `--solve max_length` gives the longest prompt plus the
    longest max_completion_length whose plan fits (its round and update step), the completions' own line beside it."""
    from datasets import Dataset

    from leantune.cli.main import main

    model_dir = tmp_path / "model"
    LlamaConfig(**{**TINY_LONG, "max_position_embeddings": 48}).save_pretrained(model_dir)  # a short bisection
    tokenizer.save_pretrained(model_dir)
    Dataset.from_dict({"prompt": ["What is two plus two?"] * 4}).to_json(tmp_path / "prompts.jsonl")
    common = ["plan", "--method", "grpo", "--model_name_or_path", str(model_dir), "--dataset_name",
              str(tmp_path / "prompts.jsonl"), "--num_generations", "4", "--per_device_train_batch_size", "4"]

    def device_total(completion: int) -> int:
        assert main([*common, "--max_completion_length", str(completion), "--plan_json",
                     str(tmp_path / "p.json")]) == 0
        return json.loads((tmp_path / "p.json").read_text())["device_total_bytes"]

    budget = device_total(20)  # 20 tokens fit, to the byte
    capsys.readouterr()
    assert main([*common, "--max_completion_length", "8", "--memory_budget", f"{budget}B", "--solve",
                 "max_length"]) == 0
    out = capsys.readouterr().out
    completion = int(re.search(r"largest max_completion_length within [0-9.]+ MiB: (\d+)", out).group(1))
    found = re.search(r"longest max_length \(prompt \+ completion\) within [0-9.]+ MiB: (\d+) = the longest prompt "
                      r"(\d+) \+ max_completion_length (\d+)", out)
    assert found, out
    total, prompt, solved = map(int, found.groups())
    assert solved == completion >= 20 and total == prompt + completion and prompt > 0
    assert f"{completion + 1} plans" in out and device_total(completion + 1) > budget  # one token more does not


@pytest.mark.quick
def test_the_length_search_is_exact_at_its_step():
    from types import SimpleNamespace

    from leantune.planning.max_length import length_step, solve_max_length

    assert [length_step(n) for n in (100, 8192, 500_000)] == [16, 32, 1024]

    def plan_at(length):  # a step whose memory grows with the square of the length, as attention's scores do
        total = 1000 + 3 * length + length * length // 64
        return SimpleNamespace(device_total_bytes=total, peak_bytes=total, worst=SimpleNamespace(
            parts={"activations": total - 1000, "parameters": 1000}))

    budget = plan_at(5000).device_total_bytes
    solved = solve_max_length(plan_at, budget, 500_000, step=16)
    assert solved.length == 5000 // 16 * 16 and solved.beyond == solved.length + 16
    assert plan_at(solved.length).device_total_bytes <= budget < solved.beyond_total
    assert solved.plans <= 16 and "longest max_length" in solved.lines()[0] and "activations" in solved.lines()[0]
    assert solve_max_length(plan_at, 10**12, 2048).length == 2048  # all of the longest row fits
    assert solve_max_length(plan_at, 10, 2048).length is None  # not even one step
