"""Peak memory of one training step and what it is made of, on any device.

The step is watched by PyTorch's dispatch-based `MemTracker`, which sees every tensor allocation and files it
under parameters, buffers, gradients, optimizer states, activations (saved for backward) or temporaries; on CUDA
the allocator's own peak for the step is reported beside it. Watching costs time, so one step is measured.

Under a sharding engine each part is this process's share (docs/scale_out.md, "Memory per rank"): MemTracker counts
an FSDP2 DTensor by its local shard; DeepSpeed keeps what it holds outside the module's parameters and the
optimizer's state (ZeRO-3's partitions, the fp32 master copy, ZeRO-3's gradient buffers), which are handed to the
tracker by part here (`_engine_tensors`). Memory the optimizer's step allocates and frees (its temporaries, which
MemTracker files as optimizer states) is reported under temporaries.

Frozen models the trainer holds beside the trained one (a reference copy, reward models, a distillation teacher) are
resident through the whole step: their weights and buffers are a part of their own, "frozen_models", counted once per
storage (a PEFT base that serves as the reference through a disabled adapter is the trained model's, "parameters").
MemTracker would otherwise meet them only when their forward runs and file them as parameters from then on.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState, _RefType
from torch.utils._pytree import tree_flatten
from transformers import TrainerCallback

from .op_scratch import scratch_bytes
from .quantized_weights import quantization_state_tensors, visible_dequantization

logger = logging.getLogger("leantune.memory")

MIB = 1024 * 1024
PARTS = ("parameters", "buffers", "gradients", "optimizer_states", "activations", "temporaries", "other",
         "frozen_models")
_TRACKER_NAMES = {"PARAM": "parameters", "BUFFER": "buffers", "GRAD": "gradients", "OPT": "optimizer_states",
                  "ACT": "activations", "TEMP": "temporaries", "OTH": "other", "FROZEN": "frozen_models"}


@dataclass
class MemoryBreakdown:
    step: int
    device: str
    peak_bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    allocator_peak_bytes: int | None = None
    other_devices: dict[str, int] = field(default_factory=dict)  # e.g. pinned CPU memory holding offloaded tensors
    # the parts at the backward moment where all but the accumulated gradients peaks (once one is accumulated): an
    # engine that moves each gradient into a bucket of its own (ZeRO-2) peaks there, not at `peak_bytes`'s moment
    backward_beside_gradients: dict[str, int] | None = None

    def as_metrics(self) -> dict[str, float]:
        metrics = {"memory_step_peak_mb": round(self.peak_bytes / MIB, 1)}
        metrics.update({f"memory_{name}_mb": round(self.parts.get(name, 0) / MIB, 1) for name in PARTS})
        if self.allocator_peak_bytes is not None:
            metrics["memory_allocator_peak_mb"] = round(self.allocator_peak_bytes / MIB, 1)
        for device, size in self.other_devices.items():
            metrics[f"memory_{device.replace(':', '')}_peak_mb"] = round(size / MIB, 1)
        return metrics

    def line(self) -> str:
        parts = ", ".join(f"{name.replace('_', ' ')} {self.parts[name] / MIB:.1f}" for name in PARTS if self.parts.get(name))
        text = f"Memory of training step {self.step} on {self.device}: peak {self.peak_bytes / MIB:.1f} MiB = {parts}"
        if self.allocator_peak_bytes is not None:
            text += f" (CUDA allocator peak {self.allocator_peak_bytes / MIB:.1f} MiB)"
        for device, size in self.other_devices.items():
            text += f"; {device} peak {size / MIB:.1f} MiB"
        return text + "."


class StepMemoryMeter:
    """`start(model, optimizer)` before a step, `stop(step)` after its optimizer update."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._tracker = None
        self._dequantization = None

    @property
    def running(self) -> bool:
        return self._tracker is not None

    def start(self, model: torch.nn.Module, optimizer=None, frozen_models=()) -> None:
        """`frozen_models`: the models the step runs without training (trainers' `frozen_models()`)."""
        tracker = _tracker_class()()
        tracker.track_external(*(obj for obj in (model, optimizer) if obj is not None))
        found = _engine_tensors(model, optimizer)
        found[_frozen_ref_type()] = frozen_model_tensors(frozen_models)
        for part, tensors in found.items():
            for tensor in tensors:  # a storage the tracker already files (a parameter's) keeps its part
                if tensor.untyped_storage() not in tracker._WINFO:
                    tracker._update_and_maybe_create_winfos(tensor, part)

        for tensor in quantization_state_tensors(model):  # bitsandbytes' scales: held beside the weights
            if tensor.untyped_storage() not in tracker._WINFO:
                tracker._update_and_maybe_create_winfos(tensor, _param_kind())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        tracker.__enter__()
        self._tracker = tracker
        self._dequantization = visible_dequantization(model)
        self._dequantization.__enter__()

    def next_micro_batch(self) -> None:
        """Gradient accumulation calls the model again within the step; the step's peak is kept."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def stop(self, step: int) -> MemoryBreakdown | None:
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return None
        dequantization, self._dequantization = self._dequantization, None
        if dequantization is not None:
            dequantization.__exit__(None, None, None)
        tracker.__exit__(None, None, None)
        tracker.grad_hooks.remove()
        snapshot = tracker.get_tracker_snapshot("peak")
        by_device = {str(device): stats for device, stats in snapshot.items()}
        main = _device_key(self.device, by_device)
        stats = by_device.get(main, {})
        parts = {_TRACKER_NAMES.get(_kind_name(kind), "other"): int(size) for kind, size in stats.items()
                 if _kind_name(kind) != "Total"}
        # MemTracker files every allocation made inside optimizer.step() as optimizer state. What is still held once
        # the step is over is the state; the rest of the peak's share was the step's temporaries.
        after = {_TRACKER_NAMES.get(_kind_name(k), "other"): int(v) for k, v in
                 {str(d): s for d, s in tracker.get_tracker_snapshot("current").items()}.get(main, {}).items()}
        held = min(parts.get("optimizer_states", 0), after.get("optimizer_states", 0))
        if parts.get("optimizer_states", 0) > held:
            parts["temporaries"] = parts.get("temporaries", 0) + parts["optimizer_states"] - held
            parts["optimizer_states"] = held
        allocator = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            allocator = int(torch.cuda.max_memory_allocated(self.device))
        others = {name: int(s.get("Total", 0)) for name, s in by_device.items() if name != main and s.get("Total")}
        beside = {str(device): snap for device, (_, snap) in tracker.backward_beside_gradients.items()}.get(main)
        if beside is not None:
            beside = {_TRACKER_NAMES.get(_kind_name(kind), "other"): int(size) for kind, size in beside.items()
                      if _kind_name(kind) != "Total"}
        return MemoryBreakdown(step, main, int(stats.get("Total", sum(parts.values()))), parts, allocator, others,
                               beside)


def frozen_model_tensors(models) -> list[torch.Tensor]:
    """The weights and buffers of frozen models, each storage once; a ZeRO-3 engine's placeholder parameter counts by
    the partition it holds (`ds_tensor`), an FSDP2 DTensor by its local shard (MemTracker reads its inner tensor)."""
    tensors, seen = [], set()
    for model in models:
        if model is None:
            continue
        for tensor in [*model.parameters(), *model.buffers()]:
            partition = getattr(tensor, "ds_tensor", None)
            tensor = partition if isinstance(partition, torch.Tensor) else tensor
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors


_FROZEN_REF_TYPE = None


def _frozen_ref_type():
    """MemTracker's reference types with one more: frozen models' weights (its enum cannot be extended)."""
    global _FROZEN_REF_TYPE
    if _FROZEN_REF_TYPE is None:
        _FROZEN_REF_TYPE = _RefType("FrozenRefType", {"FROZEN": "Frozen models"})
    return _FROZEN_REF_TYPE.FROZEN


def _tracker_class():
    frozen = _frozen_ref_type()

    class FrozenParameterSafeTracker(MemTracker):
        """MemTracker hooks the gradient of every parameter it meets; frozen ones (PEFT base weights, a reference
        model) cannot take a hook, so they are marked as already hooked. A frozen model's storages keep their own
        part when its forward runs (MemTracker would file them as parameters from then on)."""

        def __init__(self):
            super().__init__()
            self._ref_class = (*_MemRefType, frozen)
            self.backward_beside_gradients = {}  # device: (bytes but gradients, the snapshot), see MemoryBreakdown
            self.grad_hooks = GradHookLedger()
            modules = self._mod_tracker  # its hooks are looked up on the instance when it is entered
            modules._fw_pre_hook = self.grad_hooks.wrap(modules._fw_pre_hook, lambda module, args: args)
            modules._fw_post_hook = self.grad_hooks.wrap(modules._fw_post_hook, lambda module, args, out: out)
            self.fake_mode_on_entry = None  # torch 2.13's MemTracker records it too; 2.11's does not (the lower bound)

        def __enter__(self):
            if getattr(self, "_depth", 0) == 0:  # a fake mode already on (the planner's trace) is not a nested one
                self.fake_mode_on_entry = active_fake_mode()
            return super().__enter__()

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            if reftype is not frozen and any(self._WINFO.get(st, (None,))[0] is not None and
                                             self._WINFO[st][0].reftype is frozen for st in _storages(t)):
                return set()
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = super().__torch_dispatch__(func, types, args, kwargs)
            scratch = scratch_bytes(func, args, kwargs, result)
            if scratch and result is not NotImplemented and active_fake_mode() is self.fake_mode_on_entry:
                self._count_scratch(result.device, scratch)
            return result

        def _count_scratch(self, device, size):
            """The op's peak: what is live after it, plus the scratch it held inside (metrics/op_scratch.py)."""
            snapshot = self._curr_mem_snap.setdefault(device, dict.fromkeys(self._ref_class, 0))
            kind = _MemRefType.TEMP if self._mod_tracker.is_bw and not self._in_ac else _MemRefType.ACT
            if self._in_opt:
                kind = _MemRefType.OPT
            for key in (kind, "Total"):
                snapshot[key] = snapshot.get(key, 0) + size
            self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
            for key in (kind, "Total"):
                snapshot[key] -= size

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            if not self._mod_tracker.is_bw:
                return
            for device, snapshot in self._curr_mem_snap.items():
                gradients = snapshot.get(_MemRefType.GRAD, 0)
                beside = snapshot.get("Total", 0) - gradients
                if gradients and beside > self.backward_beside_gradients.get(device, (-1, None))[0]:
                    self.backward_beside_gradients[device] = (beside, dict(snapshot))

        def _pre_fw_hook(self, module, inputs):
            # A model called twice in one step (a reference pass with the adapter disabled, gradient accumulation)
            # looks to MemTracker like a new iteration; per-module stats restart, the step's peak is kept.
            try:
                return super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.memory_tracking.pop(module, None)  # only that module: another model's stats stay for backward
                return super()._pre_fw_hook(module, inputs)

    return FrozenParameterSafeTracker


