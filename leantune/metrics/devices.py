"""What a GPU holds beyond the tensors a step traces: each a named term with its source (docs/plan.md), never a
factor folded into the prediction. On CPU there are none: the plan is the measured breakdown's number."""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 1024 * 1024
GIB = 1024 * MIB

# Total memory per device as `nvidia-smi` / torch.cuda.get_device_properties report it (MiB).
GPUS = {
    "h200": 143771, "h100": 81559, "h100-80gb": 81559, "a100-80gb": 81920, "a100": 81920, "a100-40gb": 40960,
    "l40s": 46068, "a6000": 49140, "l4": 23034, "a10g": 23028, "a10": 23028, "rtx4090": 24564, "rtx3090": 24576,
    "v100-32gb": 32768, "v100": 16384, "t4": 15360,
}

CUDA_CONTEXT_BYTES = 500 * MIB  # CUDA context + cuBLAS/cuDNN workspaces (docs/plan.md: 300-500 MiB on recent GPUs)
SEGMENT_BYTES = 2 * MIB  # the caching allocator's large-segment granularity


@dataclass
class DeviceTerm:
    name: str
    bytes: int
    source: str


def parse_budget(text) -> int:
    """Bytes of a budget: "24GiB", "80GB" (read as GiB, as GPU marketing means it), "1500MiB", "123456789B", or a
    GPU name."""
    if isinstance(text, (int, float)):
        return int(text)
    value = str(text).strip().lower().replace(" ", "")
    if value in GPUS:
        return GPUS[value] * MIB
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)(gib|gb|g|mib|mb|m|tib|tb|b)?", value)
    if not match:
        raise ValueError(f"`memory_budget`: {text!r} is neither a size (24GiB, 1500MiB) nor a GPU of "
                         f"{', '.join(sorted(GPUS))}.")
    unit = (match.group(2) or "gib")[0]
    return int(float(match.group(1)) * {"g": GIB, "m": MIB, "t": 1024 * GIB, "b": 1}[unit])


def device_terms(device, fields: dict, num_processes: int, engine: str) -> list[DeviceTerm]:
    if device is None or str(device).lower() == "cpu":
        return []
    terms = [DeviceTerm("CUDA context", CUDA_CONTEXT_BYTES, "context + library workspaces; measured 300-500 MiB"),
             DeviceTerm("allocator segment rounding", SEGMENT_BYTES,
                        "caching allocator: large blocks in 2 MiB segments, at most one partly used per stream")]
    if num_processes > 1 and engine in ("ddp", "fsdp2"):
        terms.append(DeviceTerm("NCCL buffers", 4 * 2 * MIB * 8,
                                "NCCL_BUFFSIZE 4 MiB x 2 (send/recv) x 8 channels per peer group"))
    if fields.get("use_vllm") and fields.get("vllm_mode", "colocate") == "colocate":
        share = float(fields.get("vllm_gpu_memory_utilization", 0.3))
        total = parse_budget(device) if str(device).lower() in GPUS or re.match(r"[0-9]", str(device)) else 0
        terms.append(DeviceTerm("vLLM pool (weights + KV cache)", int(share * total),
                                f"vllm_gpu_memory_utilization={share} of the device's memory, reserved at start"))
    return terms
