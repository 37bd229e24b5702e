"""libdevice's tanh and rsqrt in triton.language, for Triton's CPU interpreter (devkit/liger_cpu.py): imported only
by `bridge_interpreter_gaps`, after triton, so importing it never imports triton early."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def rsqrt(x):
    return 1.0 / tl.sqrt(x)
