"""One rank of an N-process launch, traced in this one process: the per-rank plan under FSDP2 and DDP.

A real launch gives every process a process group, the launcher's environment (world size, rank, accelerate's FSDP
settings) and a data loader that hands it its shard of each global batch. Here the process group is PyTorch's fake
one (`torch.testing._internal.distributed.fake_pg`: world size N, this process rank 0 or the rank asked for, every
collective a no-op that returns tensors of the right shapes), the environment is what `accelerate launch
--config_file examples/accelerate/<engine>.yaml --num_processes N` exports, and accelerate builds its state from it.
So the trainer is prepared as on that rank of the real launch, with that rank's batches from accelerate's sharded
loader. FSDP2: `fully_shard` per decoder layer (TRANSFORMER_BASED_WRAP) and on the root, parameters, gradients and
optimizer states as DTensors holding the rank's dim-0 shard (padded as FSDP2 pads it), each unit gathered for its
forward and backward and its gradient reduce-scattered. DDP: a stand-in holding DDP's gradient buckets where the
reducer rebuilds them (`_BucketsOfDDP`). The planner's MemoryBreakdownCallback then measures what that rank's own
breakdown measures (bench/plan_accuracy.py --engines: to the byte on CPU).

What the fake group cannot show is what a real backend holds outside tensors (NCCL's buffers: a device term,
metrics/devices.py). Everything changed for the trace is put back afterwards: the group is destroyed, accelerate's
shared state reset, the environment and the patches restored, so `plan_memory` can be called again in-process.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist
from accelerate import state as accelerate_state
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType
from torch._subclasses.fake_tensor import FakeTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

# What `accelerate launch --config_file examples/accelerate/fsdp2.yaml` exports to each process (accelerate's
# prepare_multi_gpu_env), beside the launcher's rank and world size.
FSDP2_LAUNCH_ENV = {
    "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "FSDP_SYNC_MODULE_STATES": "false", "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false", "FSDP_FORWARD_PREFETCH": "false", "FSDP_MIN_NUM_PARAMS": "0",
}
TRACED_ENGINES = ("fsdp2", "ddp")


@contextlib.contextmanager
def rank_of(engine: str, num_processes: int, rank: int = 0, gloo: bool = True):
    """This process as `rank` of `num_processes` launched under `engine`, for the duration of one plan's traces.
    `gloo`: the launch's collectives are gloo's (a CPU launch), with the buffer its reduce-scatter stages."""
    if dist.is_available() and dist.is_initialized():
        raise ValueError(f"`engine`: a {engine} plan of {num_processes} processes traces a rank in a process group "
                         "of its own; call plan_memory outside a launched run (this process already has a group).")

    launch_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_processes),
                  "LOCAL_WORLD_SIZE": str(num_processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    if engine == "fsdp2":
        launch_env.update(FSDP2_LAUNCH_ENV)
    saved = {name: os.environ.get(name) for name in launch_env}
    _reset_accelerate()
    os.environ.update(launch_env)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=num_processes)
    try:
        with _fsdp_on_cpu_state(), _fake_tensors_with_addresses(), _without_cpu_fsdp_warning(), \
                _ddp_as_its_buckets(engine == "ddp"), _gloo_reduce_scatter_staging(gloo):
            yield
    finally:
        dist.destroy_process_group()
        _reset_accelerate()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def switch_cpu_state_to_fsdp(state, fsdp_plugin=None) -> None:
    """accelerate turns FSDP on only for accelerator devices; the plan is of a GPU launch traced on CPU, so a MULTI_CPU
    state asked for FSDP becomes FSDP, as accelerate makes it on a GPU. The real CPU launches the plan is checked
    against apply the same rule (devkit/cpu_engines/sitecustomize.py)."""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or fsdp_plugin is not None
    if asked and state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.FSDP
        if fsdp_plugin is not None:
            if state._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(state._mixed_precision)
            state.fsdp_plugin = fsdp_plugin
        accelerate_state.PartialState._shared_state["distributed_type"] = state.distributed_type


@contextlib.contextmanager
def _fsdp_on_cpu_state():
    original = accelerate_state.AcceleratorState.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        switch_cpu_state_to_fsdp(self, kwargs.get("fsdp_plugin"))

    accelerate_state.AcceleratorState.__init__ = init
    try:
        yield
    finally:
        accelerate_state.AcceleratorState.__init__ = original


@contextlib.contextmanager
def _fake_tensors_with_addresses():
    """accelerate maps the optimizer's parameters to their sharded versions by `data_ptr()`; every FakeTensor answers
    0, which would map them all to one. Each fake tensor answers its own object's id instead (a parameter is mapped
    from the same object on both sides)."""
    had = "data_ptr" in vars(FakeTensor)
    original = vars(FakeTensor).get("data_ptr")
    FakeTensor.data_ptr = lambda self: id(self)
    try:
        yield
    finally:
        if had:
            FakeTensor.data_ptr = original
        else:
            del FakeTensor.data_ptr


class _BucketsOfDDP(torch.nn.Module):
    """Stands in for DistributedDataParallel in a DDP trace (its C++ reducer cannot run on fake gradients). The module
    runs as itself; what DDP adds to a step's memory is its gradient buckets, one flat copy of every trained gradient
    per dtype (`gradient_as_bucket_view=False`, PyTorch's default), which the reducer allocates again when it rebuilds
    them in the order the first backward produced the gradients: at the first forward with gradients of a
    synchronising micro-batch after that backward, so in step 2 (the step the memory breakdown measures), as
    activations. They are made there, as fake tensors of their size, and held from then on."""

    def __init__(self, module, *args, **kwargs):
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        self._synchronising_forwards = 0
        self._buckets = []

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._synchronising_forwards += 1
            if self._synchronising_forwards == 2:
                self._buckets = _flat_gradient_copies(self.module)
        return self.module(*args, **kwargs)

    def restart_trace(self) -> None:
        """The planner traces each worst batch as a run of its own: its step 2 holds buckets rebuilt there too."""
        self._synchronising_forwards, self._buckets = 0, []

    @contextlib.contextmanager
    def no_sync(self):
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before


def _flat_gradient_copies(module) -> list:
    trained = {}
    for param in module.parameters():
        if param.requires_grad:
            trained.setdefault(param.dtype, []).append(param)
    with torch.no_grad():  # a parameter's new_empty: fake like the parameters (the planner's mode makes it so)
        return [params[0].new_empty((sum(p.numel() for p in params),)) for params in trained.values()]


@contextlib.contextmanager
def _ddp_as_its_buckets(active: bool):
    if not active:
        yield
        return
    original, original_to = torch.nn.parallel.DistributedDataParallel, torch.nn.Module.to

    def to(module, *args, **kwargs):
        """accelerate moves models to the launch's device, "cpu:0" here: a fake parameter would keep that index, a
        real batch moved there (copied, as in the real run) reports "cpu", and fake tensors refuse to mix the two."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "cpu":
            device = torch.device("cpu")
        return original_to(module, device=device, dtype=dtype, non_blocking=non_blocking,
                           **({"memory_format": memory_format} if memory_format is not None else {}))

    torch.nn.parallel.DistributedDataParallel = _BucketsOfDDP
    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.parallel.DistributedDataParallel = original
        torch.nn.Module.to = original_to


@contextlib.contextmanager
def _gloo_reduce_scatter_staging(active: bool):
    """gloo's reduce-scatter copies its input into a flat buffer of its own and, when the caller waits for it, splits
    that buffer into the output (measured in a real CPU launch: MemTracker meets the buffer there, a temporary the
    size of the input, freed with the work). FSDP2 reduce-scatters each unit's gradients once per backward; at the
    root unit this buffer can be the peak's last piece. The fake group moves nothing, so the buffer is allocated here,
    at the same moment, for the same lifetime. NCCL (a GPU launch) reduce-scatters from the input itself."""
    if not active:
        yield
        return

    original = dist.reduce_scatter_single

    def reduce_scatter_single(output, input, *args, **kwargs):
        work = original(output, input, *args, **kwargs)
        if not kwargs.get("async_op", False):
            with torch.no_grad():
                torch.empty_like(input).split(output.numel())  # gloo's staged copy, met and freed at the wait
        return work

    dist.reduce_scatter_single = reduce_scatter_single
    try:
        yield
    finally:
        dist.reduce_scatter_single = original


class _DropCpuFsdpWarning(logging.Filter):
    def filter(self, record) -> bool:
        return "FSDP was asked for" not in record.getMessage()


@contextlib.contextmanager
def _without_cpu_fsdp_warning():
    """trainers/parts/distributed.py warns a real CPU launch that FSDP will not shard; the traced launch does shard."""
    logger = logging.getLogger("leantune.trainer")
    dropped = _DropCpuFsdpWarning()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def traced_launch(engine: str, num_processes: int, rank: int = 0, device=None):
    """The context a plan's traces run in: a rank (0 unless asked) of the launch for a traced engine, else this
    process as it is. `device` None or "cpu": a CPU launch (gloo's collectives); a GPU: NCCL's, which stage nothing."""
    if not 0 <= rank < num_processes:
        raise ValueError(f"`rank`: {rank} is not a rank of {num_processes} process(es).")
    if num_processes > 1 and engine in TRACED_ENGINES:
        return rank_of(engine, num_processes, rank, gloo=device is None or str(device).lower() == "cpu")
    return contextlib.nullcontext()


def each_rank():
    """Every rank of the traced launch in turn (one process: rank 0 only): while a rank is current, accelerate builds
    and iterates the data loader as that rank does, so the plan's worst batch is chosen among the micro-batches every
    rank will see, not rank 0's alone. A loader that dispatches from rank 0 (an iterable dataset's) yields rank 0's."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for rank in range(world):
        with _as_rank(rank):
            yield rank


@contextlib.contextmanager
def _as_rank(rank: int):
    shared = [PartialState._shared_state, AcceleratorState._shared_state]
    saved = [(state.get("process_index"), state.get("local_process_index")) for state in shared]
    for state in shared:
        if "process_index" in state:
            state["process_index"] = state["local_process_index"] = rank
    try:
        yield
    finally:
        for state, (index, local) in zip(shared, saved):
            if index is not None:
                state["process_index"], state["local_process_index"] = index, local
