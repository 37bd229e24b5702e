"""`leantune ppo`: Proximal Policy Optimization with a value function; with no model and no dataset, the built-in
demo run.

    leantune ppo --model_name_or_path MODEL --dataset_name DATA --reward_funcs correct_answer [--<PPOConfig field> ...]

--reward_funcs takes reward functions or a reward model (id or folder), as TRL's `reward_model`. The run is every
training command's (runner.py); the demo is shared with the other online commands (online_runs.py).
"""

from __future__ import annotations

from .runner import run_method


def run(argv: list[str]) -> int:
    return run_method("ppo", argv)
