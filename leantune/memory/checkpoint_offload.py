"""Checkpoint offload: the inputs that gradient checkpointing keeps of the first N decoder layers wait in host memory.

With gradient checkpointing each decoder layer keeps only its input (the hidden states, [tokens, hidden]) for the
backward, where the layer is recomputed from it. At long lengths these inputs are most of the step (32 GiB of the
Llama-3.1-8B step at 65,536 tokens, issue 37), and they are idle from the layer's forward to its backward. Here the
inputs of the first `layers` decoder layers are copied to host memory as the forward saves them and brought back for
their layer's recompute; when one comes back, the previous layer's (the next the backward needs) is fetched ahead.

Why the first layers: the backward needs them last, so their copies back have the most compute to hide behind; the
last layer's input is needed as soon as the backward starts, so it is the last one worth moving.

How: each chosen layer's forward runs inside a `saved_tensors_hooks` context (a forward pre-hook enters it, a forward
hook leaves it). Under checkpointing the tensors a layer saves through these outer hooks are the checkpoint's own
saved inputs (torch's non-reentrant checkpoint saves them with `_NoopSaveInputs`, the reentrant one with
`save_for_backward`); whatever the layer computes is saved under the checkpoint's inner hooks, or not at all. A saved
tensor that is the layer's hidden-states input is copied out; anything else passes through untouched.

On CUDA the copy goes to pinned host memory on a side stream (after the compute stream's pending work; the source is
`record_stream`ed so the allocator does not reuse it before the copy ends), and the copies back run on another side
stream, the compute stream waiting on each one's event. Elsewhere (CPU) the same code runs with plain synchronous
copies, so it is tested on CPU: the values are copied, never converted, so losses and gradients are bit-equal.

In the planner's fake step (planning/) a tensor has no values: its host copy is its size in `HostLedger` and its
return an empty tensor of its shape on its device. The device's memory drops exactly as in a real run; the host's is
counted by the ledger (`peak_bytes`), as it is in a real run, where pinned blocks round up to a power of two
(`pinned_bytes`).
"""

from __future__ import annotations

import logging
import weakref

import psutil
import torch
import transformers
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from transformers.modeling_layers import GradientCheckpointingLayer

logger = logging.getLogger(__name__)

AUTO = "auto"
# What "auto" leaves of the host's available memory: the data loader's workers, the tokenizer, pinned staging of the
# optimizer and the OS's own page cache must still fit.
HOST_RESERVE = 0.10


def pinned_bytes(size: int) -> int:
    """What PyTorch's pinned host allocator takes for `size` bytes: the next power of two (its caching blocks)."""
    return 1 << max(size - 1, 0).bit_length() if size > 0 else 0


def host_available_bytes() -> int:
    """The host memory the offload may take: what the OS reports available now."""
    return psutil.virtual_memory().available


def check_host_memory(needed: int, available: int, where: str = "checkpoint_offload_layers") -> None:
    """Refuse, in one line naming both numbers, an offload the host cannot hold (before anything loads)."""
    if needed > available:
        raise ValueError(f"`{where}` needs {needed / 2**30:.2f} GiB of host memory for the offloaded layer inputs, "
                         f"and the host has {available / 2**30:.2f} GiB available; offload fewer layers or free host "
                         f"memory.")


