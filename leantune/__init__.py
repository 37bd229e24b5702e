"""leantune: memory-efficient post-training of large language models, with TRL-compatible configs."""

from __future__ import annotations

import importlib
import logging

from .methods import METHODS
from .version import __version__


def _drop_bitsandbytes_kernel_notice(record: logging.LogRecord) -> bool:
    """bitsandbytes warns at import, on CPUs with AVX512-BF16, that an optional inference kernel (`kernels` package)
    is missing. leantune switches that inference path off for every model it trains (models/loading.py), so the
    warning names nothing a leantune user needs; other bitsandbytes messages pass."""
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_drop_bitsandbytes_kernel_notice)


_EXPORTS = {
    "pack_dataset": "leantune.data.packing",
    "CausalLMCollator": "leantune.data.collators",
    "ScriptArguments": "leantune.cli.arguments",
    "ModelConfig": "leantune.cli.arguments",
    "profile_dataset": "leantune.profiling",
    "LengthProfile": "leantune.profiling",
    "plan_memory": "leantune.planning",
    "MemoryPlan": "leantune.planning",
    # each method's config and trainer, as its entry in methods.py names them
    **{path.split(":")[1]: path.split(":")[0] for method in METHODS.values() for path in (method.config, method.trainer)},
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    """Import on first use, so `import leantune` stays fast and optional extras stay optional."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'leantune' has no attribute {name!r}")


def __dir__():
    return __all__
