"""Which implementation computes the target log-probabilities: the model's full logits, leantune's chunked head,
or liger-kernel's fused kernels. Chosen once per trainer from the config flag and what this machine can run."""

from __future__ import annotations

import logging
import os
import sys
from enum import Enum

from ..utils.imports import is_available

logger = logging.getLogger("leantune.losses")

# Values of TRITON_INTERPRET that turn Triton's interpreter on (Triton reads the variable the same way).
INTERPRETER_ON = ("1", "true", "on", "yes")
LIGER_ON_CPU = "set TRITON_INTERPRET=1 before Python starts"
INSTALL = "pip install 'leantune[liger]'"


class LogProbPath(str, Enum):
    FULL = "full"  # the model computes [tokens, vocabulary] logits
    CHUNKED = "chunked"  # leantune's chunked head (any device): one chunk of logits at a time
    LIGER = "liger"  # liger-kernel's fused Triton kernels (CUDA, or CPU under Triton's interpreter)


def triton_interpreter_on() -> bool:
    """Whether Triton runs kernels on CPU tensors in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in INTERPRETER_ON


def _liger_compiled_without_interpreter() -> bool:
    """Liger's kernels are wrapped when liger-kernel is imported: imported before TRITON_INTERPRET was set, they are
    compiled kernels, which cannot take CPU tensors. Checked without importing anything."""
    module = sys.modules.get("liger_kernel.ops.cross_entropy")
    kernel = getattr(module, "liger_cross_entropy_kernel", None)
    return kernel is not None and type(kernel).__name__ != "InterpretedFunction"


def liger_unavailable_reason(device_type: str) -> str | None:
    if device_type == "cpu" and not triton_interpreter_on():
        steps = LIGER_ON_CPU if is_available("liger_kernel") else f"{INSTALL} and {LIGER_ON_CPU}"
        return (f"liger-kernel's Triton kernels run on CUDA, or on CPU under Triton's interpreter (slow, for testing: "
                f"{steps})")
    if device_type not in ("cuda", "cpu"):
        return f"liger-kernel runs on CUDA only (training runs on {device_type})"
    if not is_available("liger_kernel"):
        return f"liger-kernel is not installed ({INSTALL})"
    if device_type == "cpu" and _liger_compiled_without_interpreter():
        return f"liger-kernel was imported before TRITON_INTERPRET was set ({LIGER_ON_CPU})"
    return None


def choose_logprob_path(fused_requested: bool, device_type: str, flag: str, chunked: bool = True) -> LogProbPath:
    """`flag` is the config field that asked for Liger (`use_liger_kernel` or `use_liger_loss`), for the notice;
    without it, `chunked` (the default) picks the built-in chunked path over the model's full logits."""
    if not fused_requested:
        return LogProbPath.CHUNKED if chunked else LogProbPath.FULL
    reason = liger_unavailable_reason(device_type)
    if reason is None:
        return LogProbPath.LIGER
    logger.warning("%s=True: %s; using leantune's chunked loss instead (same memory saving, exact).", flag, reason)
    return LogProbPath.CHUNKED
