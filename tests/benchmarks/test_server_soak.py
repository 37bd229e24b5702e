"""bench/server_soak.py in its quick mode (a few seconds, 20 authenticated and 8 hostile clients), run as its
command line: the server it starts as the README says answers every authenticated request, refuses every attack,
serves the last complete weight update (its greedy log-probs equal a local copy's with those weights, and differ
from the update before), keeps its threads bounded, and exits cleanly without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..fixtures.paths import REPO


@pytest.mark.slow
def test_the_quick_soak_keeps_its_invariants(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "bench/server_soak.py", "--quick", "--json", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["served"] > 0 and result["unanswered"] == 0
    assert result["updates_committed"] > 0 and result["weights_gap"] <= 1e-5 < result["previous_gap"]
    assert set(result["attacks"]) == {"trickle", "huge_length", "two_lengths", "foreign_host", "foreign_origin",
                                      "page_close", "no_token", "half_update"}
    assert not result["attacks_accepted"]
    assert result["threads_max"] < 64 and not result["traceback_in_log"]
