"""bench/long_context_plan.py on a tiny shape, so the script cannot rot: its CPU path runs as its command line (both
libraries predicted, TRL's step traced with its activation-offloading hooks running, the longest-length search), and
the ratios it prints are the quotients of the numbers it reports."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from leantune.memory.checkpoint_offload import unsupported_by_transformers

from ..fixtures.paths import REPO

SCRIPT = REPO / "bench" / "long_context_plan.py"
TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "1000"]


def bench_module():
    spec = importlib.util.spec_from_file_location("long_context_plan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.quick
def test_activation_memory_and_ratios_are_the_quotients_of_the_reported_bytes():
    bench = bench_module()
    parts = {"parameters": 100, "buffers": 1, "gradients": 40, "optimizer_states": 200, "activations": 7,
             "temporaries": 50}
    assert bench.activation_bytes(1000, parts) == 1000 - 100 - 1 - 40 - 200
    report = {"at_length": {"leantune": {"peak_bytes": 600, "activation_bytes": 30},
                            "trl": {"peak_bytes": 800, "activation_bytes": 100}},
              "longest": {"leantune": {"length": 40960}, "trl": {"length": 8192}}}
    summary = bench.summarise(report)
    assert summary["peak_ratio"] == 600 / 800 and summary["activation_ratio"] == 30 / 100
    assert summary["activation_target_met"] and summary["longest_ratio"] == 5.0 and summary["longest_target_met"]
    report["at_length"]["leantune"]["activation_bytes"] = 41  # 0.41 > 0.4
    report["longest"]["trl"]["length"] = 10241  # 40960 / 10241 < 4
    summary = bench.summarise(report)
    assert not summary["activation_target_met"] and not summary["longest_target_met"]


@pytest.mark.skipif(unsupported_by_transformers() is not None,
                    reason="the bench's leantune side offloads checkpointed inputs, refused on this transformers")
def test_long_context_plan_cpu_path_tiny(tokenizer_dir, tmp_path):
    out = tmp_path / "long_context_plan.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--length", "256", "--device", "cpu", "--budget",
                           "40MiB", "--host-memory", "1GiB", "--longest-step", "64", "--longest-limit", "1024",
                           "--tokenizer", str(tokenizer_dir), "--out", str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads(out.read_text())
    for library in ("leantune", "trl"):
        found = report["at_length"][library]
        states = sum(found["parts"].get(name, 0) for name in ("parameters", "buffers", "gradients", "optimizer_states"))
        assert found["peak_bytes"] > states > 0
        assert found["activation_bytes"] == found["peak_bytes"] - states
        assert 0 < report["longest"][library]["length"] <= 1024
    trl = report["at_length"]["trl"]
    # TRL's hooks ran: its saved tensors went to the (meta) host, counted by the ledger and by the meter alike, and
    # the ledger's pinned bytes round each copy up to a power of two
    assert trl["host_raw_bytes"] > 0 and trl["host_raw_bytes"] == trl["host_meter_bytes"]
    assert trl["host_bytes"] >= trl["host_raw_bytes"]
    assert trl["how"].startswith("traced whole")  # 2 layers: no extrapolation
    summary = report["summary"]
    assert summary["activation_ratio"] == report["at_length"]["leantune"]["activation_bytes"] / trl["activation_bytes"]
    assert summary["longest_ratio"] == report["longest"]["leantune"]["length"] / report["longest"]["trl"]["length"]
    assert "activation memory, leantune / TRL" in done.stdout and "longest length, leantune / TRL" in done.stdout
