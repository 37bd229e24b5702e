"""Optional extras: detect them without importing heavy modules, and fail with the extra's name."""

from __future__ import annotations

import importlib.util

EXTRA_FOR_MODULE = {
    "liger_kernel": "liger",
    "deepspeed": "deepspeed",
    "vllm": "vllm",
    "uvicorn": "server",
    "starlette": "server",
    "bitsandbytes": "bitsandbytes",
    "flash_attn": "flash-attn",
    "trl": "bench",
}


class MissingExtraError(ImportError):
    """An optional package that a setting asked for is not installed (a user's choice to fix, not a bug)."""


class NeedsGPUError(RuntimeError):
    """A setting asked for something that runs only on a CUDA GPU, on a machine without one."""


def is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, feature: str) -> None:
    """Raise an ImportError that names the pip extra providing `module`."""
    if not is_available(module):
        extra = EXTRA_FOR_MODULE.get(module, module)
        raise MissingExtraError(
            f"{feature} needs the optional package '{module}', which is not installed. "
            f"Install it with: pip install 'leantune[{extra}]'"
        )
