"""A new user's first hour (issue 27, section 3): each rough edge they meet, as they meet it."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from ..fixtures.commands import leantune
from ..fixtures.models import saved_model_and_data, tiny_model
from ..fixtures.tokenizers import load_tokenizer


@pytest.fixture
def model_and_data(tmp_path, tokenizer, gsm8k_rows):
    return saved_model_and_data(tmp_path, tokenizer, gsm8k_rows[:16])


def _one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith(f"leantune {command}: error:")]
    assert len(errors) == 1 and "Traceback" not in captured.err + captured.out, captured.err[-3000:]
    return errors[0]


# --- a missing optional package: one line naming the flag and the pip install, before any model loads --------------


def test_missing_tensorboard_is_one_line_and_exit_2_in_a_real_process(tmp_path):
    assert importlib.util.find_spec("tensorboard") is None, "this test needs tensorboard not installed"
    result = leantune("sft", "--report_to", "tensorboard", "--max_steps", "1", "--output_dir", str(tmp_path / "o"),
                      cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("leantune sft: error: --report_to tensorboard") and "pip install tensorboard" in last
    assert not (tmp_path / "o").exists()  # found before the demo's model was built or trained


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_missing_tracker_is_named_before_the_model_loads(tracker, model_and_data, tmp_path, capsys):
    from leantune.cli.main import main

    assert importlib.util.find_spec(tracker) is None, f"this test needs {tracker} not installed"
    model_dir, data_file = model_and_data
    assert main(["sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--output_dir",
                 str(tmp_path / "o"), "--report_to", tracker, "--max_steps", "1"]) == 2
    line = _one_error_line(capsys, "sft")
    assert f"--report_to {tracker}" in line and f"pip install {tracker}" in line
    assert not (tmp_path / "o").exists()


# --- data files -------------------------------------------------------------------------------------------------------


def test_blank_jsonl_lines_are_counted_and_logged(tmp_path, caplog):
    from leantune.data.loading import load_dataset_source

    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n   \n{"text": "c"}\n')
    with caplog.at_level(logging.WARNING, logger="leantune.data"):
        data = load_dataset_source(str(path))
    assert data["train"]["text"] == ["a", "b", "c"]
    assert f"{path}: skipped 2 blank line(s) (line 2, 4)" in caplog.text
    caplog.clear()
    array = tmp_path / "rows.json"  # a JSON array's blank lines are layout, not skipped rows
    array.write_text('[\n{"text": "a"},\n\n{"text": "b"}\n]\n')
    with caplog.at_level(logging.WARNING, logger="leantune.data"):
        assert load_dataset_source(str(array))["train"]["text"] == ["a", "b"]
    assert "blank line" not in caplog.text


def test_a_missing_data_file_names_the_flag(model_and_data, tmp_path, capsys):
    from leantune.cli.main import main

    model_dir, _ = model_and_data
    missing = tmp_path / "no-such.jsonl"
    assert main(["sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(missing), "--output_dir",
                 str(tmp_path / "o"), "--report_to", "none"]) == 2
    line = _one_error_line(capsys, "sft")
    assert f"--dataset_name {missing}:" in line


# --- --help says what leantune does with transformers' fields ---------------------------------------------------------


@pytest.mark.quick  # enters cli/help_render.py whatever the user's --help cache holds
def test_help_of_output_dir_and_resume_is_leantunes_own():
    from leantune.cli.help_render import render_help  # the live rendering (the user's --help cache keeps it)

    text = " ".join(render_help("sft").split())
    resume = text[text.index("--resume_from_checkpoint VALUE"):][:300]
    assert "Not directly used by Trainer" not in resume
    assert "true (or latest) resumes from the latest complete checkpoint-N in --output_dir" in resume
    output = text[text.index("--output_dir VALUE"):][:400]
    assert "trainer_output" in output and "leantune-output/<command>-demo" in output


# --- a CPU training run's own output: step-numbered log lines, no pin_memory warnings ---------------------------------


@pytest.fixture(scope="module")
def cpu_run_output(tmp_path_factory):
    """Two logged steps of SFT on this machine (no accelerator), as a user runs it: stdout and the warnings."""
    import contextlib
    import io
    import warnings

    import torch

    from leantune import SFTConfig, SFTTrainer

    from ..fixtures.data import gsm8k_prompt_completion, gsm8k_rows
    from ..fixtures.paths import TOKENIZER_DIR

    if torch.cuda.is_available():
        pytest.skip("the run must be on a machine without an accelerator")
    rows = gsm8k_rows(8)
    args = SFTConfig(output_dir=str(tmp_path_factory.mktemp("cpu-run")), report_to=[], save_strategy="no",
                     max_steps=2, logging_steps=1, per_device_train_batch_size=2, max_length=64, disable_tqdm=False)
    trainer = SFTTrainer(model=tiny_model(), args=args, train_dataset=gsm8k_prompt_completion(rows, 8),
                         processing_class=load_tokenizer(TOKENIZER_DIR))
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        trainer.train()
    return trainer, out.getvalue(), [str(w.message) for w in caught]


def test_a_cpu_run_does_not_warn_about_pin_memory(cpu_run_output):
    trainer, _, caught = cpu_run_output
    assert not [m for m in caught if "pin_memory" in m], caught
    assert trainer.args.dataloader_pin_memory is False


def test_training_log_lines_start_with_the_step(cpu_run_output):
    _, printed, _ = cpu_run_output
    lines = [line.strip() for line in printed.splitlines() if "loss" in line]
    assert any(line.startswith("step 1/2 | loss ") for line in lines), printed
    assert any(line.startswith("step 2/2 | loss ") for line in lines), printed
    assert not any(line.startswith("{") for line in lines), printed


# --- data that leaves nothing to train on: one clear error, not a missing internal column ----------------------------


@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "RLOOTrainer"])
def test_an_empty_prompt_dataset_is_a_clear_error(trainer_name):
    from datasets import Dataset

    import leantune
    from leantune.defaults import build_default_tokenizer

    from ..fixtures.data import count_a
    from ..fixtures.models import char_model
    from ..fixtures.online_rounds import grpo_config as config

    tokenizer = build_default_tokenizer()
    trainer_class = getattr(leantune, trainer_name)
    config_class = getattr(leantune, trainer_name.replace("Trainer", "Config"))
    with pytest.raises(ValueError, match=r"The train dataset is empty \(0 rows\)"):
        trainer_class(char_model(tokenizer), count_a, args=config(config_class), processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"prompt": []}))


def test_kto_on_pairs_that_are_all_identical_is_one_line(model_and_data, tmp_path, capsys):
    from leantune.cli.main import main

    model_dir, _ = model_and_data
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}?", "chosen": " Same.", "rejected": " Same."}) + "\n"
                             for i in range(4)))
    assert main(["kto", "--model_name_or_path", str(model_dir), "--dataset_name", str(pairs), "--output_dir",
                 str(tmp_path / "o"), "--report_to", "none", "--max_steps", "1"]) == 2
    line = _one_error_line(capsys, "kto")
    assert "No train example is left" in line
    assert "of 4 row(s), dropped 4 pair(s) whose chosen and rejected are identical" in line


def test_dpo_counts_pairs_made_identical_by_truncation_apart(tokenizer):
    from datasets import Dataset

    from leantune import DPOConfig
    from leantune.data.preference_preparation import prepare_preference_dataset

    data = Dataset.from_list([
        {"prompt": "Q:", "chosen": " the same long start then yes", "rejected": " the same long start then no"},
        {"prompt": "Q:", "chosen": " Same.", "rejected": " Same."},  # identical in the data
        {"prompt": "Q:", "chosen": " yes", "rejected": " no"},
    ])
    args = DPOConfig(output_dir="unused", use_cpu=True, report_to=[], max_length=6, truncation_mode="keep_start")
    kept, report = prepare_preference_dataset(data, tokenizer, args)
    assert (report.num_identical_dropped, report.num_identical_after_truncation_dropped, len(kept)) == (1, 1, 1)
    with pytest.raises(ValueError, match="No train pair is left after preparation: of 1 pair"):
        prepare_preference_dataset(data.select([1]), tokenizer, args)  # was: Column '__prompt_too_long__' ...


# --- `leantune plan` on a machine without a GPU ------------------------------------------------------------------------


def test_plan_without_a_gpu_plans_for_the_cpu_times_all_of_it_and_logs_the_data_once(model_and_data, capsys, caplog):
    import re
    import time

    import torch

    from leantune.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    model_dir, data_file = model_and_data
    started = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="leantune"):
        assert main(["plan", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file),
                     "--max_length", "64", "--per_device_train_batch_size", "4", "--memory_budget", "8GiB"]) == 0
    wall = time.perf_counter() - started
    out = capsys.readouterr().out
    assert "this machine's CPU" in out and "beyond the traced tensors" not in out, out  # no CUDA context term
    assert "none fits" not in out and "recommended" in out, out
    timings = re.findall(r"^planned in ([0-9.]+) s$", out, re.M)
    assert len(timings) == 1 and out.strip().splitlines()[-1].startswith("planned in"), out
    # the whole command, not only the first plan: within the wall time measured here, and most of it
    assert 0.8 * wall <= float(timings[0]) <= wall + 0.1, (timings, wall)
    summaries = [r for r in caplog.records if r.name == "leantune.data" and r.getMessage().startswith("train data:")]
    assert len(summaries) == 1, [r.getMessage() for r in summaries]  # the search prepared it again: shown once
