"""Faults of multi-process CPU runs: a stuck process, a killed process, a full disk, two "nodes" on one machine.

- A process that stops answering: the others fail after `ddp_timeout` with one clear error (trainers/parts/distributed.py
  starts the gloo group with it; transformers dropped it on CPU, so they waited torch's default 30 minutes).
- A full disk on one node, or a checkpoint that one node cannot read at resume: every process stops at once with
  the same line (the processes agree on a save's outcome and on the checkpoint to resume: parts/saving.py).
- `torchrun --max-restarts 1` on two nodes with `leantune sft --resume_from_checkpoint true`: the first attempt
  starts fresh (no checkpoint yet), a rank killed with SIGKILL mid-run is restarted by its launcher and the other
  node's process by its own, and they resume from the last complete checkpoint; the per-step losses equal an
  uninterrupted run's to 1e-6 relative (the same ranks, data order, restored RNG and optimizer states: the same fp32
  operations, only an OpenMP split may differ).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..fixtures.launchers import (
    LAUNCH_VARIABLES,
    LEANTUNE,
    cpu_only,
    free_port,
    launch,
    launch_as_nodes,
    saved_launch_assets,
    small_disk,
)
from ..fixtures.paths import SCRIPTS

REL = 1e-6


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir, gsm8k_rows):
    """test_launch.py's saved model and data."""
    return saved_launch_assets(tmp_path_factory.mktemp("launch"), tokenizer_dir, gsm8k_rows)

pytestmark = [cpu_only, pytest.mark.slow]


def test_a_stuck_process_fails_the_others_after_ddp_timeout(assets):
    out, timeout = assets.root / "stall", 10
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
               str(SCRIPTS / "stall_rank.py"), str(out), assets.model, assets.data, "1", "2", str(timeout)]
    run, _ = launch(command, timeout=240)  # without the fix process 0 waits 30 minutes: this times out
    ended = time.time()
    assert run.returncode != 0
    waited = ended - float((out / "stalled_at").read_text())
    assert "Process 0 of 2 waited more than ddp_timeout=10 s for the other processes" in run.stderr, \
        run.stderr[-3000:]
    # the timeout, then torchrun stopping the stuck process (a few seconds on a loaded 2-core machine)
    assert timeout <= waited < timeout + 45, waited


def test_a_full_disk_or_a_checkpoint_another_node_cannot_read_stops_every_process_in_one_line(assets, tmp_path):
    """Two "nodes" of one process each, each on its own disk (its working folder; --output_dir is relative).
    1. With save_on_each_node, node 0's disk (an 80 MiB tmpfs) holds one checkpoint, not two: both processes stop
       at checkpoint-2 with node 0's no-room line (process 1 used to wait for the lost process 0 and fail with
       another error), and node 1's own checkpoint-1 holds the weights (transformers wrote them on process 0 alone).
    2. Resumed without save_on_each_node beside a node whose disk has no checkpoint: both stop with one line naming
       save_on_each_node (that process used to fail alone and the other to wait for it)."""
    command = [LEANTUNE, "sft", "--model_name_or_path", assets.model, "--dataset_name", assets.data, "--max_length",
               "32", "--per_device_train_batch_size", "2", "--max_steps", "3", "--save_steps", "1", "--report_to",
               "none", "--disable_tqdm", "true", "--memory_breakdown", "false", "--output_dir", "out",
               "--ddp_timeout", "300"]
    node1, node2 = tmp_path / "node1", tmp_path / "node2"
    node1.mkdir(), node2.mkdir()
    with small_disk(tmp_path / "node0", 80) as node0:
        runs, _ = launch_as_nodes([*command, "--save_on_each_node", "true"], [node0, node1])
        line = last_lines(runs)
        assert line.startswith("leantune sft: error: no room to write checkpoint-2 in out: it needs about "), line
        assert sorted(os.listdir(node0 / "out")) == ["checkpoint-1"]
        assert {"model.safetensors", "config.json", "rng_state_1.pth", "trainer_state.json"} <= set(
            os.listdir(node1 / "out" / "checkpoint-1")) and not (node1 / "out" / "checkpoint-2").exists()

        runs, _ = launch_as_nodes([*command, "--resume_from_checkpoint", "true"], [node0, node2])
        line = last_lines(runs)
        assert line.startswith("leantune sft: error: resume_from_checkpoint: process 0 resumes from "
                               "out/checkpoint-1, which process(es) 1 cannot read"), line
        assert "save_on_each_node" in line


