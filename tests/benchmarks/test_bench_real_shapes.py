"""bench/real_shapes.py end to end on a tiny shape, so the script cannot rot: run as its command lines (both libraries
really train, in the script's own process), both are planned, the JSON holds what docs/benchmarks.md's table reads,
and the losses agree. Its search and its FLOPs count are devkit's, checked here directly."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from devkit.longest_fitting import longest_fitting
from devkit.model_flops import model_flops
from devkit.qwen2_shape import qwen2_config

from ..fixtures.paths import REPO, SCRIPTS

TINY = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
        "--vocab", "1000"]
MAIN_PATH = [*TINY, "--lengths", "64", "--in-process", "--no-longest", "--matmul-size", "256", "--matmul-repeats", "2"]
OVER_THE_CAP = [*TINY, "--lengths", "64", "--in-process", "--no-longest", "--cap-gib", "0.000001", "--libraries",
                "leantune", "--matmul-size", "128"]


@pytest.fixture(scope="module")
def real_shapes_runs(tokenizer_dir, tmp_path_factory):
    """`python bench/real_shapes.py ARGS --out FILE` for each case below, run in one subprocess (tests/scripts/
    command_lines.py: the imports once, as the in-process runs before did): {case: (exit code, FILE, output)}."""
    folder = tmp_path_factory.mktemp("real_shapes")
    cases = {"main_path": MAIN_PATH, "over_the_cap": OVER_THE_CAP}
    outs = {case: folder / f"{case}.json" for case in cases}
    command_lines = [[*args, "--out", str(outs[case])] for case, args in cases.items()]
    env = {**os.environ, "LEANTUNE_SHARED": str(tokenizer_dir.parents[1]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(SCRIPTS / "command_lines.py"), str(REPO / "bench" / "real_shapes.py"),
                           json.dumps(command_lines)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    output = (done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0, output
    codes = json.loads(done.stdout.strip().splitlines()[-1])["exit_codes"]
    return {case: (code, outs[case], output) for case, code in zip(cases, codes)}


def test_real_shapes_main_path_tiny(real_shapes_runs):
    code, out, output = real_shapes_runs["main_path"]
    assert code == 0, output
    report = json.loads(out.read_text())
    assert report["matmul_gflops"] > 0
    for library in ("leantune", "trl"):
        run = report["runs"][f"{library}:64"]
        assert run["tokens_per_step"] == [64, 64]  # one row of 64 ids a step, nothing added or cut
        assert run["peak_mib"] > 0 and run["peak_rss_mib"] > run["peak_mib"] and run["tokens_per_s"] > 0
        assert report["plans"][library]["64"] > 0
        assert len(run["losses"]) == 2
    # leantune's planner traces its own step: it matches the measured meter (docs/plan.md: to the byte; 2% allowed)
    planned = report["plans"]["leantune"]["64"] / 2**20
    assert abs(planned - report["runs"]["leantune:64"]["peak_mib"]) <= 0.02 * planned
    (row,) = report["summary"]
    assert row["length"] == 64 and row["leantune"]["measured"] and row["trl"]["measured"]
    assert 0 < row["leantune"]["mfu"] < 1 and 0 < row["trl"]["mfu"] < 1
    # The same model, rows and AdamW steps, loss on every token: the per-step losses (about ln 1000 = 6.9) agree. Each
    # is a mean of 63 log-softmaxes over 1,000 logits in fp32 (relative rounding 6e-8 per op); summed in another
    # order (leantune's chunks, TRL's tiles) they may differ by ~1e-6 relative, and a second step adds what one
    # AdamW step at lr 1e-5 carries of that: 1e-5 leaves 10x room and still catches any other loss (a shifted label,
    # a dropped token: ~1e-2).
    assert row["loss_max_rel_diff"] < 1e-5
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(report["runs"]["leantune:64"]["losses"],
                                                                   report["runs"]["trl:64"]["losses"]))


def test_real_shapes_skips_a_run_predicted_over_the_cap(real_shapes_runs):
    code, out, output = real_shapes_runs["over_the_cap"]
    assert code == 0, output
    report = json.loads(out.read_text())
    assert report["runs"]["leantune:64"]["skipped"].startswith("predicted, not run")
    assert report["summary"][0]["leantune"]["measured"] is False


def test_longest_fitting_finds_the_last_length_under_the_budget():
    probed = []

    def linear(length):  # 8 GiB of states + 200 kB a token (a leantune-like line)
        probed.append(length)
        return 8 * 2**30 + 200_000 * length

    length, peak = longest_fitting(linear, 24 * 2**30, 8192)
    assert length % 256 == 0 and peak <= 24 * 2**30 < linear(length + 256)
    assert len(probed) <= 6  # a line is found in a few traced steps, not a bisection's dozen
    assert longest_fitting(linear, 2**30, 8192) == (0, 0)  # not even 256 tokens fit


def test_model_flops_counts_qwen_0_5b():
    config = qwen2_config()  # the bench's default shape (its flags default to devkit.qwen2_shape.QWEN25_05B)
    flops = model_flops(config, 1024)
    # Qwen2.5-0.5B: 494,032,768 parameters, of which 136,134,656 are the (tied) embedding
    assert flops["non_embedding_parameters"] == 494_032_768 - 151_936 * 896
    assert flops["dense"] == 6 * flops["non_embedding_parameters"] * 1024
    assert flops["head"] == 6 * 896 * 151_936 * 1024