class GradHookLedger:
    """The gradient hooks MemTracker's module tracker puts on every module's inputs and outputs, to remove them when
    the meter stops (torch's `register_multi_grad_hook` returns a handle that the tracker drops).

    Why: a hook on a leaf that requires grad (a LoRA model's embedding output, made to require grad so that
    checkpointed layers backpropagate) references the leaf's gradient accumulator, which holds the leaf: a cycle
    through C++ that the garbage collector cannot break, so the leaf and its `.grad` ([batch, tokens, hidden] each)
    outlived the measured step for the rest of training. A meter leaves the run as it found it."""

    def __init__(self):
        self._added: list[tuple[weakref.ref, int]] = []  # (a tensor's hook dict, the key of a hook added to it)

    def wrap(self, hook, tensors_of):
        def watched(*args):
            flat = tree_flatten(tensors_of(*args))[0]
            tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
            before = [set(t._backward_hooks or ()) for t in tensors]
            result = hook(*args)
            for tensor, keys in zip(tensors, before):
                hooks = tensor._backward_hooks
                if hooks:
                    self._added.extend((weakref.ref(hooks), key) for key in set(hooks) - keys)
            return result

        return watched

    def remove(self) -> None:
        added, self._added = self._added, []
        for ref, key in added:
            hooks = ref()
            if hooks is not None:
                hooks.pop(key, None)