def last_lines(runs: list[subprocess.CompletedProcess]) -> str:
    """The one line every process ended with (exit 2, no traceback): the same on each."""
    for run in runs:
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = {run.stderr.strip().splitlines()[-1] for run in runs}
    assert len(lines) == 1, lines
    return lines.pop()


def cli(assets, out: Path, steps: int) -> list[str]:
    return [LEANTUNE, "sft", "--model_name_or_path", assets.model, "--dataset_name", assets.data,
            "--max_length", "32", "--per_device_train_batch_size", "2", "--max_steps", str(steps), "--save_steps", "2",
            "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--memory_breakdown", "false",
            "--learning_rate", "1e-3", "--output_dir", str(out), "--resume_from_checkpoint", "true"]


def losses(checkpoint: Path) -> dict[int, float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def assert_same_losses(got: dict, expected: dict, steps: int) -> None:
    assert sorted(got) == sorted(expected) == list(range(1, steps + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=REL), step


def worker_of(launcher: subprocess.Popen, local_rank: int, deadline: float):
    """The worker process torchrun started with LOCAL_RANK=local_rank."""
    import psutil

    while time.time() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("LOCAL_RANK") == str(local_rank):
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.2)
    raise AssertionError("torchrun's worker did not start")


def start(command: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("ACCELERATE_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen, timeout: int = 300) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import psutil

        for worker in psutil.Process(process.pid).children(recursive=True):  # torchrun's workers: sessions of their own
            worker.kill()
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def kill_after_checkpoint(launcher: subprocess.Popen, out: Path, step: int, local_rank: int = 1) -> None:
    """SIGKILL the launcher's worker `local_rank` once checkpoint-`step` is complete (mid-run)."""
    deadline = time.time() + 240
    worker = worker_of(launcher, local_rank, deadline)
    while not (out / f"checkpoint-{step}" / "trainer_state.json").exists():
        assert launcher.poll() is None and time.time() < deadline, "the run ended before the checkpoint"
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)


def torchrun(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *flags]


STEPS = 16


@pytest.fixture(scope="module")
def uninterrupted(assets):
    out = assets.root / "whole"
    run, _ = launch(torchrun("--nproc_per_node", "2", "--master_port", free_port(), *cli(assets, out, STEPS)))
    assert run.returncode == 0, run.stderr[-3000:]
    return losses(out / f"checkpoint-{STEPS}")


def test_torchrun_max_restarts_on_two_nodes_resumes_a_killed_rank_from_the_last_checkpoint(assets, uninterrupted):
    """Two "nodes" of one process each (two torchrun launchers, --nnodes 2) on one machine: the rank of node 1 is
    killed mid-run; its launcher restarts it, node 0's process loses its peer and is restarted by its own, and both
    resume from the last complete checkpoint: every step's loss is the uninterrupted 2-process run's."""
    out, port = assets.root / "restarted", free_port()
    launchers = [start(torchrun("--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr",
                                "127.0.0.1", "--master_port", port, "--max-restarts", "1", *cli(assets, out, STEPS)))
                 for node in (0, 1)]
    kill_after_checkpoint(launchers[1], out, 4, local_rank=0)
    runs = [finish(launcher) for launcher in launchers]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert "Resuming from the latest checkpoint" in runs[0].stderr, runs[0].stderr[-3000:]
    assert_same_losses(losses(out / f"checkpoint-{STEPS}"), uninterrupted, STEPS)
