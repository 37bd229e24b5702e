"""Checkpoint offload in the plan: how many decoder layers' checkpointed inputs go to host memory, what that takes
of the host, and the refusal of a run the host cannot hold (memory/checkpoint_offload.py is the technique).

The fake step runs the offload itself: an offloaded input leaves the traced device when its layer's forward ends and
comes back for its recompute, and the host's bytes are the offloader's ledger (`TracedStep.host_bytes`). A model
traced whole (up to planner.LAYERS_TRACED's largest) is traced with the layers asked for: exact. A larger one is
traced with 2, 3 and 4 layers and extrapolated, which needs every added layer alike, so those traces offload all
layers but the last (`TRACED_ALL_BUT_LAST`); the K layers the run keeps beyond the last then add their inputs back,
K - 1 inputs of `input_bytes` each, to the device. That is exact while the step peaks before the backward of the
K-th layer from the end (the forward's end, the head, the first layers' backward: where long rows peak), and a bound
above it otherwise (a full fine-tune's gradients may peak later, when those inputs are already freed).
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from ..memory import offloading
from ..memory.checkpoint_offload import AUTO, auto_layers, check_host_memory, host_available_bytes, pinned_bytes
from ..methods import PREFERENCE_DATA
from ..metrics.devices import GPUS, parse_budget
from .planned_run import dtype_of, method_of, model_config_of
from .zero import run_host_bytes as zero_host_bytes

FIELD = "checkpoint_offload_layers"
TRACED_ALL_BUT_LAST = -1  # the traces' own value for an extrapolated model: every layer but the last offloaded


def requested(fields: dict) -> int | str | None:
    """The fields' offload: None when off, else a number of layers or "auto"."""
    value = fields.get(FIELD)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    return None if value in (None, 0) else value


def traced_fields(fields: dict, extrapolated: bool) -> dict:
    """The fields a trace runs with: as given for a model traced whole, all but the last layer for the traces an
    extrapolation is made from, and all but the last for "auto" (its count is chosen from that trace)."""
    value = requested(fields)
    if value is None or (not extrapolated and value != AUTO):
        return fields
    return {**fields, FIELD: TRACED_ALL_BUT_LAST}


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """The plan's offload: `layers` of `total_layers` inputs in host memory, `input_bytes` each (the worst batch's),
    `host_bytes` on the host (pinned blocks for a GPU plan), against `host_available` bytes."""

    layers: int
    total_layers: int
    input_bytes: int
    host_bytes: int
    host_available: int
    kept_added_bytes: int  # what the device holds beyond the traced offload: the kept layers' inputs (see above)
    why: str

    def lines(self) -> list[str]:
        return [f"checkpoint offload: the inputs of {self.layers} of {self.total_layers} decoder layers in host memory "
                f"({self.input_bytes / 2**20:,.1f} MiB each): {self.host_bytes / 2**30:.2f} GiB of the host's "
                f"{self.host_available / 2**30:.2f} GiB available ({self.why})"]


def host_limit_of(host_memory) -> int:
    """The host memory a plan holds the offload against: a size ("128GiB") or bytes, else this machine's available."""
    if host_memory is None:
        return host_available_bytes()
    return int(host_memory) if isinstance(host_memory, int) else parse_budget(host_memory)


