"""`leantune grpo`: Group Relative Policy Optimization; with no model and no dataset, the built-in demo run.

    leantune grpo --model_name_or_path MODEL --dataset_name DATA --reward_funcs correct_answer [--<GRPOConfig field> ...]
"""

from __future__ import annotations

from .online_runs import run_online

# The demo: from the SFT warm-up of a random-init 0.54M-parameter Llama, 200 optimizer steps of 16 prompts x 8
# completions each (one epoch of 3,200 bundled prompts), reward = the checked answer + characters in place.
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
    from ..trainers.grpo_config import GRPOConfig
    from ..trainers.grpo_trainer import GRPOTrainer

    return run_online("grpo", GRPOConfig, GRPOTrainer, DEMO_TRAINING, argv)
