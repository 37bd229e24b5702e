"""`leantune rloo`: REINFORCE Leave-One-Out; with no model and no dataset, the built-in demo run.

    leantune rloo --model_name_or_path MODEL --dataset_name DATA --reward_funcs correct_answer [--<RLOOConfig field> ...]

The run is every training command's (runner.py); the demo is shared with the other online command (online_runs.py).
"""

from __future__ import annotations

from .runner import run_method


def run(argv: list[str]) -> int:
    return run_method("rloo", argv)
