"""Activation offloading: the activations autograd saves in the forward pass wait in host memory for backward.

`ActivationOffloader` is a `torch.autograd.graph.saved_tensors_hooks` context put around the model backbone's
forward. Every tensor autograd saves goes through `_pack`, which returns a small handle (`_Saved`) carrying a
monotonic index; backward calls `_unpack` with that handle. The handle holds all the state of its tensor, so the
memory follows the graph's lifetime: a graph freed by backward, kept by `retain_graph` or dropped without a backward
releases exactly what it holds. Nothing is keyed by `data_ptr()` or `id()`, so a recycled allocator address or Python
id can never hand back another tensor's data.

What is offloaded. A saved tensor is copied out when it is a plain strided tensor of at least `min_offload_bytes`
living on CUDA (or, with an explicit `offload_device`, anywhere: tests use that to force real copies on CPU). Kept
on device, and counted by reason in `stats["kept_by_reason"]`: parameters and buffers of `model` and any view or
transpose of them (recognised by storage, taken at `__enter__` because FSDP/PEFT may swap storages), parameters of
any module (`nn.Parameter` or a view whose base is one), tensor subclasses (DTensor, bitsandbytes `Params4bit`, fake
tensors), sparse/nested/quantized/meta tensors, small tensors, overlapping layouts (an expanded tensor would grow
when copied), and the most recent `keep_last` tensors (below).

Lazy offloading, and the final output. A tensor is offloaded only when `keep_last` newer tensors have been saved
after it; whatever is still pending at `__exit__` stays on device. Backward starts with exactly those tensors, so
copying them out would only add a round trip, and the last tensors of the forward (the region's output and what
was saved with it) are the ones a caller may still modify in place right after the region.

Identity. If the same data is saved several times in one forward (the normed hidden state that q_proj, k_proj and
v_proj save as three fresh 2-D views), it is copied once: a saved tensor matches an earlier one when both views have
the same base object (checked through a weakref, `ref() is base`, so a recycled `id()` of a dead tensor never
matches), the same offset, shape, strides and dtype, and the same version counter. Different views of one base are
copied separately, each exactly its own elements. A dense view (any stride permutation) is copied with its strides;
a view with gaps (a slice) is copied compactly and restored into `empty_strided` with its original strides.

In-place modification. PyTorch does not check the version counter of tensors saved through hooks, so `_unpack`
does: a saved tensor modified in place after it was saved raises the error autograd raises without hooks (checked on
the kept tensor, or on an offloaded tensor's base while that base is alive: it shares the counter of all its views).
A pending tensor modified before its copy is kept on device (so that check fires) instead of copying the new value.

CUDA streams (`use_streams=True`, the default). Device-to-host copies run on a side stream after the compute
stream's pending work; the source tensor is held until its copy event completes (polled at every save), and the
ones still in flight at `__exit__` get `record_stream` so the allocator cannot reuse them early. In backward, an
offloaded tensor is brought back when first unpacked (waiting on its prefetch, or copied on the compute stream),
and the next `prefetch` offloaded tensors in reverse save order are copied in on a host-to-device stream; a
prefetched tensor gets `record_stream` on the compute stream that uses it. `use_streams=False` copies synchronously.
Pinned host memory is used whenever the activation is on CUDA and the target is the CPU.

Scope, and liger's fused cross-entropy (the logged choice). Liger's kernel writes the gradient into its logits input
during the forward. Trainers run only the backbone (decoder stack) inside this context and the LM head plus loss
outside it, so no tensor a fused loss touches is ever offloaded; trainers log `OFFLOADING_SCOPE_MESSAGE` once
(`log_offloading_scope`). Gradient checkpointing (non-reentrant) saves each checkpointed layer's inputs through these
hooks, so those inputs are offloaded; the recomputation in backward happens outside the context.

The planner's fake step (planning/). A plan of a CUDA run traces fake tensors on the CPU; while `planned_host` holds
a ledger (planning/planned_run.py's session of a GPU plan), a fake tensor stands for the CUDA activation the run would
save, and the same rules offload it: it leaves the traced device, its host copy is its pinned block in the ledger
(`pinned_bytes`, as the run's pinned allocator takes it), and it comes back, and is prefetched, as an empty fake of
its shape. Without a ledger (a plan of a CPU run, where nothing is offloaded) fake tensors are kept, as any subclass.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import weakref
from collections import deque
from typing import Self

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .checkpoint_offload import HostLedger, pinned_bytes

logger = logging.getLogger(__name__)

OFFLOADING_SCOPE_MESSAGE = (
    "activation offloading covers the decoder layers; the loss head runs outside it, so in-place fused losses "
    "(liger) are safe"
)
_scope_logged: set[str] = set()

_DENSE, _GAPPED, _OVERLAPPING = "dense", "gapped", "overlapping"

# The host of a plan's CUDA run (the module docstring): set by the planner while it traces one, else None.
planned_host: HostLedger | None = None


def _stands_for_cuda(tensor: torch.Tensor) -> bool:
    """A fake tensor of a plan's CUDA run: offloaded by the rules a CUDA activation is."""
    return planned_host is not None and isinstance(tensor, FakeTensor)


