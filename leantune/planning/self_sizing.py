"""`memory_budget`: a run that sizes itself to the memory it has, before its weights load.

The run is planned as `leantune plan` plans it (planner.plan_memory: the method's own trainer on the real data, fake
weights). When that plan exceeds the budget, the budget search of `leantune plan --memory_budget` (recommend.py)
picks the fastest configuration that fits and learns the same thing, and the run trains with it. Only the fields
that search varies change (layout, checkpointing, offloading, the loss chunk, micro-batch x accumulation for the same
global batch, whole prompt groups kept); SFT keeps its own `packing`, since packed rows regroup the examples of each
step. An online method whose generation round is what exceeds the budget first generates it in pieces of whole prompt
groups (`max_completions_per_generate`, planning/generation_batch.py: the largest whose round fits), the only change
that keeps what is learned the same in distribution rather than exactly, and said so. One log block names each
change, old -> new, and the planned peak against the budget. When nothing fits, a ValueError names `memory_budget`
and the smallest planned peak.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import datasets
import torch

from ..metrics.devices import CUDA_CONTEXT_BYTES, GPUS, MIB, parse_budget
from ..models.checkpointing import checkpointing_field
from .generation_batch import SAME_IN_DISTRIBUTION, pieces_for_budget
from .plan_check import RUN_ONLY_FIELDS, _global_state_kept, _peft_config, _unwrapped
from .planner import _explicit_fields, plan_memory
from .recommend import (
    VARIED,
    Candidate,
    Recommendation,
    as_configured,
    current_value,
    micro_batch_group,
    recommend,
    size_words,
    why_turned_on,
)
from .tile_size import launch_floor, solve_tile, token_bound

logger = logging.getLogger("leantune.plan")


@dataclass
class BudgetFit:
    """What sizing a run found: the budget, the plan of the run as configured, the search (None when that plan fitted)
    and the fields it changed, name -> (old, new)."""

    budget: int
    device: str  # the device whose terms the plans add ("cpu": none)
    planned: object  # MemoryPlan of the run as configured
    recommendation: Recommendation | None = None
    changes: dict = field(default_factory=dict)
    pieces: object = None  # GenerationBatchSolve: the round generated in pieces to fit (None: as configured)

    @property
    def chosen(self) -> Candidate | None:
        return self.recommendation.chosen if self.recommendation is not None else None


def budget_of(value, on_cuda: bool) -> tuple[int, str]:
    """(bytes the plan's device total must fit, the device whose terms the plan adds).

    `auto` on CUDA: the device's free memory now. The CUDA context exists once that is read and lies outside it; the
    plan counts the context as a term, so its bytes are added back (the need is then the traced peak + the
    allocator's rounding + any vLLM pool, against the free memory). A size on a machine without CUDA is this
    machine's memory: no device terms."""
    text = str(value).strip().lower()
    if text == "auto":
        if not on_cuda:
            raise ValueError("`memory_budget`=auto reads a CUDA device's free memory, and this run has no CUDA device; "
                             "give the memory to fit as a size, e.g. 2GiB or 1500MiB.")
        free, total = torch.cuda.mem_get_info()
        return int(free) + CUDA_CONTEXT_BYTES, f"{int(total) // MIB}MiB"
    budget = parse_budget(value)
    if text in GPUS or on_cuda:
        return budget, text
    return budget, "cpu"


def fit_to_budget(trainer_class, model, args, train_dataset, processing_class=None, peft_config=None,
                  **frozen_sources):
    """(the run's config, a changed copy when the budget asked for one; the BudgetFit). `frozen_sources`: the
    method's frozen models as given (reward_funcs, teacher_model), which the plan builds fake."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("`memory_budget` sizes a one-process run; for a launch of several processes run `leantune "
                         "plan --num_processes N --engine ENGINE --memory_budget SIZE` with the run's flags and set "
                         "the flags it recommends.")
    if isinstance(train_dataset, datasets.IterableDataset):
        raise ValueError("`memory_budget` plans the run on its train rows before training, and a streamed dataset "
                         "has none until it is read; pass a datasets.Dataset, or leave `memory_budget` unset.")
    on_cuda = not args.use_cpu and torch.cuda.is_available()
    budget, device = budget_of(args.memory_budget, on_cuda)

    with _global_state_kept():  # planning builds configs and trainers: RNGs, accelerate's state, the log level kept
        source, fields, peft_config = _planned_run(model, args, peft_config)
        fields = {**fields, **{k: v for k, v in frozen_sources.items() if v is not None}}

        def plan_fields(given: dict):
            return plan_memory(source, train_dataset, trainer_class, processing_class=processing_class,
                               peft_config=peft_config, device=device, measured_step=False, **given)

        tile = None
        if fields.get("tiled_mlp") and fields.get("tiled_mlp_tile_size") is None:  # its tile from the plan
            tile, planned, _ = solve_tile(lambda size: plan_fields({**fields, "tiled_mlp_tile_size": size}), budget,
                                          launch_floor(device), token_bound(fields))
            fields["tiled_mlp_tile_size"] = tile
            args = changed_config(args, {"tiled_mlp_tile_size": tile})[0]
        else:
            planned = plan_fields(fields)
        fit = BudgetFit(budget, device, planned)
        if tile is not None:
            fit.changes["tiled_mlp_tile_size"] = (None, tile)
            logger.info("memory_budget %s: tiled_mlp's tile is %d tokens, the largest whose plan fits (%s).",
                        size_words(budget), tile, _peak_words(planned.peak_bytes, planned.device_total_bytes))
        if planned.device_total_bytes <= budget:
            logger.info("memory_budget %s: the run as configured plans %s, within it; %s.", size_words(budget),
                        _peak_words(planned.peak_bytes, planned.device_total_bytes),
                        "only tiled_mlp's tile was set" if fit.changes else "nothing changed")
            return args, fit
        planned, fit.pieces = _round_in_pieces(fit, planned, getattr(args, "num_generations", 1))
        if fit.pieces is not None:
            fields["max_completions_per_generate"] = fit.pieces.size
        keep = _keeps_run(bool(current_value(args, "packing")), bool(current_value(args, "activation_offloading")),
                          on_cuda)
        group = micro_batch_group(args)

        known = as_configured(args, planned)
        if planned.device_total_bytes <= budget:  # the round in pieces was all it took
            run = Candidate(fields, 1.0, planned.peak_bytes, planned.device_total_bytes)
            fit.recommendation = Recommendation(budget, [run], run)
        else:  # the most frugal planned too when nothing faster fits (it is the run itself: nothing more is planned)
            search = SimpleNamespace(num_processes=1, engine="ddp", device=device, memory_budget=None)
            fit.recommendation = recommend(planned, budget, source, train_dataset, trainer_class, peft_config,
                                           search, fields, processing_class, group=group, keep=keep, known=known,
                                           least=True)
    if fit.chosen is None:
        raise ValueError(_nothing_fits(fit))
    sized, changes = changed_config(args, fit.chosen.fields)
    fit.changes.update(changes)
    if fit.pieces is not None:
        fit.changes["max_completions_per_generate"] = (args.max_completions_per_generate, fit.pieces.size)
        sized.max_completions_per_generate = fit.pieces.size
    logger.info("\n".join(_change_lines(fit)))
    for line in turned_on_lines(fit):
        logger.info(line)
    return sized, fit


def turned_on_lines(fit: BudgetFit) -> list[str]:
    """One line per technique the budget turned on (recommend.TECHNIQUES): what and why."""
    return [f"turned on {name}={new} by memory_budget {size_words(fit.budget)}: {why_turned_on(name)} (the run as "
            f"configured plans {size_words(fit.planned.device_total_bytes)} on the device, over the budget)"
            for name, (old, new) in fit.changes.items() if why_turned_on(name) and new not in (None, False)]


def _round_in_pieces(fit: BudgetFit, planned, group: int):
    """(the plan, None), or where transformers' generation round is what exceeds the budget, (the plan with the
    largest piece of whole prompt groups per `generate` call whose round fits, its GenerationBatchSolve)."""
    solved = pieces_for_budget(planned, fit.budget, group)
    if solved is None:
        return planned, None
    if solved.size is None:
        raise ValueError(f"`memory_budget` {size_words(fit.budget)}: the generation round does not fit even one prompt "
                         f"group ({group} completions) per generate call ({size_words(solved.next_total)} on the device); "
                         f"a shorter `max_completion_length` fits sooner (`leantune plan --memory_budget SIZE --solve "
                         f"max_completion_length` with this run's flags finds the longest).")
    return planned.with_generation_batch(solved.size), solved


def _planned_run(model, args, peft_config):
    """(the model as the planner takes it, the run's explicit fields, its adapters): a model given by id or folder is
    planned from its config.json with the run's `model_init_kwargs`; a model object from its config, in its own dtype."""
    fields = {name: getattr(args, name) for name in _explicit_fields(args)}
    for name in (*RUN_ONLY_FIELDS, "activation_checkpointing", "activation_checkpointing_kwargs",
                 "gradient_checkpointing_kwargs"):
        if name != "model_init_kwargs" or not isinstance(model, str):
            fields.pop(name, None)
    fields["gradient_checkpointing"] = current_value(args, "gradient_checkpointing")
    if isinstance(model, str):
        return model, fields, peft_config
    model = _unwrapped(model)
    if getattr(model, "is_quantized", False) or getattr(getattr(model, "config", None), "quantization_config", None):
        raise ValueError("`memory_budget`: a quantized (4/8-bit) model object is not planned yet; pass the model by "
                         "id or folder with its quantization in `model_init_kwargs`, or leave `memory_budget` unset.")
    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    fields["model_init_kwargs"] = {"dtype": dtype}
    wrapped = _peft_config(model)
    if wrapped is not None:
        return model.get_base_model().config, fields, wrapped
    return model.config, fields, peft_config


def _keeps_run(packing: bool, offloading: bool, on_cuda: bool):
    """Which candidates a run may take: its own `packing` (packed rows regroup a step's examples), and, off CUDA, its
    own activation `offloading` (on CPU there is nothing to offload to: a slower step that saves nothing). The run's
    values are read as the search reads every field it varies (recommend.current_value)."""
    def keep(candidate: Candidate) -> bool:
        chosen = candidate.fields
        if "packing" in chosen and bool(chosen["packing"]) != packing:
            return False
        return on_cuda or (bool(chosen.get("activation_offloading")) == offloading
                           and not chosen.get("checkpoint_offload_layers"))  # nor checkpoint offload to a host apart

    return keep


def changed_config(args, fields: dict):
    """(a copy of `args` with the search's varied fields set from `fields`, {name: (old, new)} of those that
    differ). The user's config object is left as it was."""
    sized, changes = copy.copy(args), {}
    for name in VARIED:
        if name not in fields or fields[name] == current_value(args, name):
            continue
        changes[name] = (current_value(args, name), fields[name])
        if name == "gradient_checkpointing":  # as config_utils.resolve_checkpointing leaves an enabled one
            declared = checkpointing_field(sized)
            setattr(sized, declared, bool(fields[name]))
            kwargs = getattr(sized, f"{declared}_kwargs", None)
            setattr(sized, f"{declared}_kwargs", {"use_reentrant": False, **(kwargs or {})} if fields[name] else kwargs)
        else:
            setattr(sized, name, fields[name])
    return sized, changes


def _nothing_fits(fit: BudgetFit) -> str:
    least = fit.recommendation.least()
    smallest = "" if least is None else (
        f"; the smallest planned peak is {size_words(least.total_bytes)}, with " +
        ", ".join(f"{k}={v}" for k, v in sorted(least.fields.items()) if k in VARIED))
    return (f"`memory_budget` {size_words(fit.budget)}: no configuration that learns the same thing fits{smallest} (the run "
            f"as configured: {size_words(fit.planned.device_total_bytes)}); a shorter `max_length`, LoRA, 4-bit QLoRA or "
            f"more processes with a sharding engine is needed (`leantune plan --memory_budget` with this run's flags "
            f"offers them).")


def _change_lines(fit: BudgetFit) -> list[str]:
    chosen = fit.chosen
    out = [f"memory_budget {size_words(fit.budget)}: the run as configured plans "
           f"{_peak_words(fit.planned.peak_bytes, fit.planned.device_total_bytes)}, over it; it trains with the "
           f"fastest configuration that fits and learns the same thing, planned at "
           f"{_peak_words(chosen.peak_bytes, chosen.total_bytes)} (expected step time x{chosen.relative_time:.2f} "
           f"of the fastest candidate). Changed:"]
    if fit.pieces is not None:
        pieces = fit.pieces
        out.insert(1, f"  (its generation round was over the budget: each generate call now takes at most "
                      f"{pieces.size} of the round's {pieces.round_sequences} completions per process, whole prompt "
                      f"groups, its round planned at {size_words(pieces.fitting_total)} on the device; "
                      f"{SAME_IN_DISTRIBUTION}; the round, micro-batch and global batch are as configured)")
    out += [f"  {name}: {old} -> {new}" for name, (old, new) in fit.changes.items()]
    out.append("candidates planned, fastest first:")
    out += [candidate.line() for candidate in fit.recommendation.considered]
    return out


def _peak_words(peak: int, total: int) -> str:
    if total == peak:
        return f"a step peak of {size_words(peak)}"
    return f"a step peak of {size_words(peak)} ({size_words(total)} on the device)"
