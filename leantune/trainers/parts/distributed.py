"""Multi-process launches on a machine without a GPU: train in every process the launcher started, or stop.

How each CPU launch goes without this module (accelerate 1.x, transformers 5.x), and what happens here:

- `torchrun --nproc_per_node N` (and `accelerate launch --multi_gpu --num_processes N`, which is torchrun inside)
  start N processes with WORLD_SIZE=N and LOCAL_RANK set. accelerate's `PartialState` picks a collective backend
  only for a device it finds (CUDA, XPU, NPU, ...), or for CPU when asked (`cpu=True`, which TrainingArguments
  passes for `use_cpu` or ACCELERATE_USE_CPU); with neither, the state is `DistributedType.NO` and every process
  trains alone: N duplicate runs writing one output_dir. `resolve_launch` turns `use_cpu` (and gloo) on there, so
  accelerate takes its MULTI_CPU path and the N processes train as one data-parallel run.
- `accelerate launch --num_processes N` with or without `--cpu` (no GPU, no MPI hostfile): accelerate's launcher
  starts ONE process (its "simple launcher": only `--multi_gpu` and the like start several) and says nothing. That
  process cannot become N; `resolve_launch` stops it with the commands that work.
- `check_world_size` (the trainer's safety net): a launcher that started several processes while the trainer's
  state has one, for any other reason (another device kind without a backend, a state built elsewhere) stops with
  the same advice instead of training duplicates.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import os
import weakref
from collections.abc import Callable

import torch

from ...utils.faults import TrainingFault

logger = logging.getLogger("leantune.trainer")

# Environment variables through which launchers give each process its world size (torchrun; MPI implementations).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")

HOW_TO_LAUNCH = (
    "to train in N processes on CPU launch with `torchrun --nproc_per_node N <script or $(which leantune)> ...` "
    "(or `accelerate launch --multi_gpu --num_processes N ...`, which runs torchrun; leantune then trains on CPU "
    "over gloo)"
)


def launched_world_size() -> int:
    """The number of processes the launcher says it started (1 when no launcher said anything)."""
    for name in WORLD_SIZE_VARIABLES:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return 1


def has_accelerator() -> bool:
    """Whether this machine has a device (CUDA, XPU, MPS, NPU, ...) that torch can use."""
    if torch.cuda.is_available():
        return True
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


def _accelerate_launched_one_of_several() -> bool:
    """accelerate's simple launcher (it always sets ACCELERATE_USE_CPU) sets MASTER_ADDR only when asked for more
    than one process or machine, yet starts one process and gives it no world size (a MASTER_ADDR exported by hand
    before `accelerate launch` looks the same, hence the error's advice to unset it for a one-process run)."""
    return (
        "ACCELERATE_USE_CPU" in os.environ
        and "MASTER_ADDR" in os.environ
        and launched_world_size() == 1
        and "LOCAL_RANK" not in os.environ
    )


def resolve_launch(args) -> None:
    """Called from every config's __post_init__ before TrainingArguments sets up its devices (which builds
    accelerate's state from `use_cpu` and `ddp_backend`). Only machines without a GPU are touched."""
    if has_accelerator():
        return
    world = launched_world_size()
    if world > 1:
        if args.ddp_backend is None and "LOCAL_RANK" in os.environ:
            args.ddp_backend = "gloo"  # torchrun's rendezvous; accelerate would take mpi whenever torch has it
        if not args.use_cpu and os.environ.get("RANK", "0") == "0":
            logger.info("%d processes launched on a machine without a GPU: they train together on CPU (use_cpu=True, "
                        "ddp_backend=%s).", world, args.ddp_backend)
        args.use_cpu = True
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and os.environ.get("RANK", "0") == "0":
            logger.warning("FSDP was asked for, but accelerate runs FSDP only on an accelerator (GPU, XPU, ...): these "
                           "%d CPU processes train as plain data parallel, each holding the whole model. DeepSpeed "
                           "ZeRO (with DS_ACCELERATOR=cpu) shards on CPU.", world)
    elif _accelerate_launched_one_of_several():
        raise ValueError(
            "`accelerate launch --num_processes N` (with or without --cpu) started only this one process: without a "
            f"GPU accelerate's launcher runs a single process; {HOW_TO_LAUNCH}; for one process, leave out "
            "--num_processes (and unset a MASTER_ADDR exported in the shell)."
        )


def check_world_size(args) -> None:
    """The trainer's safety net: the launcher started several processes, so the trainer must use all of them."""
    world = launched_world_size()
    if world > 1 and args.world_size != world:
        raise ValueError(
            f"The launcher started {world} processes but the trainer's state has {args.world_size} (each would train "
            f"alone, a duplicate run); on a machine without a GPU {HOW_TO_LAUNCH}."
        )


def start_cpu_process_group(args) -> None:
    """Start a torchrun launch's gloo group with `ddp_timeout`, before accelerate starts it without one.

    transformers passes `ddp_timeout` to accelerate for every backend but the CPU one (`use_cpu`), so a CPU run's
    collectives waited for torch's default 30 minutes when a process stopped answering (stuck, or dead without its
    launcher noticing). accelerate starts no group when one is started already, and then uses this one."""
    if (has_accelerator() or not args.use_cpu or args.ddp_backend != "gloo" or launched_world_size() <= 1
            or "LOCAL_RANK" not in os.environ or "MASTER_ADDR" not in os.environ or getattr(args, "deepspeed", None)
            or not torch.distributed.is_available() or torch.distributed.is_initialized()):
        return
    timeout = datetime.timedelta(seconds=args.ddp_timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        torch.distributed.init_process_group(backend="gloo", timeout=timeout)
        return
    # torchrun's static rendezvous (--master_port) keeps one store over its restarts (--max-restarts): the group of a
    # restarted attempt would read the addresses its processes' predecessors wrote there and fail to connect
    # ("Gloo connectFullMesh failed ... Connection refused"). Each attempt's group gets keys of its own.
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       launched_world_size(), is_master=False, timeout=timeout)
    torch.distributed.init_process_group(backend="gloo", store=torch.distributed.PrefixStore(
        f"leantune/attempt_{attempt}", store), rank=int(os.environ["RANK"]), world_size=launched_world_size(),
        timeout=timeout)


def gather_from_all(value) -> list:
    """Every process's `value` (picklable), in rank order, on every process; one process: `[value]`. How processes
    agree on an outcome (a save that failed, the checkpoint to resume) before any of them waits on the others."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


class ProcessGroupTimeout(TrainingFault):
    """A collective waited longer than `ddp_timeout` for the other processes: one is stuck or dead."""


def is_collective_timeout(error: BaseException) -> bool:
    """Whether `error` is gloo's (or NCCL's watchdog's) report of a collective that timed out."""
    text = str(error).lower()
    peer_gone = "connection reset by peer" in text or "connection closed by peer" in text
    return isinstance(error, RuntimeError) and (peer_gone or ("timed out" in text or "timeout" in text) and (
        "gloo" in text or "nccl" in text or "collective" in text or "wait" in text))


@contextlib.contextmanager
def named_collective_timeouts(args):
    """A collective that timed out is re-raised as ProcessGroupTimeout saying what it means and what to do."""
    try:
        yield
    except RuntimeError as error:
        if torch.distributed.is_available() and torch.distributed.is_initialized() and is_collective_timeout(error):
            raise timeout_explained(args, error) from error
        raise


def timeout_explained(args, error: RuntimeError) -> ProcessGroupTimeout:
    return ProcessGroupTimeout(
        f"Process {torch.distributed.get_rank()} of {torch.distributed.get_world_size()} waited more than "
        f"ddp_timeout={args.ddp_timeout} s for the other processes in a collective operation, or lost one: one of "
        "them is stuck or died. Look at the other processes' logs; resume from the last checkpoint with "
        "resume_from_checkpoint (torchrun --max-restarts does it for you); raise ddp_timeout if a process "
        f"legitimately works alone that long (gloo said: {' '.join(str(error).split())[:300]})")


_leaves_at_exit = False
_releases_at_exit: list[weakref.WeakMethod] = []


def leave_process_group_at_exit(release_wrappers: Callable[[], None]) -> None:
    """Destroy the process group when the interpreter exits, before its teardown, after `release_wrappers` (a
    trainer's bound method, held weakly) dropped that trainer's data-parallel wrapper.

    A script that ends without `destroy_process_group()` (TRL's and most users' scripts) leaves it to C++ destructors
    at exit, where a gloo group's worker threads can abort the process ("terminate called without an active
    exception", SIGABRT) after all its work is done, and the launcher then reports a failed run. Destroying the group
    is not enough while a trainer the script still holds keeps its DDP wrapper: the wrapper's reducer holds the group,
    which then goes only with the interpreter's teardown (an intermittent abort under load, seen in
    tests/trainers/test_resume.py's two-process run)."""
    global _leaves_at_exit
    _releases_at_exit.append(weakref.WeakMethod(release_wrappers))
    if _leaves_at_exit:
        return
    _leaves_at_exit = True
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    try:
        for reference in _releases_at_exit:
            release = reference()
            if release is not None:
                release()
        gc.collect()  # the wrappers' reducers, and the group they hold, go now, while the interpreter is whole
        torch.distributed.destroy_process_group()
    except Exception as error:  # exiting anyway: say why the group could not be left, never raise
        logger.debug("Could not leave the process group at exit: %s", error)
