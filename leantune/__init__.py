"""leantune: memory-efficient post-training of large language models, with TRL-compatible configs."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "SFTConfig": "leantune.trainers.sft_config",
    "SFTTrainer": "leantune.trainers.sft_trainer",
    "DPOConfig": "leantune.trainers.dpo_config",
    "DPOTrainer": "leantune.trainers.dpo_trainer",
    "pack_dataset": "leantune.data.packing",
    "CausalLMCollator": "leantune.data.collators",
    "ScriptArguments": "leantune.cli.arguments",
    "ModelConfig": "leantune.cli.arguments",
    "profile_dataset": "leantune.profiling",
    "LengthProfile": "leantune.profiling",
    "KTOConfig": "leantune.trainers.kto_config",
    "KTOTrainer": "leantune.trainers.kto_trainer",
    "RewardConfig": "leantune.trainers.reward_config",
    "RewardTrainer": "leantune.trainers.reward_trainer",
    "GRPOConfig": "leantune.trainers.grpo_config",
    "GRPOTrainer": "leantune.trainers.grpo_trainer",
    "RLOOConfig": "leantune.trainers.rloo_config",
    "RLOOTrainer": "leantune.trainers.rloo_trainer",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    """Import on first use, so `import leantune` stays fast and optional extras stay optional."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'leantune' has no attribute {name!r}")


def __dir__():
    return __all__