def _param_kind():
    return _MemRefType.PARAM


def _storages(tensor):
    return get_untyped_storages(tensor)


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _engine_tensors(model: torch.nn.Module, optimizer) -> dict:
    """Tensors a sharding engine holds outside the module's parameters and the optimizer's state, by MemTracker part.

    DeepSpeed ZeRO-3 leaves each module parameter an empty placeholder between uses and keeps this process's
    partition in `param.ds_tensor` (parameters); its gradient partitions and bucket buffer are allocated once, at
    start-up (gradients). ZeRO-1/2/3 keep an fp32 master copy of the partition that the torch optimizer updates
    (optimizer states, as in ZeRO's own accounting; it exists even when the model trains in fp32). FSDP2 needs nothing:
    its parameters, gradients and states are DTensors, which MemTracker counts by their local shard. DDP's gradient
    buckets live in C++ and are not visible."""
    found: dict = {_MemRefType.PARAM: [], _MemRefType.GRAD: [], _MemRefType.OPT: []}
    for param in model.parameters():
        if isinstance(getattr(param, "ds_tensor", None), torch.Tensor):
            found[_MemRefType.PARAM].append(param.ds_tensor)
    zero, seen = optimizer, 0
    while zero is not None and seen < 4 and not _is_zero_optimizer(zero):
        zero, seen = getattr(zero, "optimizer", None), seen + 1
    if zero is not None and _is_zero_optimizer(zero):
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            found[_MemRefType.OPT].extend(_tensors_in(getattr(zero, name, None)))
        found[_MemRefType.GRAD].extend(_tensors_in(getattr(zero, "grad_partitions_flat_buffer", None)))
        for bucket in (getattr(zero, "ipg_buckets", None) or {}).values():
            found[_MemRefType.GRAD].extend(_tensors_in(getattr(bucket, "buffer", None)))
    return {part: tensors for part, tensors in found.items() if tensors}


