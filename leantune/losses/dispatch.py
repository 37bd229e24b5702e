"""Which implementation computes the target log-probabilities: the model's full logits, leantune's chunked head,
or liger-kernel's fused kernels. Chosen once per trainer from the config flag and what this machine can run."""

from __future__ import annotations

import logging
from enum import Enum

from ..utils.imports import is_available

logger = logging.getLogger("leantune.losses")


class LogProbPath(str, Enum):
    FULL = "full"  # the model computes [tokens, vocabulary] logits
    CHUNKED = "chunked"  # leantune's chunked head (any device): one chunk of logits at a time
    LIGER = "liger"  # liger-kernel's fused Triton kernels (CUDA)


def liger_unavailable_reason(device_type: str) -> str | None:
    if device_type != "cuda":
        return f"liger-kernel runs on CUDA only (training runs on {device_type})"
    if not is_available("liger_kernel"):
        return "liger-kernel is not installed (pip install 'leantune[liger]')"
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
