"""`leantune rloo`: REINFORCE Leave-One-Out; with no model and no dataset, the built-in demo run.

    leantune rloo --model_name_or_path MODEL --dataset_name DATA --reward_funcs correct_answer [--<RLOOConfig field> ...]

The demo and the run on given data are shared with the other online command (online_runs.py).
"""

from __future__ import annotations

from .online_runs import run_online


def run(argv: list[str]) -> int:
    from ..trainers.rloo_config import RLOOConfig
    from ..trainers.rloo_trainer import RLOOTrainer

    return run_online("rloo", RLOOConfig, RLOOTrainer, argv)
