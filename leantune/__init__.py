"""leantune: memory-efficient post-training of large language models, with TRL-compatible configs."""

from __future__ import annotations

import importlib
import logging


def _drop_bitsandbytes_kernel_notice(record: logging.LogRecord) -> bool:
    """bitsandbytes warns at import, on CPUs with AVX512-BF16, that an optional inference kernel (`kernels` package)
    is missing. leantune switches that inference path off for every model it trains (models/loading.py), so the
    warning names nothing a leantune user needs; other bitsandbytes messages pass."""
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_drop_bitsandbytes_kernel_notice)

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
    "GKDConfig": "leantune.trainers.gkd_config",
    "GKDTrainer": "leantune.trainers.gkd_trainer",
    "PPOConfig": "leantune.trainers.ppo_config",
    "PPOTrainer": "leantune.trainers.ppo_trainer",
    "OnlineDPOConfig": "leantune.trainers.online_dpo_config",
    "OnlineDPOTrainer": "leantune.trainers.online_dpo_trainer",
    "plan_memory": "leantune.planning",
    "MemoryPlan": "leantune.planning",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    """Import on first use, so `import leantune` stays fast and optional extras stay optional."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'leantune' has no attribute {name!r}")


def __dir__():
    return __all__
