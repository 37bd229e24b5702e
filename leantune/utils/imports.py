"""Optional extras: detect them without importing heavy modules, and fail with the extra's name."""

from __future__ import annotations

import importlib.util

import torch

EXTRA_FOR_MODULE = {
    "liger_kernel": "liger",
    "deepspeed": "deepspeed",
    "vllm": "vllm",
    "bitsandbytes": "bitsandbytes",
    "flash_attn": "flash-attn",
    "trl": "bench",
}


def is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, feature: str) -> None:
    """Raise an ImportError that names the pip extra providing `module`."""
    if not is_available(module):
        extra = EXTRA_FOR_MODULE.get(module, module)
        raise ImportError(
            f"{feature} needs the optional package '{module}', which is not installed. "
            f"Install it with: pip install 'leantune[{extra}]'"
        )


def require_cuda(feature: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{feature} needs a CUDA GPU, and none is visible to PyTorch on this machine.")