def _is_zero_optimizer(obj) -> bool:
    return type(obj).__module__.startswith("deepspeed.") and (
        hasattr(obj, "single_partition_of_fp32_groups") or hasattr(obj, "fp32_partitioned_groups_flat"))


def _tensors_in(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value] if value.numel() else []
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _kind_name(kind) -> str:
    return getattr(kind, "name", str(kind))


def _device_key(device: torch.device, by_device: dict) -> str:
    if str(device) in by_device:
        return str(device)
    for name in by_device:
        if name.split(":")[0] == device.type:
            return name
    return str(device)


class MemoryBreakdownCallback(TrainerCallback):
    """Measure one optimizer step of any transformers Trainer: by default the second (the first that holds
    optimizer states), or the only one. `on_result(MemoryBreakdown)` receives the measurement."""

    def __init__(self, device, on_result, step: int | None = None, frozen_models=None):
        """`frozen_models`: a callable returning the models the trainer holds frozen (its `frozen_models`)."""
        self.meter = StepMemoryMeter(device)
        self.on_result = on_result
        self.step = step
        self.frozen_models = frozen_models

    def _measured_step(self, state) -> int:
        if self.step is not None:
            return self.step
        return 1 if state.max_steps > 1 else 0

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self._measured_step(state) and not self.meter.running:
            self.meter.start(model, optimizer, self.frozen_models() if self.frozen_models is not None else ())

    def on_substep_end(self, args, state, control, **kwargs):
        self.meter.next_micro_batch()

    def on_step_end(self, args, state, control, **kwargs):
        if self.meter.running:
            breakdown = self.meter.stop(state.global_step)
            if breakdown is not None:
                self.on_result(breakdown)

    def on_train_end(self, args, state, control, **kwargs):
        self.meter.stop(state.global_step)
