"""Memory that an op allocates and frees inside itself, which a dispatch-level meter cannot see.

MemTracker (metrics/memory_breakdown.py) and the plan's FakeTensor trace (planning/fake_step.py) see a tensor when
an op dispatched through Python returns it. Some ATen kernels call other ops below that level: `aten::logsumexp`
forms `input - max` (a buffer the size of its input) and frees it before returning; an allocator-level measure
(torch.profiler's memory events) sees it at the op's peak. For the ops listed here, the bytes held inside the op,
beyond its inputs and its output, are added to the meter's total while the op runs.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _logsumexp(args, kwargs, output) -> int:
    # ReduceOps.cpp, logsumexp_out_impl: maxes = amax(self, dims, keepdim=True) (the output's size), then
    # sum((self - maxes).exp_()): the subtraction is a buffer of the input's size and dtype (floats stay floats)
    source = args[0]
    return source.numel() * source.element_size() + output.numel() * output.element_size()


SCRATCH = {aten.logsumexp.default: _logsumexp}


def scratch_bytes(func, args, kwargs, output) -> int:
    """Bytes `func` holds inside itself beyond its inputs and `output` (0 for an op not known to)."""
    count = SCRATCH.get(func)
    if count is None or not isinstance(output, torch.Tensor):
        return 0
    return int(count(args, kwargs or {}, output))