def auto_layers(total_layers: int, input_bytes: int, available: int, pinned: bool) -> int:
    """"auto" without a plan: as many of the first layers as the host holds (less `HOST_RESERVE`), never the last
    layer (its input is needed as soon as the backward starts). With `memory_budget` the plan picks instead."""
    per_layer = pinned_bytes(input_bytes) if pinned else input_bytes
    if per_layer <= 0:
        return 0
    return max(0, min(total_layers - 1, int(available * (1 - HOST_RESERVE)) // per_layer))


class HostLedger:
    """The host bytes the offloaded inputs hold now and at most (a step's: `reset` before it)."""

    def __init__(self):
        self.bytes = self.peak_bytes = 0

    def add(self, size: int) -> None:
        self.bytes += size
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def remove(self, size: int) -> None:
        self.bytes -= size

    def reset(self) -> None:
        self.peak_bytes = self.bytes


class _Offloaded:
    """One offloaded layer input: its host copy (None for a fake tensor) and where it goes back."""

    __slots__ = ("copied_out", "device", "dtype", "host", "host_size", "layer", "like", "prefetched", "shape", "stride")

    def __init__(self, tensor: torch.Tensor, layer: int):
        self.layer, self.device, self.dtype = layer, tensor.device, tensor.dtype
        self.shape, self.stride = tensor.shape, tensor.stride()
        # a fake tensor's input comes back as a fake of its shape, made from an empty fake of its own (a factory
        # without a fake input would run for real in the planner's mode: gigabytes of host memory at long rows)
        self.like = tensor.new_empty((0,)) if isinstance(tensor, FakeTensor) else None
        self.host = self.copied_out = self.prefetched = None
        self.host_size = 0


class CheckpointOffloader:
    """Offloads the checkpointed inputs of the decoder layers given to `install`; one per model."""

    def __init__(self, layers: int | None, host_limit: int | None = None):
        self.layers = layers  # None: "auto", counted at the first input from its size (`auto_layers`)
        self.total_layers = 0
        self.host_limit = host_limit  # None: the host's available memory, read at the first copy
        self.ledger = HostLedger()
        self.stats = {"inputs_offloaded": 0, "bytes_offloaded": 0, "inputs_prefetched": 0}
        self._handles: list[nn.Module] = []
        self._streams: dict[torch.device, tuple] = {}
        self._pending: dict[int, _Offloaded] = {}  # layer index -> its input's latest copy (for the prefetch)
        self._active = None  # the saved-tensor hooks while a chosen layer's forward runs
        self.copy_events: list | None = None  # a list: each CUDA copy's (start, end) events (bench/gpu's timing)

    # -- installing ---------------------------------------------------------------------------------------------

    def install(self, decoder_layers: list[nn.Module]) -> int:
        """Hook the first `self.layers` of `decoder_layers`; returns how many were hooked."""
        self.total_layers = len(decoder_layers)
        chosen = decoder_layers if self.layers is None else decoder_layers[:self.layers]
        for index, layer in enumerate(chosen):
            self._handles.append(layer.register_forward_pre_hook(self._entering(index), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._leaving, always_call=True))
        return len(chosen)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _entering(self, index: int):
        def pre_hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not (module.training and torch.is_grad_enabled() and isinstance(hidden, torch.Tensor)):
                return None
            hidden_ref = weakref.ref(hidden)  # autograd keeps the pack hook: it must not keep the input alive
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, index, hidden_ref()),
                                                             self._unpack)
            hooks.__enter__()
            self._active = hooks
            return None

        return pre_hook

    def _leaving(self, module, args, output):
        hooks, self._active = self._active, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        return None

    # -- forward: out -------------------------------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor, layer: int, hidden: torch.Tensor):
        if not _same_tensor(tensor, hidden):
            return tensor
        size = tensor.numel() * tensor.element_size()
        pin = tensor.is_cuda
        if self.host_limit is None:  # read once: later the pinned allocator's cached blocks count as used
            self.host_limit = host_available_bytes()
        limit = self.host_limit
        if self.layers is None:
            self.layers = auto_layers(self.total_layers, size, limit, pin)
            logger.info("Checkpoint offload (auto): the inputs of the first %d of %d decoder layers go to host "
                        "memory (%.2f GiB each, %.2f GiB available).", self.layers, self.total_layers,
                        size / 2**30, limit / 2**30)
        if layer >= self.layers:
            return tensor
        saved = _Offloaded(tensor, layer)
        saved.host_size = pinned_bytes(size) if pin else size
        fake = isinstance(tensor, FakeTensor)  # a plan's trace: the plan holds the host to its own numbers
        if not fake and self.ledger.bytes + saved.host_size > limit:
            check_host_memory(self.ledger.bytes + saved.host_size, limit)
        if not fake:  # a fake tensor has no values to copy: its size is the ledger's
            saved.host = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu",
                                             pin_memory=pin)
            if pin:
                stream = self._stream_pair(tensor.device)[0]
                stream.wait_stream(torch.cuda.current_stream(tensor.device))
                with torch.cuda.stream(stream):
                    start = self._timed(stream)
                    saved.host.copy_(tensor, non_blocking=True)
                    saved.copied_out = torch.cuda.Event(enable_timing=start is not None)
                    saved.copied_out.record(stream)
                    self._timed(stream, start, saved.copied_out)
                tensor.record_stream(stream)  # not reused before the copy out ends
            else:
                saved.host.copy_(tensor)
        self.ledger.add(saved.host_size)
        self._pending[layer] = saved
        self.stats["inputs_offloaded"] += 1
        self.stats["bytes_offloaded"] += size
        return saved

    # -- backward: back, the previous layer's fetched ahead -------------------------------------------------------

    def _unpack(self, saved):
        if not isinstance(saved, _Offloaded):
            return saved
        tensor = self._bring_back(saved)
        before = self._pending.get(saved.layer - 1)
        if before is not None and before.prefetched is None and before.host_size:
            before.prefetched = self._copy_in(before, prefetch=True)
            self.stats["inputs_prefetched"] += 1
        return tensor

    def _bring_back(self, saved: _Offloaded) -> torch.Tensor:
        if saved.prefetched is not None:
            tensor, event = saved.prefetched
            if event is not None:
                compute = torch.cuda.current_stream(saved.device)
                compute.wait_event(event)
                tensor.record_stream(compute)  # made on the prefetch stream, used on this one
        else:
            tensor, _ = self._copy_in(saved, prefetch=False)
        if self._pending.get(saved.layer) is saved:
            del self._pending[saved.layer]
        if saved.host_size:
            self.ledger.remove(saved.host_size)
            saved.host_size = 0
        saved.host = saved.prefetched = None
        return tensor

    def _copy_in(self, saved: _Offloaded, prefetch: bool) -> tuple[torch.Tensor, object]:
        """(the input back on its device, the event its copy ends at: None when synchronous)."""
        if saved.host is None:  # fake: an input of its shape on its device (the memory a real copy back takes)
            return saved.like.new_empty_strided(saved.shape, saved.stride), None
        if saved.copied_out is None:
            return saved.host.to(saved.device, copy=True), None
        stream = self._stream_pair(saved.device)[1] if prefetch else torch.cuda.current_stream(saved.device)
        stream.wait_event(saved.copied_out)
        with torch.cuda.stream(stream):
            tensor = torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=saved.device)
            start = self._timed(stream)
            tensor.copy_(saved.host, non_blocking=True)
            event = torch.cuda.Event(enable_timing=start is not None)
            event.record(stream)
            self._timed(stream, start, event)
        return tensor, event if prefetch else None

    def _timed(self, stream, start=None, end=None):
        """With `copy_events` on: a start event recorded on `stream` (called without `start`), or the copy's
        (start, end) kept once it is queued."""
        if self.copy_events is None:
            return None
        if start is None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            return start
        self.copy_events.append((start, end))
        return None

    def copy_seconds(self) -> float:
        """The timed copies' total time on their streams (synchronizes)."""
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.copy_events or ()) / 1000

    def _stream_pair(self, device: torch.device) -> tuple:
        """(device-to-host, host-to-device) side streams of `device`."""
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams[device]