def plan_offload(fields: dict, total_layers: int, traced_layers: int, traced_host_bytes: int,
                 device_total: int, budget: int | None, pinned: bool, host_available: int,
                 host_taken: int = 0) -> OffloadPlan | None:
    """The offload of a traced plan, or None when off. `traced_layers`: how many layers the trace offloaded of the
    model as planned (`total_layers - 1` when it ran with `TRACED_ALL_BUT_LAST`); `traced_host_bytes`: its ledger's
    peak, as extrapolated; `device_total`: the traced device total; `budget`: the device's memory, for "auto";
    `host_taken`: the host memory something else of the run holds (ZeRO-Offload's states), which "auto" leaves."""
    value = requested(fields)
    if value is None or traced_layers <= 0:
        return None
    input_bytes = traced_host_bytes // traced_layers
    if value == AUTO:
        most = auto_layers(total_layers, input_bytes, max(host_available - host_taken, 0), pinned)
        layers, why = most, "auto: as many as the host holds"
        if budget is not None and input_bytes:  # the fewest that fit: each layer kept adds one input to the device
            spare = budget - device_total
            fewest = max(0, traced_layers - spare // input_bytes) if spare >= 0 else traced_layers
            layers = min(most, fewest)
            why = "auto: the fewest that fit the device" + ("" if fewest <= most else ", bounded by the host")
    else:
        layers = int(value) if int(value) >= 0 else max(total_layers + int(value), 0)
        why = "as configured"
    kept = max(traced_layers - layers, 0)  # a run offloading all L counts as L - 1 on the device (a bound)
    host = layers * (pinned_bytes(input_bytes) if pinned else input_bytes)
    return OffloadPlan(layers, total_layers, input_bytes, host, host_available, kept * input_bytes, why)


def with_offload(plan, fields: dict, config, extrapolated: bool, device, host_memory, zero_host: int = 0) -> None:
    """The plan (planner.py's MemoryPlan) given its offload: the layers chosen, the kept layers' inputs added to its
    steps, the host's bytes; refused in one line when the host cannot hold them beside `zero_host` (ZeRO-Offload's
    master weights and states, per process), or cannot hold those alone. `device`: the plan's GPU or size (a GPU
    plan: pinned host blocks; "auto" fits it), "cpu" or None for this machine (without CUDA its memory is the host's
    too: the inputs count on the device as before, and the plan equals what the CPU allocator measures)."""
    value = requested(fields)
    steps = [plan.worst, plan.measured_step, plan.any_order]
    traced_host = max(step.host_bytes for step in steps if step is not None)
    if value is None:  # activation offloading's host (a CUDA run's: its trace moved them, planner.py), if on
        plan.activation_host_bytes = traced_host if fields.get("activation_offloading") else 0
        available = host_limit_of(host_memory) if zero_host or plan.activation_host_bytes else 0
        check_run_host(plan.activation_host_bytes, zero_host, available, "offloaded activations")
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)  # the model's (a multimodal one's text decoder)
    traced_layers = layers - 1 if (extrapolated or value == AUTO) else (
        int(value) if int(value) >= 0 else layers + int(value))
    sized = _sized(device)
    budget = parse_budget(device) if sized else None
    same_memory = not plans_cuda_run(device)
    offload = plan_offload(fields, layers, traced_layers, traced_host, plan.device_total_bytes, budget,
                           not same_memory, host_limit_of(host_memory), zero_host)
    if offload is None:
        return
    if same_memory:  # a run on this CPU: the host is its device, nothing saved
        offload = dataclasses.replace(offload, kept_added_bytes=traced_layers * offload.input_bytes,
                                      why=offload.why + "; on this CPU the host is the device: nothing saved")
    plan.worst = with_kept_inputs(plan.worst, offload.kept_added_bytes)
    plan.measured_step = with_kept_inputs(plan.measured_step, offload.kept_added_bytes)
    plan.any_order = with_kept_inputs(plan.any_order, offload.kept_added_bytes)
    plan.offload = offload
    plan.config = {**plan.config, FIELD: offload.layers}
    check_run_host(offload.host_bytes, zero_host, offload.host_available)


def _sized(device) -> bool:
    """A plan for a GPU named or sized (`--device h100`, "24GiB"), not for this machine."""
    return device is not None and (str(device).lower() in GPUS or re.match(r"[0-9]", str(device)) is not None)


def plans_cuda_run(device) -> bool:
    """Whether the plan is of a run on CUDA (a GPU named or sized, or this machine's GPU): its offloads copy to a host
    apart, in pinned blocks; else the run is on this CPU, whose memory is the host too."""
    return _sized(device) or (str(device).lower() != "cpu" and torch.cuda.is_available())


def host_peak(trainer) -> int:
    """The trace's offload ledger at its peak since the last call (then restarted): the traced model's checkpoint
    offload, or a CUDA plan's activation offloading (memory/offloading.py's `planned_host`); 0 without an offload."""
    peak = 0
    offloader = getattr(trainer.model, "checkpoint_offloader", None)
    for ledger in (offloader.ledger if offloader is not None else None, offloading.planned_host):
        if ledger is not None:
            peak += ledger.peak_bytes
            ledger.reset()
    return peak


LAYER_INPUTS = "`checkpoint_offload_layers`' inputs"