def log_offloading_scope(log: logging.Logger | None = None) -> str:
    """Log once per logger where offloading applies (the choice that makes in-place fused losses safe)."""
    log = log or logger
    if log.name not in _scope_logged:
        _scope_logged.add(log.name)
        log.info(OFFLOADING_SCOPE_MESSAGE)
    return OFFLOADING_SCOPE_MESSAGE


def offloading_context(enabled: bool, model: torch.nn.Module | None = None, **kwargs):
    """An `ActivationOffloader` for `model` when enabled, else a context that does nothing."""
    return ActivationOffloader(model, **kwargs) if enabled else contextlib.nullcontext()


def _layout(tensor: torch.Tensor) -> str:
    """Dense (a permutation of contiguous), gapped (no overlap, holes: a slice) or overlapping (e.g. expanded)."""
    extent, dense = 1, True
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz != 1):
        if stride < extent:  # conservative: interleavings that do not overlap are rare and simply kept
            return _OVERLAPPING
        dense = dense and stride == extent
        extent += (size - 1) * stride
    return _DENSE if dense else _GAPPED


def _storage_ptr(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # subclasses without a plain storage
        return None


def _new_stats() -> dict:
    return {"tensors_saved": 0, "tensors_offloaded": 0, "bytes_offloaded": 0, "tensors_deduplicated": 0,
            "tensors_kept": 0, "kept_by_reason": {}, "tensors_reloaded": 0, "bytes_reloaded": 0,
            "tensors_prefetched": 0}


class _Saved:
    """What autograd stores for one saved tensor: the tensor on device, or its copy until backward needs it."""

    __slots__ = ("__weakref__", "base_ref", "d2h_event", "device", "host", "host_size", "index", "like", "offloaded",
                 "prefetched", "session", "size", "stride", "tensor", "version")

    def __init__(self, index: int, session: _Session, tensor: torch.Tensor):
        self.index, self.session = index, session
        # Detached: the saved tensor may be an output of the node saving it, and holding that would make a cycle.
        self.tensor = tensor.detach()
        self.version = tensor._version
        self.offloaded = False
        self.base_ref = self.host = self.d2h_event = self.prefetched = None
        self.like, self.host_size = None, 0  # a plan's fake tensor: an empty fake to come back from, its host block
        self.device, self.size, self.stride = tensor.device, tensor.shape, tensor.stride()


class _Session:
    """One forward pass under the context: its stats, identity table, pending window and offloaded handles."""

    def __init__(self, parameter_storages: frozenset[int]):
        self.parameter_storages = parameter_storages
        self.stats = _new_stats()
        self.seen: dict[int, list[tuple]] = {}  # id(base) -> [(weakref(base), geometry, version, weakref(handle))]
        self.pending: deque[_Saved] = deque()
        self.in_flight: list[tuple] = []  # (source, event, stream): async copies not known to be complete
        self.offloaded: list[weakref.ref] = []  # offloaded handles in save order, for prefetching
        self.offloaded_indices: list[int] = []

    def keep(self, reason: str) -> None:
        self.stats["tensors_kept"] += 1
        by_reason = self.stats["kept_by_reason"]
        by_reason[reason] = by_reason.get(reason, 0) + 1


class ActivationOffloader:
    """Context manager: `with offloader: outputs = backbone(...)`; backward later runs outside it.

    `stats` describes the latest forward (reset at every `__enter__`) and gains the reload counts during its
    backward. One instance may be used for any number of forwards, but not entered twice at once.
    """

    def __init__(self, model: torch.nn.Module | None = None, *, min_offload_bytes: int = 1 << 20,
                 use_streams: bool = True, offload_device: str | torch.device | None = None, keep_last: int = 1,
                 prefetch: int = 2):
        if min_offload_bytes < 0 or keep_last < 0 or prefetch < 0:
            raise ValueError("min_offload_bytes, keep_last and prefetch must be >= 0")
        self.model = model
        self.min_offload_bytes = min_offload_bytes
        self.use_streams = use_streams
        self.offload_device = torch.device(offload_device) if offload_device is not None else None
        self.keep_last = keep_last
        self.prefetch = prefetch
        self.stats = _new_stats()
        self._session: _Session | None = None
        self._hooks = None
        self._streams: dict[torch.device, tuple] = {}  # device -> (device-to-host, host-to-device)
        self._index = itertools.count()

    # -- context ---------------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        if self._hooks is not None:
            raise RuntimeError("this ActivationOffloader is already active; it cannot be entered again before it "
                               "exits (use a separate instance for a nested region)")
        self._session = _Session(self._parameter_storages())
        self.stats = self._session.stats
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info) -> bool:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc_info)
        session = self._session
        for _ in session.pending:  # backward starts with these: they stay on device
            session.keep("last")
        session.pending.clear()
        session.seen.clear()
        for source, _, stream in session.in_flight:  # copies may still read them: no reuse before they end
            source.record_stream(stream)
        session.in_flight.clear()
        return False

    def _parameter_storages(self) -> frozenset[int]:
        if self.model is None:
            return frozenset()
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return frozenset(ptr for ptr in map(_storage_ptr, tensors) if ptr)

    # -- forward: pack ---------------------------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        session = self._session
        session.stats["tensors_saved"] += 1
        reason = self._keep_reason(tensor, session)
        if reason is not None:
            session.keep(reason)
            return _Saved(next(self._index), session, tensor)
        base = tensor._base if tensor._base is not None else tensor
        geometry = (tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        entries = session.seen.setdefault(id(base), [])
        for base_ref, seen_geometry, version, handle_ref in entries:
            handle = handle_ref()
            if base_ref() is base and seen_geometry == geometry and version == tensor._version and handle:
                session.stats["tensors_deduplicated"] += 1
                return handle
        handle = _Saved(next(self._index), session, tensor)
        handle.base_ref = weakref.ref(base)
        entries[:] = [entry for entry in entries if entry[0]() is not None]
        entries.append((handle.base_ref, geometry, tensor._version, weakref.ref(handle)))
        session.pending.append(handle)
        while len(session.pending) > self.keep_last:
            self._offload(session.pending.popleft(), session)
        return handle

    def _keep_reason(self, tensor: torch.Tensor, session: _Session) -> str | None:
        """Why this saved tensor stays on device, or None to offload it."""
        planned = _stands_for_cuda(tensor)  # a plan's fake activation: judged as the plain tensor it stands for
        if planned and isinstance(tensor, torch.nn.Parameter):
            return "parameter"
        if type(tensor) is not torch.Tensor and not planned:
            return "parameter" if isinstance(tensor, torch.nn.Parameter) else "subclass"
        if tensor.layout != torch.strided or tensor.is_nested or tensor.is_quantized or tensor.is_meta:
            return "layout"
        if isinstance(tensor._base, torch.nn.Parameter) or _storage_ptr(tensor) in session.parameter_storages:
            return "parameter"
        if tensor.numel() * tensor.element_size() < self.min_offload_bytes:
            return "small"
        if self._target(tensor) is None:
            return "device"
        if _layout(tensor) == _OVERLAPPING:
            return "layout"
        return None

    def _target(self, tensor: torch.Tensor) -> torch.device | None:
        """Where the copy goes: the explicit device, else the CPU for CUDA activations (nothing gained otherwise)."""
        if self.offload_device is not None:
            return self.offload_device
        return torch.device("cpu") if tensor.is_cuda or _stands_for_cuda(tensor) else None

    def _offload(self, handle: _Saved, session: _Session) -> None:
        source = handle.tensor
        if source._version != handle.version:  # modified in place since saved: let _unpack report it
            session.keep("modified")
            return
        if _stands_for_cuda(source):  # a plan's trace: no values to copy, the host holds its pinned block
            handle.like = source.new_empty((0,))
            handle.host_size = pinned_bytes(source.numel() * source.element_size())
            planned_host.add(handle.host_size)
        else:
            handle.host = self._copy_out(handle, source, session)
        handle.tensor, handle.offloaded = None, True
        session.offloaded.append(weakref.ref(handle))
        session.offloaded_indices.append(handle.index)
        session.stats["tensors_offloaded"] += 1
        session.stats["bytes_offloaded"] += source.numel() * source.element_size()

    def _copy_out(self, handle: _Saved, source: torch.Tensor, session: _Session) -> torch.Tensor:
        """The host copy of `source` (asynchronous on a side stream with streams on CUDA)."""
        target = self._target(source)
        pin = source.is_cuda and target.type == "cpu"
        if _layout(source) == _DENSE:
            host = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device=target,
                                       pin_memory=pin)
        else:  # gapped: copy only the view's elements; _reload restores the strides
            host = torch.empty(source.shape, dtype=source.dtype, device=target, pin_memory=pin)
        if self.use_streams and source.is_cuda:
            stream = self._stream_pair(source.device)[0]
            stream.wait_stream(torch.cuda.current_stream(source.device))
            with torch.cuda.stream(stream):
                host.copy_(source, non_blocking=True)
                handle.d2h_event = torch.cuda.Event()
                handle.d2h_event.record(stream)
            session.in_flight.append((source, handle.d2h_event, stream))
            session.in_flight = [item for item in session.in_flight if not item[1].query()]
        else:
            host.copy_(source)
        return host

    def _stream_pair(self, device: torch.device) -> tuple:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams[device]

    # -- backward: unpack ------------------------------------------------------------------------------------

    def _unpack(self, handle: _Saved) -> torch.Tensor:
        if handle.tensor is None:
            handle.tensor = self._reload(handle)
        # The version check autograd skips for hooked tensors: on the kept tensor, or on the offloaded one's base
        # while it is alive (it shares the version counter of every view of it).
        live = handle.base_ref() if handle.offloaded else handle.tensor
        if live is not None and live._version != handle.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{handle.tensor.type()} {list(handle.size)}] is at version {live._version}; expected version "
                f"{handle.version} instead (saved under activation offloading)")
        return handle.tensor

    def _reload(self, handle: _Saved) -> torch.Tensor:
        if handle.prefetched is not None:
            tensor, event = handle.prefetched
            handle.prefetched = None
            if event is not None:
                compute = torch.cuda.current_stream(handle.device)
                compute.wait_event(event)
                tensor.record_stream(compute)  # allocated on the prefetch stream, used on this one
        elif handle.like is not None:  # a plan's fake: the device memory a copy back takes
            tensor = handle.like.new_empty_strided(handle.size, handle.stride)
        else:
            tensor = torch.empty_strided(handle.size, handle.stride, dtype=handle.host.dtype, device=handle.device)
            if handle.d2h_event is not None:
                torch.cuda.current_stream(handle.device).wait_event(handle.d2h_event)
                tensor.copy_(handle.host, non_blocking=True)
            else:
                tensor.copy_(handle.host)
        stats = handle.session.stats
        stats["tensors_reloaded"] += 1
        stats["bytes_reloaded"] += tensor.numel() * tensor.element_size()
        handle.host = None  # pinned blocks used by async copies are recorded by PyTorch's host allocator
        if handle.host_size and planned_host is not None:
            planned_host.remove(handle.host_size)
            handle.host_size = 0
        # streams (a plan's CUDA run has them as the run would): start bringing back what backward needs next
        if handle.d2h_event is not None or (handle.like is not None and self.use_streams):
            for other in _prefetch_candidates(handle.session, handle.index, self.prefetch):
                if other.prefetched is None:
                    self._start_prefetch(other)
        return tensor

    def _start_prefetch(self, handle: _Saved) -> None:
        if handle.like is not None:  # a plan's fake: allocated now, as the run's copy in would be
            handle.prefetched = (handle.like.new_empty_strided(handle.size, handle.stride), None)
            handle.session.stats["tensors_prefetched"] += 1
            return
        stream = self._stream_pair(handle.device)[1]
        stream.wait_event(handle.d2h_event)
        with torch.cuda.stream(stream):
            tensor = torch.empty_strided(handle.size, handle.stride, dtype=handle.host.dtype, device=handle.device)
            tensor.copy_(handle.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        handle.prefetched = (tensor, event)
        handle.session.stats["tensors_prefetched"] += 1


def _done(handle: _Saved | None) -> bool:
    """Freed with its graph, or already back on device."""
    return handle is None or handle.tensor is not None


def _prefetch_candidates(session: _Session, index: int, count: int) -> list[_Saved]:
    """The `count` offloaded tensors saved last before `index` and not yet back: backward needs them next."""
    refs, indices = session.offloaded, session.offloaded_indices
    while refs and _done(refs[-1]()):  # backward consumes from the end: keep the scan short
        refs.pop()
        indices.pop()
    found = []
    for position in range(bisect.bisect_left(indices, index) - 1, -1, -1):
        if len(found) == count:
            break
        other = refs[position]()
        if not _done(other):
            found.append(other)
    return found
