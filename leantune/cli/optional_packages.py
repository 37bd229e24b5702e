"""Optional packages a run's flags ask for, checked before any model or data loads.

A missing tracker or kernel package otherwise surfaces minutes later, deep in transformers or accelerate, as a
traceback; here it is one line naming the flag and the `pip install` that provides it.
"""

from __future__ import annotations

import os

from ..generation.backend import VLLM_COLOCATE
from ..trainers.online_config import OnlineConfig
from ..trainers.settings import generation_engine
from ..utils.imports import is_available
from .errors import UsageError

# --report_to value: (modules any one of which serves it, the install command)
TRACKERS = {
    "tensorboard": (("tensorboard", "tensorboardX"), "pip install tensorboard"),
    "wandb": (("wandb",), "pip install wandb"),
    "trackio": (("trackio",), "pip install trackio"),
    "mlflow": (("mlflow",), "pip install mlflow"),
    "comet_ml": (("comet_ml",), "pip install comet_ml"),
    "clearml": (("clearml",), "pip install clearml"),
    "dvclive": (("dvclive",), "pip install dvclive"),
}


def _report_to(args) -> list[str]:
    value = getattr(args, "report_to", None)
    if value is None:
        return []
    names = [value] if isinstance(value, str) else list(value)
    return [name.strip() for item in names for name in str(item).split(",") if name.strip()]


def _deepspeed_requested(args) -> str | None:
    if getattr(args, "deepspeed", None):
        return "--deepspeed"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes"):
        return "accelerate's config (use DeepSpeed)"
    return None


def missing_packages(args, model_args=None) -> list[str]:
    """One line per flag whose package is not installed, naming the flag and the install command."""
    problems = []
    for name in _report_to(args):
        if name in TRACKERS:
            modules, install = TRACKERS[name]
            if not any(is_available(module) for module in modules):
                problems.append(f"--report_to {name} needs the package '{modules[0]}', which is not installed: "
                                f"{install} (or choose another --report_to, e.g. none).")
    for flag in ("use_liger_kernel", "use_liger_loss"):
        if getattr(args, flag, False) and not is_available("liger_kernel"):
            problems.append(f"--{flag} needs liger-kernel, which is not installed: pip install 'leantune[liger]'.")
            break
    quantized = [f for f in ("load_in_4bit", "load_in_8bit") if getattr(model_args, f, False)]
    if quantized and not is_available("bitsandbytes"):
        problems.append(f"--{quantized[0]} needs bitsandbytes, which is not installed: "
                        "pip install 'leantune[bitsandbytes]'.")
    deepspeed = _deepspeed_requested(args)
    if deepspeed and not is_available("deepspeed"):
        problems.append(f"{deepspeed} needs deepspeed, which is not installed: pip install 'leantune[deepspeed]'.")
    colocated = isinstance(args, OnlineConfig) and generation_engine(args) == VLLM_COLOCATE
    if colocated and not is_available("vllm"):
        problems.append("--use_vllm with --vllm_mode colocate needs vllm, which is not installed: "
                        "pip install 'leantune[vllm]' (or serve it elsewhere: --vllm_mode server).")
    return problems


def check_optional_packages(args, model_args=None) -> None:
    """Raise a UsageError (one line, exit 2) for the first flag whose optional package is missing."""
    problems = missing_packages(args, model_args)
    if problems:
        raise UsageError(problems[0])
