"""Faults of multi-process CPU runs under torchrun: a process that stops answering makes the others fail after
`ddp_timeout` with one clear error (trainers/distributed.py starts the gloo group with it; transformers dropped it on
CPU, so they waited torch's default 30 minutes)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from .conftest import tiny_model
from .test_launch import cpu_only, free_port, launch

SCRIPTS = Path(__file__).parent / "scripts"
REL = 1e-6

pytestmark = [cpu_only, pytest.mark.slow]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir, gsm8k_rows):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("faults")
    tiny_model().save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(root / "model")
    with open(root / "data.jsonl", "w", encoding="utf-8") as handle:
        for row in gsm8k_rows[:64]:
            handle.write(json.dumps({"prompt": row["question"], "completion": " " + row["answer"]}) + "\n")
    return SimpleNamespace(root=root, model=str(root / "model"), data=str(root / "data.jsonl"))


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
