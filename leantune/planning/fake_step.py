"""Run a real training step with weights that take no memory: every tensor derived from the model is a FakeTensor
(shape, dtype and device, no storage), while the data's own tensors (token ids, masks, lengths) stay real.

Why two kinds: the trainers' steps make data-dependent choices (which positions are targets, each packed sequence's
length, how many loss chunks) that a FakeTensor cannot answer, but that depend only on the batch, which is small and
real. Anything that touches the model's numbers runs under `FakeTensorMode`, so a 70B model's step costs shape
arithmetic only. MemTracker (metrics/memory_breakdown.py) counts FakeTensors by their size like real ones, so the same
callback that measures a real step measures this one.

Where a value of a fake number is asked for (`.item()` of a loss for logging, a NaN check, generation's "all
sequences finished?"), the answer is 0 / False: logging sees zeros, checks pass, generation runs to its length limit
(the worst case for memory).
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

aten = torch.ops.aten


def _fake_tensor_mode():
    return FakeTensorMode(allow_non_fake_inputs=True)


def _is_fake(value) -> bool:
    return isinstance(value, FakeTensor)


class WeightlessMode(TorchDispatchMode):
    """Ops on any fake input run fake; ops on real inputs only run for real (the data's bookkeeping)."""

    def __init__(self):
        super().__init__()
        self.fake_mode = _fake_tensor_mode()
        self.all_fake = False  # while building a model: factories (parameters) are fake too

    @contextlib.contextmanager
    def building(self):
        before, self.all_fake = self.all_fake, True
        try:
            yield
        finally:
            self.all_fake = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        fake = self.all_fake or any(_is_fake(value) for value in flat)
        if not fake:
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            return _zero_of(args[0].dtype)
        if func is aten.index.Tensor:
            args = (args[0], [_real_indices(index) for index in args[1]])
        elif func in (aten.index_put_.default, aten.index_put.default):
            args = (args[0], [_real_indices(index) for index in args[1]], *args[2:])
        elif func is aten.masked_select.default and not _is_fake(args[1]):
            return self._run(aten.index.Tensor, (args[0].expand_as(args[1]) if args[0].dim() else args[0],
                                                 [_real_indices(args[1])]), {})
        elif func is aten.nonzero.default or func is aten.unique_consecutive.default:
            raise NotImplementedError(f"{func} of a value computed from the model's weights cannot be planned")
        return self._run(func, args, kwargs)

    def _run(self, func, args, kwargs):
        with self.fake_mode:
            return func(*args, **kwargs)


def _real_indices(index):
    """A real boolean mask as the positions it selects (a fake op cannot count them)."""
    if index is None or _is_fake(index) or index.dtype not in (torch.bool, torch.uint8):
        return index
    return index.nonzero().unbind(1)[0] if index.dim() == 1 else index


def _zero_of(dtype):
    if dtype is torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return 0.0
    return 0


def fake_model_from_config(config, mode: WeightlessMode, model_class=None, dtype=None):
    """The model of `config` with fake parameters (no weights read, nothing allocated)."""
    model_class = model_class or AutoModelForCausalLM
    with mode.building():
        kwargs = {"dtype": dtype} if dtype is not None else {}
        return model_class.from_config(config, **kwargs)


@contextlib.contextmanager
def fake_parameters_convertible():
    """`module.to(...)`, `.float()` on a model of fake parameters: torch swaps each parameter in place, which a
    FakeTensor (weakly referenced by its mode) refuses; here a parameter that changes is replaced, one that would not
    change is kept."""
    original = torch.nn.Module._apply

    def _apply(module, fn, recurse=True):
        if not any(_is_fake(p) for p in module.parameters(recurse=True)):
            return original(module, fn, recurse)
        if recurse:
            for child in module.children():
                _apply(child, fn)
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            with torch.no_grad():
                applied = fn(param)
            if applied.dtype != param.dtype or applied.device != param.device:
                module._parameters[name] = torch.nn.Parameter(applied, requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = fn(buffer)
        return module

    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = original


@contextlib.contextmanager
def triton_launches_skipped_on_fake():
    """Liger's Triton kernels on fake tensors: a kernel launch reads its arguments' memory (a GPU address, or a host
    copy under Triton's interpreter), which a fake tensor has none of. A kernel only writes into tensors that torch
    allocated around it (those allocations are traced as any other), so a launch on fake arguments is skipped."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:  # no triton: no kernel to launch
        yield
        return
    original = KernelInterface.__getitem__

    def launcher(kernel, grid):
        launch = original(kernel, grid)

        def run(*args, **kwargs):
            if any(_is_fake(value) for value in (*args, *kwargs.values())):
                return None
            return launch(*args, **kwargs)

        return run

    KernelInterface.__getitem__ = launcher
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


@contextlib.contextmanager
def fake_tensors_copyable():
    """`copy.deepcopy` of a model of fake weights (a reference copy of the initial policy): torch's default deep copy
    of a tensor subclass also deep-copies its `__dict__`, which for a FakeTensor holds its FakeTensorMode and that
    mode's native state; copying it corrupted the heap after a few plans (a segfault or malloc abort, later, in
    unrelated code). A fake tensor's copy is its clone, in the same mode."""
    had = "__deepcopy__" in FakeTensor.__dict__
    original = FakeTensor.__dict__.get("__deepcopy__")

    def deepcopy(self, memo):
        if id(self) not in memo:
            with torch.no_grad():
                copied = self.clone()
            memo[id(self)] = copied.requires_grad_(self.requires_grad) if self.is_leaf else copied
        return memo[id(self)]

    FakeTensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        if had:
            FakeTensor.__deepcopy__ = original
        else:
            del FakeTensor.__deepcopy__
