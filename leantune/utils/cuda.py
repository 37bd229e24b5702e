"""A setting that runs only on a CUDA GPU, asked for on a machine without one: one error naming the setting. Apart from
imports.py, which the command line reads before torch is imported."""

from __future__ import annotations

import torch

from .imports import NeedsGPUError


def require_cuda(feature: str) -> None:
    if not torch.cuda.is_available():
        raise NeedsGPUError(f"{feature} needs a CUDA GPU, and none is visible to PyTorch on this machine.")
