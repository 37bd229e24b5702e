"""Peak memory of the training process: CUDA max allocated on GPU, peak resident set size on CPU."""

from __future__ import annotations

import resource
import sys

import torch


def _uses_cuda(device: torch.device | None) -> bool:
    return torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")


def reset_peak_memory(device: torch.device | None = None) -> None:
    if _uses_cuda(device):
        torch.cuda.reset_peak_memory_stats()
    elif sys.platform.startswith("linux"):
        try:  # Linux resets VmHWM (peak RSS) when 5 is written here.
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            pass


def peak_memory_bytes(device: torch.device | None = None) -> int:
    if _uses_cuda(device):
        return int(torch.cuda.max_memory_allocated())
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def memory_kind(device: torch.device | None = None) -> str:
    return "cuda_max_allocated" if _uses_cuda(device) else "peak_rss"
