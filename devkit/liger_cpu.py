"""liger-kernel's Triton kernels on CPU tensors, for the tests and bench/gpu's dry run: Triton's interpreter.

Triton decides when a kernel is *defined* whether it is compiled or interpreted: its own library functions when
triton is imported (which happens early, through torch and transformers), liger-kernel's when liger-kernel is
imported. So the interpreter has to be on before the first of those imports: tests/conftest.py calls
`interpreter_on_for_imports` first thing, on machines without CUDA (a GPU machine keeps compiled kernels for its GPU
tests). leantune's dispatch, though, reads TRITON_INTERPRET when a trainer starts, and the rest of the suite must see
the environment it always did (Liger asked for on CPU -> the chunked head with a notice), so conftest takes the
variable away around every test except those marked `liger_interpreter` (tests/losses/test_liger_cpu.py).

`bridge_interpreter_gaps` is for what leantune keeps off Liger on CPU: the model patches (RMSNorm, RoPE, SwiGLU,
applied on CUDA only) and a soft-capped head; the plain fused linear cross-entropy that leantune uses needs no bridge.
"""

from __future__ import annotations

import functools
import os
import sys

VARIABLE = "TRITON_INTERPRET"
# Set when this module turned the interpreter on, in this process or in the one that started it: pytest-xdist's
# workers inherit the variable from the controller, and must still hide it from tests not marked for Liger.
SET_BY_TESTS = "LEANTUNE_TESTS_SET_TRITON_INTERPRET"
_set_here = os.environ.get(SET_BY_TESTS) == "1"


def interpreter_on_for_imports(cuda: bool) -> None:
    """TRITON_INTERPRET=1 from now on (imports), unless there is CUDA, triton is already imported, or it is set."""
    global _set_here
    if cuda or "triton" in sys.modules or VARIABLE in os.environ:
        return
    os.environ[VARIABLE] = "1"
    os.environ[SET_BY_TESTS] = "1"
    _set_here = True


def hide_interpreter(monkeypatch) -> None:
    """Take away the variable this module set, for one test (so dispatch and subprocesses never see it)."""
    if _set_here:
        monkeypatch.delenv(VARIABLE, raising=False)


def keep_interpreter(monkeypatch) -> None:
    """Put the variable this suite set back for one Liger test, should an earlier test in the worker have left it
    hidden (seen in the full suite, not in any file run alone; the kernels were already defined interpreted)."""
    if _set_here or os.environ.get(SET_BY_TESTS) == "1":
        monkeypatch.setenv(VARIABLE, "1")


def liger_kernels_interpreted() -> str | None:
    """None when Liger's kernels run on CPU tensors here, else why not (for a skip)."""
    if os.environ.get(VARIABLE) != "1":
        return f"{VARIABLE}=1 is not set (it is set by tests/conftest.py on machines without CUDA)"
    from triton.language import standard

    if type(standard.max).__name__ != "InterpretedFunction":
        return f"triton was imported before {VARIABLE}=1 was set, so its kernels are compiled ones"
    from liger_kernel.ops import cross_entropy

    if type(cross_entropy.liger_cross_entropy_kernel).__name__ != "InterpretedFunction":
        return f"liger-kernel was imported before {VARIABLE}=1 was set"
    return None


def forget_liger() -> None:
    """Drop liger-kernel's modules, so the next import defines its kernels again (under the variable as it is then)."""
    for name in [name for name in sys.modules if name == "liger_kernel" or name.startswith("liger_kernel.")]:
        del sys.modules[name]


class FusedKernelCalls:
    """Counts the calls of Liger's fused linear cross-entropy (forward, and the backward's recomputation) while
    they run for real: the proof that a trainer took Liger's path, not the chunked head."""

    def __init__(self, monkeypatch):
        from liger_kernel.ops import fused_linear_cross_entropy as module

        self.count = 0
        original = module.fused_linear_cross_entropy_forward

        @functools.wraps(original)  # its signature is what leantune's feature check reads
        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, "fused_linear_cross_entropy_forward", counted)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def bridge_interpreter_gaps(monkeypatch) -> None:
    """Two gaps of Triton's interpreter that Liger's kernels meet (not leantune's: the trainers route around them).

    1. A Python float kernel argument (softcap, eps, ...) reaches the kernel as a float, whose `.to(...)` fails:
       wrapped as an fp32 scalar tensor, as compiled Triton does.
    2. libdevice's `tanh` / `rsqrt` have no interpreter implementation: replaced, in the liger-kernel modules that
       imported them, by the same functions written in triton.language.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original(arg)

    monkeypatch.setattr(interpreter, "_implicit_cvt", implicit_cvt)
    from . import liger_cpu_math

    replacements = {"tanh": liger_cpu_math.tanh, "rsqrt": liger_cpu_math.rsqrt}
    for name, module in list(sys.modules.items()):
        if name.startswith("liger_kernel.ops") and module is not None:
            for function, replacement in replacements.items():
                if getattr(getattr(module, function, None), "__module__", "").startswith("triton.language.extra"):
                    monkeypatch.setattr(module, function, replacement)



def keep_llama_unpatched(monkeypatch) -> None:
    """Liger's Llama patching also replaces module-level names of transformers' modeling_llama (RMSNorm, MLP, RoPE)
    and may replace torch's cross_entropy: all restored when the test ends, so later models are the plain ones."""
    import torch
    from transformers.models.llama import modeling_llama

    for name, value in list(vars(modeling_llama).items()):
        if not name.startswith("__"):
            monkeypatch.setattr(modeling_llama, name, value)
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", torch.nn.functional.cross_entropy)
