"""What MemTracker would miss of a bitsandbytes (4/8-bit) model, made visible to it.

Two things, both found by comparing a real QLoRA step's breakdown with bitsandbytes' source (0.50):
- The quantization state is not a parameter or buffer: a 4-bit weight's `quant_state` holds the block scales
  (`absmax`), the 16-value code table and, with double quantization, the 8-bit scales' own scales, offset and a
  256-value code table per layer; an 8-bit weight keeps its row scales (`SCB`) beside it. MemTracker tracks the
  module's parameters and buffers only, so these are handed to it as parameters (`quantization_state_tensors`).
- The 4-bit forward is one op, `bitsandbytes::gemm_4bit`, which on the CPU (and on CUDA past a few rows) dequantizes
  the whole weight to the compute dtype and then multiplies. A dispatch-mode tracker sees an op's outputs, not what
  it allocates inside, so that weight-sized temporary would be invisible. While a step is measured the op is run as
  its own two parts (bitsandbytes' default implementation: `dequantize_4bit`, then `linear`; on the CPU the very
  code the op runs), so the dequantized weight is counted where it is live (`visible_dequantization`).
What stays invisible on both sides: scratch memory inside bitsandbytes' own CPU kernels (the dequantization's index
and code lookups), which a GPU kernel does not allocate.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _is_4bit(module) -> bool:
    return type(module).__name__ == "Linear4bit" or any(c.__name__ == "Linear4bit" for c in type(module).__mro__)


def quantization_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor of the model's bitsandbytes quantization states (scales, code tables, offsets)."""
    found, seen = [], set()

    def add(value):
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)

    def add_state(state):
        if state is None:
            return
        for name in ("absmax", "code", "offset"):
            add(getattr(state, name, None))
        add_state(getattr(state, "state2", None))

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        add_state(getattr(weight, "quant_state", None))
        add(getattr(weight, "SCB", None))
        state = getattr(module, "state", None)  # Linear8bitLt moves the row scales here at its first forward
        if state is not None and type(state).__name__ == "MatmulLtState":
            add(state.SCB)
    return found


class _DequantizeThenMultiply(TorchDispatchMode):
    """`bitsandbytes::gemm_4bit` as bitsandbytes' own default implementation: dequantize, then linear (on the CPU,
    where that implementation is the op's; a CUDA step keeps its kernel, whose memory the allocator's peak shows)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.bitsandbytes.gemm_4bit.default and args[0].device.type == "cpu":
            from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

            return _gemm_4bit_default_impl(*args, **kwargs)
        return func(*args, **kwargs)


def visible_dequantization(model: torch.nn.Module):
    """A context that runs the model's fused 4-bit matmuls as dequantize + linear (nothing for other models). Enter it
    after the tracker, so the two parts reach it."""
    if not any(_is_4bit(module) for module in model.modules()):
        return contextlib.nullcontext()
    return _DequantizeThenMultiply()