def _same_tensor(tensor: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether a saved tensor is the layer's hidden-states input (the same object, or the same data and geometry)."""
    if hidden is None:
        return False
    if tensor is hidden:
        return True
    if isinstance(tensor, FakeTensor) or isinstance(hidden, FakeTensor) or type(tensor) is not torch.Tensor:
        return False  # a fake storage has no address to compare
    return (tensor.data_ptr() == hidden.data_ptr() and tensor.shape == hidden.shape
            and tensor.stride() == hidden.stride() and tensor.dtype == hidden.dtype)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of `model` in order (modules with `self_attn` and `mlp`), through any PEFT wrapper."""
    return [module for module in model.modules()
            if isinstance(getattr(module, "mlp", None), nn.Module) and hasattr(module, "self_attn")]


def unsupported_by_transformers() -> str | None:
    """Why this transformers cannot offload checkpointed inputs (None: it can). The hooks must run outside each
    layer's checkpoint, where they see the checkpoint save the layer's input: transformers that checkpoints a layer's
    `forward` (its module hooks outside) does; one that checkpoints the layer's whole `__call__` (e.g. 5.17) runs the
    hooks inside, where the saved input never passes them and every input would stay on the device."""
    if "__call__" not in GradientCheckpointingLayer.__dict__:
        return None
    return (f"`checkpoint_offload_layers` needs a transformers that checkpoints each decoder layer's forward with its "
            f"module hooks outside (transformers {transformers.__version__} checkpoints the whole call, where the "
            "offload cannot take the layer's input); upgrade transformers or leave it unset.")


def install_checkpoint_offload(model: nn.Module, layers: int | None,
                               host_limit: int | None = None) -> CheckpointOffloader:
    """Offload the checkpointed inputs of the first `layers` decoder layers of `model` (-k: all but the last k; None:
    "auto", `auto_layers`;
    kept on `model.checkpoint_offloader`; installing again replaces it). A model without decoder layers this
    recognises, or fewer than `layers`, is a ValueError in one line."""
    problem = unsupported_by_transformers()
    if problem:
        raise ValueError(problem)
    found = decoder_layers(model)
    if layers is not None and layers < 0:  # -k: every layer but the last k
        layers = len(found) + layers if len(found) + layers >= 0 else -1
    if not found or (layers is not None and not 0 <= layers <= len(found)):
        raise ValueError(f"`checkpoint_offload_layers` asks for more layers than {type(model).__name__} has: "
                         f"{len(found)} decoder layers (modules with `self_attn` and `mlp`); give -{len(found)} to "
                         f"{len(found)} or 'auto'.")
    remove_checkpoint_offload(model)
    offloader = CheckpointOffloader(layers, host_limit)
    offloader.install(found)
    model.checkpoint_offloader = offloader
    logger.info("Checkpoint offload: the inputs of the first %s of %d decoder layers wait in host memory.",
                AUTO if layers is None else layers, len(found))
    return offloader


def remove_checkpoint_offload(model: nn.Module) -> None:
    offloader = getattr(model, "checkpoint_offloader", None)
    if offloader is not None:
        offloader.remove()
        del model.checkpoint_offloader


def offload_checkpoints(model: nn.Module, settings) -> CheckpointOffloader | None:
    """The trainers' hook (trainers/base.py, after Trainer's set-up, so PEFT's adapters are in place): `settings`
    (trainers/settings.py's CheckpointOffloadSettings) enabled, the first of `model`'s decoder layers offloaded."""
    if not settings.enabled:
        return None
    return install_checkpoint_offload(model, None if settings.auto else settings.layers, settings.host_limit_bytes)
