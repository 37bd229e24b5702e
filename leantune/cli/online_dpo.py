"""`leantune online-dpo`: Online DPO; with no model and no dataset, the built-in demo run.

    leantune online-dpo --model_name_or_path MODEL --dataset_name DATA --reward_funcs correct_answer \
        [--<OnlineDPOConfig field> ...]

The run is every training command's (runner.py); the demo is the online commands' (online_runs.py).
"""

from __future__ import annotations

from .runner import run_method


def run(argv: list[str]) -> int:
    return run_method("online-dpo", argv)