def check_run_host(offload_bytes: int, zero_bytes: int, available: int, offloaded: str = LAYER_INPUTS) -> None:
    """A run whose host memory, the offloaded bytes (`offloaded`: whose, the layer inputs or the activations) and
    ZeRO-Offload's (`offload_optimizer.device: cpu`) fp32 master weights, optimizer states and gradient partition
    together, exceeds the host: refused in one line naming both numbers."""
    if not zero_bytes and offloaded == LAYER_INPUTS:
        check_host_memory(offload_bytes, available)
        return
    if offload_bytes + zero_bytes <= available:
        return
    if not zero_bytes:  # the numbers first: a candidate's line keeps the first 120 characters (recommend.py)
        raise ValueError(f"`activation_offloading` needs {offload_bytes / 2**30:.2f} GiB of host memory for "
                         f"{offloaded}, and the host has {available / 2**30:.2f} GiB available; turn "
                         f"`activation_offloading` off or free host memory.")
    held = [f"{zero_bytes / 2**30:.2f} GiB for ZeRO-Offload's fp32 master weights, optimizer states and gradient "
            f"partition"] if zero_bytes else []
    held += [f"{offload_bytes / 2**30:.2f} GiB for {offloaded}"] if offload_bytes else []
    fewer = "offload fewer layers" if offloaded == LAYER_INPUTS else "turn `activation_offloading` off"
    raise ValueError(f"the run needs {(offload_bytes + zero_bytes) / 2**30:.2f} GiB of host memory ({' and '.join(held)}"
                     f"), and the host has {available / 2**30:.2f} GiB available; {fewer}"
                     f"{', keep the optimizer on the device,' if zero_bytes else ''} or free host memory.")


def with_kept_inputs(step, added: int):
    """A traced step with the kept layers' inputs added to its activations and peak."""
    if step is None or not added:
        return step
    parts = {**step.parts, "activations": step.parts.get("activations", 0) + added}
    return dataclasses.replace(step, peak_bytes=step.peak_bytes + added, parts=parts)


def run_host_bytes(config, args, rows_per_example: int, dtype_bytes: int, pinned: bool) -> tuple[int, int] | None:
    """(host bytes, layers) a run's fixed offload needs at its longest micro-batch (`per_device_train_batch_size` x
    `rows_per_example` rows of `max_length` tokens), from the model's config and the run's config alone; None for
    "auto" (bounded by the host itself) or without a `max_length` to bound the rows by."""
    value = requested({FIELD: getattr(args, FIELD, None)})
    max_length = getattr(args, "max_length", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, total = getattr(text, "hidden_size", None), getattr(text, "num_hidden_layers", None)
    if not isinstance(value, int) or not max_length or not hidden:
        return None
    layers = value if value >= 0 or total is None else max(total + value, 0)
    input_bytes = args.per_device_train_batch_size * rows_per_example * max_length * hidden * dtype_bytes
    return layers * (pinned_bytes(input_bytes) if pinned else input_bytes), layers


def refuse_run_before_loading(trainer_class, model, args, peft_config=None) -> None:
    """A run whose fixed `checkpoint_offload_layers` (at its longest micro-batch) and ZeRO-Offload's states (every
    process of this host's) the host cannot hold together: refused before its weights load, in one line naming both
    numbers (trainers/base.py calls this)."""
    if getattr(trainer_class, "traced_by_planner", False):
        return  # a plan's fake step: the plan holds its host to the host it is planned for (`with_offload`)
    offloads = requested({FIELD: getattr(args, FIELD, None)}) is not None
    if not offloads and not getattr(args, "deepspeed", None):
        return
    dtype = dtype_of({"model_init_kwargs": getattr(args, "model_init_kwargs", None)}, model)
    zero = 0
    if getattr(args, "deepspeed", None):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # the processes whose states this host holds
        zero = local * zero_host_bytes(trainer_class, model_config_of(model), {
            "deepspeed": args.deepspeed, "bf16": args.bf16, "fp16": args.fp16}, peft_config,
            int(os.environ.get("WORLD_SIZE", 1)), dtype)
    if not offloads and not zero:
        return
    rows = 2 if method_of(trainer_class).data == PREFERENCE_DATA else 1  # chosen and rejected run together
    pinned = not args.use_cpu and torch.cuda.is_available()
    needed = run_host_bytes(model_config_of(model), args, rows, dtype.itemsize, pinned)
    check_run_host(needed[0] if needed is not None else 0, zero, host_available_bytes())
