"""`plan_check`: before a run trains, plan its step peak and warn when the device cannot hold it.

The plan is the one `leantune plan` makes (planning/planner.py): the trainer's own class, prepared data, fields,
adapters and tokenizer, around a fake copy of the model's config. It runs in a separate trainer instance; what that
touches globally (random number generators, accelerate's shared state, the leantune logger's level) is put back, so
the run trains exactly as it would without the check.

"Free" is what this run can still use: the device's free memory (CUDA: `torch.cuda.mem_get_info`; CPU: the
kernel's MemAvailable) plus what the run already holds there that the plan counts too (the trained model's
parameters and buffers, loaded before training starts).
"""

from __future__ import annotations

import contextlib
import logging
import random

import datasets
import numpy as np
import psutil
import torch
from accelerate.state import AcceleratorState, GradientState, PartialState

from ..metrics.devices import SEGMENT_BYTES
from ..metrics.memory_breakdown import MIB
from .planner import _explicit_fields, plan_memory

logger = logging.getLogger("leantune.plan")
GIB = 1024 * MIB


def available_memory(device: torch.device) -> int:
    """Bytes the device has free now: CUDA's free memory, or on CPU the kernel's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def held_by_model(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the model's parameters and buffers already on `device` (the plan counts them; free memory does not)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.device.type == device.type}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def plan_of_trainer(trainer):
    """The plan of the run `trainer` is about to train: its class, prepared data, explicit fields, adapters, tokenizer
    and model config (the model's own dtype)."""
    with _global_state_kept():  # a config built to find the explicit fields resets accelerate's state too
        return _plan_of_trainer(trainer)


def _plan_of_trainer(trainer):
    args = trainer.args
    fields = {name: getattr(args, name) for name in _explicit_fields(args)}
    for name in RUN_ONLY_FIELDS:
        fields.pop(name, None)
    model = _unwrapped(trainer.model)
    if getattr(model, "is_quantized", False) or getattr(getattr(model, "config", None), "quantization_config", None):
        raise ValueError("quantized (4/8-bit) models are not planned yet")

    if isinstance(trainer.train_dataset, datasets.IterableDataset):
        raise ValueError("a streamed train dataset is not planned (its rows are not all known before training)")
    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    fields["model_init_kwargs"] = {**(fields.get("model_init_kwargs") or {}), "dtype": dtype}
    peft_config = _peft_config(model)
    config = model.get_base_model().config if peft_config is not None else model.config
    return plan_memory(config, trainer.train_dataset, type(trainer), processing_class=trainer.processing_class,
                       peft_config=peft_config, plan_check=False, **fields)


# Fields of the run itself (where it writes, how it logs, on which device): the plan sets its own.
RUN_ONLY_FIELDS = ("output_dir", "logging_dir", "run_name", "report_to", "save_strategy", "save_steps", "logging_steps",
                   "logging_strategy", "eval_strategy", "eval_steps", "max_steps", "num_train_epochs", "disable_tqdm",
                   "push_to_hub", "hub_model_id", "memory_breakdown", "plan_check", "memory_budget", "use_cpu",
                   "resume_from_checkpoint", "local_rank", "model_init_kwargs", "peft_config")


def check_before_training(trainer):
    """Plan `trainer`'s run, log its predicted peak, and warn in one line when it exceeds the memory this run can use.
    Returns the plan (None when the run is not planned, said in a log line)."""
    if trainer.args.world_size > 1:
        logger.info("plan_check: %d processes; the check plans one process only: run `leantune plan --num_processes "
                    "%d` before the launch.", trainer.args.world_size, trainer.args.world_size)
        return None
    try:
        plan = plan_of_trainer(trainer)
    except Exception as error:  # noqa: BLE001 - the check advises; a plan it cannot make must not stop the run
        logger.warning("plan_check: this run could not be planned (%s: %s); training goes on unchecked.",
                       type(error).__name__, (str(error).splitlines() or [""])[0])
        return None
    report_fit(plan, trainer.model, trainer.args.device)
    return plan


def report_fit(plan, model, device: torch.device, free_bytes: int | None = None) -> bool:
    """Log the plan's peak against the memory this run can use; a one-line warning when it does not fit.

    `free_bytes`: the device's free memory (default: measured now, `available_memory`); what `model` already holds on
    the device is added to it. Returns whether the plan fits."""
    needed = plan.device_total_bytes + device_terms_of_run(plan, device)
    free = available_memory(device) if free_bytes is None else int(free_bytes)
    usable = free + held_by_model(model, device)
    logger.info("plan_check: predicted step peak %s (worst batch: %s, optimizer step %s); %s usable on %s.",
                _size(needed), plan.worst.batch, plan.worst.step, _size(usable), device)
    if needed > usable:
        logger.warning("plan_check: the predicted step peak %s exceeds the %s this run can use on %s (free %s + the "
                       "model's %s); try `leantune plan %s--memory_budget %s` with this run's flags for a "
                       "configuration that fits.", _size(needed), _size(usable), device, _size(free),
                       _size(usable - free), "--device cpu " if device.type == "cpu" else "", _budget_flag(usable))
    return needed <= usable


def device_terms_of_run(plan, device: torch.device) -> int:
    """What a CUDA run needs beyond the traced peak: the allocator's segment rounding (the CUDA context exists by now
    and is outside the free memory, so it is not added). None on CPU."""
    if device.type != "cuda":
        return 0

    return SEGMENT_BYTES


def _budget_flag(size: int) -> str:
    return f"{size / GIB:.2f}GiB" if size >= GIB else f"{size // MIB}MiB"


def _size(size: int) -> str:
    return f"{size / GIB:,.2f} GiB" if size >= 10 * GIB else f"{size / MIB:,.1f} MiB"


def _unwrapped(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _peft_config(model):
    configs = getattr(model, "peft_config", None)
    if not configs or not hasattr(model, "get_base_model"):
        return None
    return configs.get(getattr(model, "active_adapter", "default")) or next(iter(configs.values()))


@contextlib.contextmanager
def _global_state_kept():
    """Random number generators, accelerate's shared state and leantune's log level, as they were."""
    shared = [(state._shared_state, dict(state._shared_state))
              for state in (PartialState, AcceleratorState, GradientState)]
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    level = logging.getLogger("leantune").level
    try:
        yield
    finally:
        for storage, saved in shared:
            storage.clear()
            storage.update(saved)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])
        logging.getLogger("leantune").setLevel(level)
