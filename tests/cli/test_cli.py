"""The `leantune` command line: help, flags named like the config fields, YAML configs, local data and models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from datasets import Dataset

from ..fixtures.commands import leantune
from ..fixtures.models import tiny_model
from ..fixtures.paths import REPO


def test_help_lists_commands_and_sft_flags():
    top = leantune("--help")
    assert top.returncode == 0 and "sft" in top.stdout
    sft = leantune("sft", "--help")
    assert sft.returncode == 0
    for flag in ("--max_length", "--packing", "--packing_strategy", "--padding_free", "--pad_to_multiple_of",
                 "--completion_only_loss", "--assistant_only_loss", "--model_name_or_path", "--dataset_name",
                 "--use_peft", "--lora_r", "--gradient_checkpointing", "--config"):
        assert flag in sft.stdout, flag


def test_unknown_command_and_flag_fail_clearly():
    assert leantune("sfx").returncode == 2
    result = leantune("sft", "--not_a_field", "1")
    assert result.returncode != 0 and "not_a_field" in result.stderr


@pytest.fixture
def local_model_and_data(tmp_path, tokenizer, gsm8k_rows):
    model_dir = tmp_path / "tiny-llama"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_file = tmp_path / "train.jsonl"
    with open(data_file, "w") as handle:
        for row in gsm8k_rows[:24]:
            handle.write(json.dumps({"prompt": row["question"], "completion": " " + row["answer"]}) + "\n")
    return model_dir, data_file


def test_sft_trains_a_local_model_on_a_jsonl_file_with_yaml_config(local_model_and_data, tmp_path):
    model_dir, data_file = local_model_and_data
    config = tmp_path / "sft.yaml"
    config.write_text(f"model_name_or_path: {model_dir}\ndataset_name: {data_file}\nmax_length: 64\n"
                      f"per_device_train_batch_size: 4\nmax_steps: 3\npacking: true\nreport_to: none\n")
    out = tmp_path / "out"
    result = leantune("sft", "--config", str(config), "--max_steps", "2", "--output_dir", str(out), "--use_cpu", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps: 2" in result.stdout  # the flag overrode the YAML value
    assert "real tokens/s" in result.stdout and "peak memory" in result.stdout
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def test_sft_reads_parquet_csv_and_saved_folders(local_model_and_data, tmp_path):
    from leantune.data.loading import load_dataset_source

    rows = [{"text": f"example {i}"} for i in range(5)]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for source in ("d.parquet", "d.csv", "saved"):
        data = load_dataset_source(str(tmp_path / source))
        assert data["train"]["text"] == [r["text"] for r in rows], source
    with pytest.raises(FileNotFoundError):
        load_dataset_source(str(tmp_path / "missing.jsonl"))


@pytest.mark.quick
def test_lora_all_linear_from_the_command_line_adapts_every_linear_layer(local_model_and_data, tmp_path):
    from leantune.cli.main import main

    model_dir, data_file = local_model_and_data
    out = tmp_path / "out"
    code = main(["sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--max_steps", "1",
                 "--per_device_train_batch_size", "2", "--max_length", "64", "--use_peft", "true",
                 "--lora_target_modules", "all-linear", "--output_dir", str(out), "--use_cpu", "true",
                 "--report_to", "none", "--save_strategy", "no"])
    assert code == 0
    adapted = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    # PEFT's "all-linear", resolved to module names: every linear layer of every decoder layer, not the output head
    assert {name.rsplit(".", 1)[-1] for name in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"}
    assert {name.split(".")[2] for name in adapted} == {str(i) for i in range(tiny_model().config.num_hidden_layers)}


def test_demo_runs_with_no_model_or_dataset(tmp_path):
    result = leantune("sft", "--max_steps", "3", "--output_dir", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "built-in demo" in result.stdout and "exact match" in result.stdout and "steps: 3" in result.stdout
    assert (tmp_path / "demo" / "model.safetensors").exists()


# --- help: grouped, fast, and the cached copy equals the live rendering ---------------------------------------------


def test_help_is_fast_grouped_and_starts_with_the_commands_own_fields(tmp_path, monkeypatch):
    import time

    # An empty cache of the user's: the first --help renders live (imports transformers) and keeps the text.
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(tmp_path / "cache"))
    first = leantune("sft", "--help")
    assert first.returncode == 0, first.stderr[-2000:]
    started = time.perf_counter()
    result = leantune("sft", "--help")
    seconds = time.perf_counter() - started
    assert result.returncode == 0
    assert seconds < 3.0, seconds  # the second time, no torch or transformers import (a live rendering takes ~5 s)
    assert result.stdout == first.stdout
    titles = [line.rstrip(":") for line in result.stdout.splitlines() if line and not line[0].isspace()]
    order = ["columns (other names read as the standard ones)", "data", "model", "SFTConfig (the method's own fields)", "memory engine (every trainer)",
             "training (inherited from transformers' TrainingArguments)"]
    assert [t for t in titles if t in order] == order, titles
    inherited = result.stdout.index("training (inherited")
    assert result.stdout.index("--packing ") < inherited < result.stdout.index("--weight_decay ")


def test_cached_help_is_the_live_rendering_and_an_edited_source_renders_again(tmp_path, monkeypatch):
    """The cache lives in the user's cache folder, keyed by versions and leantune's sources: nothing in git can go
    stale with another Python or transformers release, and an edited field shows at once."""
    from leantune.cli import help_cache, help_render
    from leantune.cli.main import COMMANDS

    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(tmp_path))
    for command in COMMANDS:
        assert help_cache.cached_help(command) is None
        live = help_render.help_text(command)
        assert live == help_render.render_help(command)
        assert help_cache.cached_help(command) == live, command
    monkeypatch.setattr(help_cache, "source_fingerprint", lambda: "an edited checkout")
    assert help_cache.cached_help("sft") is None


# --- one line, exit code 2, no traceback, for every user mistake ----------------------------------------------------


def _bad_files(tmp_path) -> dict:
    rows = [{"prompt": f"question {i}", "completion": f" answer {i}"} for i in range(8)]
    lines = [json.dumps(r) for r in rows]
    broken = list(lines)
    broken[4] = broken[4][:-3]  # line 5 (1-based) cut short
    files = {"broken.jsonl": ("\n".join(broken) + "\n").encode(), "empty.jsonl": b"",
             "latin1.jsonl": ("\n".join(lines[:2]) + "\n").encode() + '{"prompt": "caf\xe9"}\n'.encode("latin-1"),
             "qa.jsonl": "\n".join(json.dumps({"question": r["prompt"], "answer": r["completion"]})
                                   for r in rows).encode(),
             "not_a_folder": b"x"}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    return {name: str(tmp_path / name) for name in files}


BAD_INPUTS = [
    # (arguments after the command, what the message must name)
    (["--dataset_name", "{missing}"], "missing.jsonl"),
    (["--dataset_name", "{broken.jsonl}"], "broken.jsonl line 5"),
    (["--dataset_name", "{empty.jsonl}"], "empty.jsonl: the file is empty"),
    (["--dataset_name", "{latin1.jsonl}"], "latin1.jsonl line 3"),
    (["--dataset_name", "{qa.jsonl}"], "['answer', 'question']"),
    (["--dataset_name", "{qa.jsonl}", "--prompt_column", "query"], "--prompt_column query"),
    (["--max_length", "0"], "--max_length"),
    (["--packing_strategy", "nonsense"], "--packing_strategy"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
    (["--learning_rat", "1e-4"], "--learning_rat (did you mean --learning_rate?)"),
    (["--max_steps", "many"], "--max_steps"),
    (["--lora_r", "8"], "--lora_r has no effect without --use_peft"),
    (["--output_dir", "{not_a_folder}"], "--output_dir"),
    (["--resume_from_checkpoint", "{missing}"], "--resume_from_checkpoint"),
    (["--model_name_or_path", "./no-such-model"], "--model_name_or_path ./no-such-model: no such folder"),
    (["--model_name_or_path", "{qa.jsonl}"], "is a file"),
    (["--eval_strategy", "steps"], "--dataset_test_split"),
    (["--deepspeed", "/nonexistent/ds_zero3.json"], "--deepspeed /nonexistent/ds_zero3.json: no such file"),
]


@pytest.mark.parametrize("extra,named", BAD_INPUTS, ids=[b[1][:30] for b in BAD_INPUTS])
def test_a_user_mistake_is_one_line_naming_the_culprit(extra, named, local_model_and_data, tmp_path, capsys):
    from leantune.cli.main import main

    model_dir, data_file = local_model_and_data
    files = {**_bad_files(tmp_path), "missing": str(tmp_path / "missing.jsonl")}
    base = {"--model_name_or_path": str(model_dir), "--dataset_name": str(data_file),
            "--output_dir": str(tmp_path / "out"), "--max_steps": "1", "--report_to": "none"}
    given = dict(zip(extra[::2], [files[v[1:-1]] if v.startswith("{") else v for v in extra[1::2]]))
    argv = [x for pair in {**base, **given}.items() for x in pair]
    assert main(["sft", *argv]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("leantune sft: error:")]
    assert len(errors) == 1 and named in errors[0], captured.err[-2000:]
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out").exists()  # nothing ran


def test_preference_data_without_rejected_and_a_bad_yaml_are_named(local_model_and_data, tmp_path, capsys):
    from leantune.cli.main import main

    model_dir, _ = local_model_and_data
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps({"prompt": "p", "chosen": f"c{i}"}) for i in range(4)))
    assert main(["dpo", "--model_name_or_path", str(model_dir), "--dataset_name", str(pairs),
                 "--output_dir", str(tmp_path / "o")]) == 2
    assert "no 'chosen' and 'rejected' columns" in capsys.readouterr().err
    config = tmp_path / "run.yaml"
    config.write_text("max_length: 64\nlearning_rat: 0.1\n")
    assert main(["sft", "--config", str(config)]) == 2
    assert "learning_rat (did you mean learning_rate?)" in capsys.readouterr().err
    config.write_text("max_length: [64\n")
    assert main(["sft", "--config", str(config)]) == 2
    assert f"--config {config} line" in capsys.readouterr().err


def test_a_real_process_exits_2_without_traceback_and_debug_shows_it(tmp_path):
    result = leantune("sft", "--model_name_or_path", "./no-such-model", "--dataset_name", "x.jsonl")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("leantune sft: error: --model_name_or_path")
    debug = leantune("sft", "--model_name_or_path", "./no-such-model", "--dataset_name", "x.jsonl", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


# --- resume: exactly where the run stopped; an earlier run's checkpoints are never overwritten silently -------------


def _losses(checkpoint) -> dict[int, float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.mark.slow
def test_resume_after_kill_9_gives_the_uninterrupted_losses(local_model_and_data, tmp_path, capsys):
    import signal
    import time

    from leantune.cli.main import main

    model_dir, _ = local_model_and_data
    data = _bad_files(tmp_path)["qa.jsonl"]  # GSM8K-like question/answer columns, read through the mapping flags
    steps = 6  # killed after checkpoint-2: four steps are left to resume (tests/trainers/test_resume.py has the rest)
    common = ["--model_name_or_path", str(model_dir), "--dataset_name", data, "--prompt_column", "question",
              "--completion_column", "answer", "--max_length", "32", "--per_device_train_batch_size", "2",
              "--max_steps", str(steps), "--save_steps", "2", "--logging_steps", "1", "--report_to", "none",
              "--disable_tqdm", "true", "--memory_breakdown", "false", "--learning_rate", "1e-3"]
    whole = tmp_path / "whole"
    assert leantune("sft", *common, "--output_dir", str(whole)).returncode == 0

    killed = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([sys.executable, "-m", "leantune.cli.main", "sft", *common, "--output_dir",
                                str(killed)], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoint-2" / "trainer_state.json").exists() and process.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / f"checkpoint-{steps}").exists(), "the run finished before it could be killed"

    capsys.readouterr()
    assert main(["sft", *common, "--output_dir", str(killed)]) == 2  # in this process: a real one costs an import
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err
    resumed = leantune("sft", *common, "--output_dir", str(killed), "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    expected, got = _losses(whole / f"checkpoint-{steps}"), _losses(killed / f"checkpoint-{steps}")
    assert sorted(got) == list(range(1, steps + 1))
    # Same process layout, same data order, same restored RNG and optimizer states: the same float operations in
    # the same order, so equal to rounding (1e-6 relative allows a different OpenMP reduction split, nothing more).
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6), step


@pytest.mark.slow
def test_overwrite_output_dir_starts_over_and_resume_from_a_path(local_model_and_data, tmp_path, capsys):
    """The runs go through the command's own main() in this process (a real process costs an import each; the
    kill -9 test above and test_a_real_process_exits_2_without_traceback_and_debug_shows_it launch real ones)."""
    from leantune.cli.main import main

    model_dir, data_file = local_model_and_data
    common = ["sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--max_length", "32",
              "--per_device_train_batch_size", "2", "--save_steps", "2", "--logging_steps", "1", "--report_to",
              "none", "--disable_tqdm", "true", "--memory_breakdown", "false"]
    out = tmp_path / "out"
    assert main([*common, "--max_steps", "4", "--output_dir", str(out)]) == 0
    assert main([*common, "--max_steps", "2", "--output_dir", str(out), "--overwrite_output_dir", "true"]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # the earlier run's are gone
    other = tmp_path / "other"
    capsys.readouterr()
    assert main([*common, "--max_steps", "4", "--output_dir", str(other), "--resume_from_checkpoint",
                 str(out / "checkpoint-2")]) == 0
    assert f"resumed from {out / 'checkpoint-2'}" in capsys.readouterr().out
    assert _losses(other / "checkpoint-4").keys() == {1, 2, 3, 4}


def test_dataset_streaming_trains_like_the_same_file_read_whole(local_model_and_data, tmp_path, capsys):
    """--dataset_streaming reads the file as a stream: the same rows in the same order give the same per-step losses
    (the same tokens through the same computation; 1e-6 relative leaves room only for thread-count rounding)."""
    from leantune.cli.main import main

    model_dir, data_file = local_model_and_data
    common = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--max_steps", "3",
              "--per_device_train_batch_size", "2", "--max_length", "64", "--logging_steps", "1",
              "--report_to", "none", "--train_sampling_strategy", "sequential", "--save_steps", "3"]
    losses = {}
    for streaming in ("false", "true"):
        out = tmp_path / f"out-{streaming}"
        assert main(["sft", *common, "--output_dir", str(out), "--dataset_streaming", streaming]) == 0
        losses[streaming] = [entry["loss"] for entry in _log_history(out) if "loss" in entry]
    assert len(losses["true"]) == 3
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-6)
    # a stream has no length: without --max_steps the run stops before loading anything, naming the flag
    capsys.readouterr()
    assert main(["sft", *common[:4], "--output_dir", str(tmp_path / "x"), "--dataset_streaming", "true"]) == 2
    assert "--max_steps" in capsys.readouterr().err


def _log_history(output_dir) -> list[dict]:
    import glob

    states = sorted(glob.glob(str(output_dir / "**" / "trainer_state.json"), recursive=True))
    if states:
        return json.loads(open(states[-1]).read())["log_history"]
    raise AssertionError(f"no trainer_state.json under {output_dir}")
