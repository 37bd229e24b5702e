"""`leantune grpo`: Group Relative Policy Optimization; with no model and no dataset, the built-in demo run.

    leantune grpo --model_name_or_path MODEL --dataset_name DATA --reward_funcs correct_answer [--<GRPOConfig field> ...]

The demo and the run on given data are shared with the other online command (online_runs.py).
"""

from __future__ import annotations

from .online_runs import run_online


def run(argv: list[str]) -> int:
    from ..trainers.grpo_config import GRPOConfig
    from ..trainers.grpo_trainer import GRPOTrainer

    return run_online("grpo", GRPOConfig, GRPOTrainer, argv)
