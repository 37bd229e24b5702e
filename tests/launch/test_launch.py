"""Multi-process launches on CPU (no GPU) train in all their processes or stop with the command that works; nothing
runs as independent duplicates. Real launchers (torchrun, accelerate launch) start real processes here.

The per-step losses of 2 processes x 2 rows must equal those of 1 process x 4 rows (the same global batch: the
processes take consecutive batches of the one sampler) to 1e-6 relative: the loss is one sum over the step's
target tokens divided by their count, only summed in another order (two partial fp32 sums, all-reduced over gloo),
and fp32 rounding of ~10-sized sums of ~100 terms stays ~1e-7 relative; a wrong batch or a lost process would
differ by ~1e-3 or more."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from leantune.trainers.parts import distributed

from ..fixtures.launchers import (
    LAUNCH_VARIABLES,
    LEANTUNE,
    accelerate_launch,
    cpu_only,
    launch,
    saved_launch_assets,
    torchrun,
)
from ..fixtures.models import tiny_model
from ..fixtures.paths import SCRIPTS

SCRIPT = SCRIPTS / "sft_launch.py"
REL = 1e-6


def assert_same_losses(got: list[float], expected: list[float]) -> float:
    assert len(got) == len(expected) == 3
    worst = max(abs(g - e) / abs(e) for g, e in zip(got, expected))
    assert worst <= REL, (got, expected)
    return worst


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir, gsm8k_rows):
    return saved_launch_assets(tmp_path_factory.mktemp("launch"), tokenizer_dir, gsm8k_rows)


def script_args(assets, out: Path, batch_size: int) -> list[str]:
    return [str(SCRIPT), str(out), assets.model, assets.data, str(batch_size)]


def ranks_of(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.fixture(scope="module")
def one_process_losses(assets):
    out = assets.root / "api-one-process"
    run, _ = launch([sys.executable, *script_args(assets, out, 4)])
    assert run.returncode == 0, run.stderr[-3000:]
    (rank,) = ranks_of(out)
    assert rank["world"] == 1
    return rank["losses"]


def check_two_processes(run, out: Path, reference: list[float]) -> float:
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = ranks_of(out)
    # Duplicates would each be process 0 of a world of 1, and write rank0.json twice.
    assert [p.name for p in sorted(out.glob("rank*.json"))] == ["rank0.json", "rank1.json"]
    assert all(r["world"] == 2 and r["backend"] == "gloo" for r in ranks)
    assert [r["should_save"] for r in ranks] == [True, False]  # only process 0 writes the output_dir
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert (out / "run" / "model.safetensors").exists()
    return assert_same_losses(ranks[0]["losses"], reference)


@pytest.mark.slow
@cpu_only
def test_torchrun_of_an_api_script_trains_in_two_processes(assets, one_process_losses):
    out = assets.root / "api-torchrun"
    run, seconds = launch(torchrun(*script_args(assets, out, 2)))
    worst = check_two_processes(run, out, one_process_losses)
    print(f"torchrun: worst relative loss difference {worst:.1e}, {seconds:.0f} s")


@pytest.mark.slow
@cpu_only
def test_accelerate_launch_multi_gpu_flag_on_cpu_trains_in_two_processes(assets, one_process_losses):
    # --multi_gpu is accelerate's flag for its torchrun launcher; without a GPU the processes train on CPU (gloo).
    out = assets.root / "api-accelerate"
    run, seconds = launch([*accelerate_launch("--multi_gpu"), *script_args(assets, out, 2)])
    worst = check_two_processes(run, out, one_process_losses)
    print(f"accelerate launch --multi_gpu: worst relative loss difference {worst:.1e}, {seconds:.0f} s")


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("flags", [["--cpu"], []], ids=["cpu", "plain"])
def test_accelerate_launch_that_starts_one_process_stops_before_loading(assets, flags):
    # accelerate's launcher starts a single process for `--num_processes 2` without a GPU (with or without --cpu).
    out = assets.root / f"api-accelerate-one-{len(flags)}"
    run, seconds = launch([*accelerate_launch(*flags), *script_args(assets, out, 2)])
    assert run.returncode != 0
    message = [line for line in run.stderr.splitlines() if line.startswith("ValueError: ")]
    assert len(message) == 1 and "started only this one process" in message[0], run.stderr[-3000:]
    assert "torchrun --nproc_per_node N" in message[0] and "accelerate launch --multi_gpu" in message[0]
    assert "Loading weights" not in run.stderr + run.stdout and not out.exists()  # the config stopped it


# --- the command line --------------------------------------------------------------------------------------------


def cli_args(assets, out: Path, batch_size: int) -> list[str]:
    # save_strategy steps: the checkpoint's trainer_state.json keeps the losses unrounded (written by process 0).
    return [LEANTUNE, "sft", "--model_name_or_path", assets.model, "--dataset_name", assets.data, "--output_dir",
            str(out), "--per_device_train_batch_size", str(batch_size), "--max_steps", "3", "--max_length", "64",
            "--logging_steps", "1", "--learning_rate", "1e-3", "--seed", "0", "--report_to", "none",
            "--save_strategy", "steps", "--save_steps", "3", "--memory_breakdown", "false"]


def checkpoint_losses(out: Path) -> list[float]:
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-3"]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    return [e["loss"] for e in state["log_history"] if "loss" in e]


@pytest.mark.slow
@cpu_only
def test_torchrun_of_the_cli_trains_in_two_processes(assets):
    # Without gradient checkpointing (the API tests keep its default, on): transformers then builds DDP with
    # find_unused_parameters=True, under which the chunked loss's head gradient, formed outside the model's forward,
    # used to fail step 1 ("Expected to mark a variable ready only once"; OutputHead.capture_hidden_states).
    no_checkpointing = ["--gradient_checkpointing", "false"]
    reference, _ = launch(cli_args(assets, assets.root / "cli-one-process", 4) + no_checkpointing)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = assets.root / "cli-torchrun"
    run, seconds = launch(torchrun(*cli_args(assets, out, 2), *no_checkpointing))
    assert run.returncode == 0, run.stderr[-3000:]
    # logged once, by process 0: both processes joined one run
    assert (run.stdout + run.stderr).count("2 processes launched on a machine without a GPU: they train together") == 1
    assert run.stdout.count("=== leantune sft summary ===") == 1  # printed by the main process only
    worst = assert_same_losses(checkpoint_losses(out), checkpoint_losses(assets.root / "cli-one-process"))
    print(f"torchrun leantune sft: worst relative loss difference {worst:.1e}, {seconds:.0f} s")


@pytest.mark.slow
@cpu_only
def test_accelerate_launch_cpu_of_the_cli_stops_with_the_command_that_works(assets):
    out = assets.root / "cli-accelerate-cpu"
    run, _ = launch([*accelerate_launch("--cpu"), LEANTUNE, *cli_args(assets, out, 2)[1:]])
    # leantune exits 2 with one line; accelerate's launcher then reports the child's failure its own way (exit 1)
    assert run.returncode != 0 and run.stderr.count("leantune sft: error:") == 1
    assert "started only this one process" in run.stderr and "torchrun --nproc_per_node N" in run.stderr
    assert not out.exists()


# --- the decisions themselves (no process started) ---------------------------------------------------------------


def clean_env(monkeypatch, **values):
    monkeypatch.setattr(distributed, "has_accelerator", lambda: False)
    for name in (*LAUNCH_VARIABLES, "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_torchrun_environment_without_gpu_turns_cpu_and_gloo_on(monkeypatch):
    clean_env(monkeypatch, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1")
    args = SimpleNamespace(use_cpu=False, ddp_backend=None)
    distributed.resolve_launch(args)
    assert args.use_cpu is True and args.ddp_backend == "gloo"


def test_a_single_process_is_left_alone(monkeypatch):
    clean_env(monkeypatch)
    args = SimpleNamespace(use_cpu=False, ddp_backend=None)
    distributed.resolve_launch(args)
    assert args.use_cpu is False and args.ddp_backend is None
    clean_env(monkeypatch, ACCELERATE_USE_CPU="True")  # `accelerate launch --cpu` of one process
    distributed.resolve_launch(args)
    assert args.use_cpu is False


def test_accelerate_simple_launcher_asked_for_several_processes_raises(monkeypatch):
    clean_env(monkeypatch, ACCELERATE_USE_CPU="False", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    with pytest.raises(ValueError, match=r"torchrun --nproc_per_node N"):
        distributed.resolve_launch(SimpleNamespace(use_cpu=True, ddp_backend=None))


def test_trainer_refuses_a_state_smaller_than_the_launch(monkeypatch):
    clean_env(monkeypatch, WORLD_SIZE="2")
    with pytest.raises(ValueError, match=r"started 2 processes but the trainer's state has 1"):
        distributed.check_world_size(SimpleNamespace(world_size=1))
    distributed.check_world_size(SimpleNamespace(world_size=2))


def test_a_machine_with_a_gpu_is_left_to_accelerate(monkeypatch):
    clean_env(monkeypatch, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    monkeypatch.setattr(distributed, "has_accelerator", lambda: True)
    args = SimpleNamespace(use_cpu=False, ddp_backend=None)
    distributed.resolve_launch(args)
    assert args.use_cpu is False and args.ddp_backend is None


def test_the_trainer_checks_the_launch_before_building(monkeypatch, tmp_path, tokenizer):
    from datasets import Dataset

    from leantune import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1)  # a state of 1 process
    monkeypatch.setenv("WORLD_SIZE", "2")  # ... under a launch of 2
    with pytest.raises(ValueError, match=r"started 2 processes but the trainer's state has 1"):
        SFTTrainer(tiny_model(), args=args, train_dataset=Dataset.from_dict({"text": ["a b c"]}),
                   processing_class=tokenizer)
