"""`leantune rloo`: REINFORCE Leave-One-Out; with no model and no dataset, the built-in demo run.

    leantune rloo --model_name_or_path MODEL --dataset_name DATA --reward_funcs correct_answer [--<RLOOConfig field> ...]
"""

from __future__ import annotations

from .online_runs import run_online

# The demo: GRPO's demo recipe (leantune/cli/grpo.py) with RLOO's objective and its default KL-in-reward
# (beta 0.05, so a frozen reference copy of the warmed-up model is scored too).
DEMO_TRAINING = {
    "learning_rate": 3e-4,
    "lr_scheduler_type": "constant",
    "per_device_train_batch_size": 128,
    "per_device_eval_batch_size": 64,
    "num_generations": 8,
    "max_completion_length": 8,
    "temperature": 1.0,
    "num_train_epochs": 1,
    "max_steps": -1,
    "logging_steps": 10,
}


def run(argv: list[str]) -> int:
    from ..trainers.rloo_config import RLOOConfig
    from ..trainers.rloo_trainer import RLOOTrainer

    return run_online("rloo", RLOOConfig, RLOOTrainer, DEMO_TRAINING, argv)
