"""`leantune plan`: the peak memory of a training step per process before it runs (no weights loaded), and with
--memory_budget the fastest configuration that fits (planning/recommend.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import time

import torch
from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

from ..methods import find
from ..metrics.devices import GPUS, parse_budget
from ..models.loading import load_tokenizer
from ..planning import plan_memory
from ..planning.completion_length import solve_max_completion_length
from ..planning.generation_batch import pieces_for_budget, solve_generation_batch
from ..planning.length_profile import dataset_from_lengths, keep_threshold_of, sequence_lengths_of
from ..planning.length_suggestion import data_lengths, suggest_for_budget
from ..planning.max_length import solve_max_length
from ..planning.planned_run import filler_token, model_config_of
from ..planning.qlora_suggestion import suggest_qlora
from ..planning.recommend import (
    VARIED,
    Candidate,
    Recommendation,
    as_configured,
    micro_batch_group,
    recommend,
    size_words,
)
from ..planning.tile_size import launch_floor, solve_tile, token_bound
from .arguments import model_init_kwargs_from, peft_config_from, plan_argument_types
from .errors import UsageError
from .help_cache import method_flag as _method_of
from .parser import parse_command_args
from .runner import load_splits, online_reward_funcs


class _EachLineOnce(logging.Filter):
    """The planner prepares the data once per candidate it plans: each log line is shown the first time only."""

    def __init__(self):
        super().__init__()
        self.seen: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def device_planned_for(plan_args) -> tuple[str | None, str | None]:
    """(the device whose terms the plan adds, a note saying why when it was assumed). A budget given as a size on a
    machine without a GPU is this machine's CPU memory: no CUDA context or allocator terms."""
    named = plan_args.device or plan_args.memory_budget
    if plan_args.device is not None or named is None or str(named).strip().lower() in GPUS:
        return named, None

    if torch.cuda.is_available():
        return named, None
    return "cpu", (f"device: this machine's CPU (no GPU is visible and --memory_budget {plan_args.memory_budget} "
                   "names none), so no CUDA context is added; --device h100 (or any GPU name) plans for a GPU.")


def run(argv: list[str]) -> int:
    started = time.perf_counter()  # "planned in" is the whole command's time: the data, every plan, the search
    filters = {handler: _EachLineOnce() for handler in logging.getLogger().handlers}  # each handler its own
    for handler, once in filters.items():
        handler.addFilter(once)

    bars_were_on = not are_progress_bars_disabled()
    try:
        return _run(argv, started)
    finally:
        for handler, once in filters.items():
            handler.removeFilter(once)
        if bars_were_on:
            enable_progress_bars()


def _run(argv: list[str], started: float) -> int:
    try:
        method = find(_method_of(argv))
    except ValueError as error:
        raise UsageError(str(error)) from error
    trainer_class, config_class = method.trainer_class, method.config_class
    if not any(arg.split("=")[0] == "--use_cpu" for arg in argv):
        argv = [*argv, "--use_cpu", "true"]  # the plan runs here, on CPU, for any device (bf16 included)
    parsed = parse_command_args("leantune plan", plan_argument_types(method), argv)
    plan_args, script_args, model_args, config, explicit = *parsed[:2], *parsed[-3:]
    rewards = {}
    if method.online and parsed[2].reward_funcs:  # reward models among them are planned from their config.json
        rewards["reward_funcs"] = online_reward_funcs(parsed[2])
    explicit.discard("use_cpu")
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and plan_args.lengths is None):
        if model_args.model_name_or_path is None:
            raise UsageError("--model_name_or_path is required (a Hub id or local folder: only its config.json is "
                             "read).")
        raise UsageError("--dataset_name is required (the data as the trainers read it: a Hub id, a local folder or "
                         "a data file), or --lengths (leantune profile's JSON).")
    if plan_args.lengths and script_args.dataset_name is not None:
        raise UsageError("--lengths and --dataset_name: give one (the profile's row lengths, or the data).")
    if plan_args.solve is not None:
        _check_solve(plan_args, method, config)

    budget = parse_budget(plan_args.memory_budget) if plan_args.memory_budget else None
    if plan_args.host_memory is not None and not re.fullmatch(r"[0-9]*\.?[0-9]+\s*(gib|gb|g|mib|mb|m|tib|tb|b)?",
                                                            plan_args.host_memory.strip().lower()):
        raise UsageError(f"--host_memory {plan_args.host_memory}: give the run's host memory as a size, e.g. 128GiB.")
    device, assumed = device_planned_for(plan_args)
    if assumed:
        plan_args.device = device  # the budget search plans its candidates for the same device
    config_fields = {f.name for f in dataclasses.fields(config)} - {"output_dir", "use_cpu"}
    fields = {name: getattr(config, name) for name in explicit if name in config_fields}
    init = {k: v for k, v in model_init_kwargs_from(model_args).items() if k != "revision"}
    if init:
        fields["model_init_kwargs"] = {**init, **(fields.get("model_init_kwargs") or {})}
    fields.pop("eval_strategy", None)
    config.eval_strategy = "no"
    if plan_args.lengths:
        try:
            filler = filler_token(model_config_of(model_args.model_name_or_path))
        except ValueError as error:
            raise UsageError(f"--model_name_or_path {model_args.model_name_or_path}: {str(error).split(': ', 1)[-1]}") \
                from error
        try:
            train = dataset_from_lengths(plan_args.lengths, method, filler)
        except ValueError as error:
            raise UsageError(f"--lengths {plan_args.lengths}: {str(error).split(': ', 1)[-1]}") from error
    else:
        train, _ = load_splits(script_args, config)

    tokenizer = None
    if plan_args.tokenizer:
        try:
            tokenizer = load_tokenizer(plan_args.tokenizer)
        except (OSError, ValueError) as error:
            raise UsageError(f"--tokenizer {plan_args.tokenizer}: {str(error).splitlines()[0]}") from error

    def planned(plan_fields):
        try:
            return plan_memory(model_args.model_name_or_path, train, trainer_class,
                               processing_class=tokenizer, peft_config=peft_config_from(model_args),
                               num_processes=plan_args.num_processes, engine=plan_args.engine, rank=plan_args.rank,
                               device=device, host_memory=plan_args.host_memory, **rewards, **plan_fields)
        except ValueError as error:
            raise UsageError(str(error)) from error

    if budget is not None and fields.get("tiled_mlp") and fields.get("tiled_mlp_tile_size") is None:
        plan = _planned_tile(planned, fields, config, budget, device)  # as a run sizing itself (self_sizing.py)
    else:
        plan = planned(fields)
    print("\n".join(plan.lines(timing=False)))
    if assumed:
        print(f"note: {assumed}")
    if plan_args.solve == "max_completions_per_generate":
        print("\n".join(solve_generation_batch(plan, budget, config.num_generations).lines()))
    elif plan_args.solve == "max_length" and method.online:  # its rows: the longest prompt + the completions
        _quiet_progress_bars()
        solved = _solved_completion_length(plan, budget, config, fields, planned, model_args.model_name_or_path)
        print("\n".join([*solved.lines(), *_online_max_length_lines(solved, plan.generation.prompt_length)]))
    elif plan_args.solve == "max_length":
        _quiet_progress_bars()
        print("\n".join(_solved_max_length(plan, budget, fields, planned, plan_args, model_args, train,
                                            tokenizer).lines()))
    elif plan_args.solve is not None:
        _quiet_progress_bars()
        print("\n".join(_solved_completion_length(plan, budget, config, fields, planned,
                                                   model_args.model_name_or_path).lines()))
    _quiet_progress_bars()  # the search prepares the same data again: its bars once are enough
    nothing_fits = None
    if budget is not None:
        pieces = _round_pieces(plan, budget, config, plan_args.solve)
        configured = plan if not pieces else plan.with_generation_batch(pieces["max_completions_per_generate"])
        if pieces and configured.device_total_bytes <= budget:  # as a run sizing itself: the pieces were all it took
            print("the run as configured fits with its round in pieces: nothing else changes (as with --memory_budget "
                  "on the run)")
            run = Candidate({**fields, **pieces}, 1.0, configured.peak_bytes, configured.device_total_bytes)
            recommendation = Recommendation(budget, [run], run)
        else:
            recommendation = recommend(plan, budget, model_args.model_name_or_path, train, trainer_class,
                                       peft_config_from(model_args), plan_args, {**fields, **rewards, **pieces},
                                       tokenizer, group=micro_batch_group(config), keep=_kept_on_cpu(config, device),
                                       known=as_configured(config, configured) if plan_args.rank == 0 else None,
                                       least=True)
        print("\n".join(recommendation.lines()))
        if recommendation.chosen is None:
            nothing_fits = _nothing_fits(recommendation, configured)
        suggestion = None if method.online else _max_length_suggestion(  # online: prompts, --solve instead
            recommendation, plan, budget, model_args, plan_args, train, trainer_class, config_class, fields, tokenizer)
        if suggestion is not None:
            print("\n".join(suggestion.lines()))
        qlora = _qlora_suggestion(recommendation, plan, budget, model_args, plan_args, train, trainer_class,
                                  fields, tokenizer)
        if qlora is not None:
            print("\n".join(qlora.lines()))
    if plan_args.plan_json:
        with open(plan_args.plan_json, "w", encoding="utf-8") as handle:
            json.dump(plan.to_dict(), handle, indent=2, default=str)
        print(f"written: {plan_args.plan_json}", file=sys.stderr)
    print(f"planned in {time.perf_counter() - started:.1f} s")
    if nothing_fits is not None:
        raise UsageError(nothing_fits)
    return 0


def _planned_tile(planned, fields, config, budget, device):
    """The run's tiled MLP without a tile, under a budget: the largest tile whose plan fits it (planning/
    tile_size.py), set in `fields` and `config` so that the search knows the run as configured by it."""
    tile, plan, made = solve_tile(lambda size: planned({**fields, "tiled_mlp_tile_size": size}), budget,
                                  launch_floor(device), token_bound(fields))
    fields["tiled_mlp_tile_size"] = config.tiled_mlp_tile_size = tile
    fitted = "the largest whose plan fits" if plan.device_total_bytes <= budget else "the floor: none fits"
    print(f"tiled MLP: {tile:,} tokens per tile, {fitted} --memory_budget {size_words(budget)} ({made} plans; "
          f"--tiled_mlp_tile_size {tile})")
    return plan


SOLVABLE = ("max_length", "max_completion_length", "max_completions_per_generate")


def _check_solve(plan_args, method, config) -> None:
    if plan_args.solve not in SOLVABLE:
        raise UsageError(f"--solve {plan_args.solve}: not solvable; choose one of {', '.join(SOLVABLE)}.")
    if plan_args.solve == "max_length" and not (method.online or hasattr(config, "max_length")):
        raise UsageError(f"--solve max_length: {method.card_name} has no max_length.")
    if plan_args.solve != "max_length" and not method.online:
        raise UsageError(f"--solve {plan_args.solve}: only for the online methods (grpo, rloo, online_dpo, ppo), "
                         f"which generate completions.")
    if plan_args.memory_budget is None:
        raise UsageError(f"--solve {plan_args.solve} needs --memory_budget (the size or GPU to fit).")
    if plan_args.solve == "max_completions_per_generate" and config.use_vllm:
        raise UsageError("--solve max_completions_per_generate sizes transformers' generate; vLLM reserves its pool at "
                         "start (--vllm_gpu_memory_utilization), whatever a call holds.")


def _solved_completion_length(plan, budget, config, fields, planned, model):
    """The largest max_completion_length within the budget (planning/completion_length.py): each length planned
    whole, up to what the model's context leaves beside the longest prompt."""
    context = getattr(model_config_of(model), "max_position_embeddings", None)
    if context is None or plan.generation is None:
        raise UsageError("--solve max_completion_length: the model's config names no max_position_embeddings.")
    limit = int(context) - plan.generation.prompt_length
    return solve_max_completion_length(
        lambda length: planned({**fields, "max_completion_length": length}).device_total_bytes, budget, limit,
        int(config.max_completion_length), plan.device_total_bytes)


def _online_max_length_lines(solved, prompt_length: int) -> list[str]:
    """An online method's rows are its prompts (the longest, as the plan reads them) and their completions: its
    longest max_length is that prompt and the longest completions that fit."""
    if solved.length is None:
        return [f"max_length: none fits (the longest prompt is {prompt_length} tokens)"]
    return [f"longest max_length (prompt + completion) within {size_words(solved.budget)}: "
            f"{prompt_length + solved.length} = the longest prompt {prompt_length} + max_completion_length "
            f"{solved.length} (set --max_completion_length {solved.length})"]


def _solved_max_length(plan, budget, fields, planned, plan_args, model_args, train, tokenizer):
    """The longest max_length within the budget (planning/max_length.py), up to the data's longest row."""
    if plan_args.lengths:
        lengths = sequence_lengths_of(plan_args.lengths)
    else:
        try:
            lengths = data_lengths(train, tokenizer or load_tokenizer(model_args.model_name_or_path))
        except (OSError, ValueError) as error:
            raise UsageError(f"--solve max_length: the data's lengths are unknown ({str(error).splitlines()[0]}); "
                             f"--tokenizer names the tokenizer.") from error
    limit = int(max(lengths))
    known = {fields["max_length"]: plan} if fields.get("max_length") else {}
    return solve_max_length(lambda length: planned({**fields, "max_length": length}), budget, limit, known=known)


def _round_pieces(plan, budget, config, solve) -> dict:
    """As a run sizing itself does (planning/self_sizing.py): where transformers' generation round is what exceeds
    the budget, the search plans its candidates with the round generated in the largest pieces that fit; where not
    even one prompt group per call fits, no candidate can (one line, exit 2)."""
    pieces = pieces_for_budget(plan, budget, getattr(config, "num_generations", 1))
    if pieces is None:
        return {}
    if solve != "max_completions_per_generate":
        print("\n".join(pieces.lines()))
    if pieces.size is None:
        raise UsageError(f"--memory_budget {size_words(budget)}: the generation round does not fit even one prompt "
                         f"group ({pieces.group} completions) per generate call ({size_words(pieces.next_total)} on "
                         f"the device); "
                         f"a shorter --max_completion_length fits sooner (--solve max_completion_length finds the "
                         f"longest).")
    print(f"the candidates below generate the round in pieces: --max_completions_per_generate {pieces.size}")
    return {"max_completions_per_generate": pieces.size}


def _kept_on_cpu(config, device):
    """Planned for this machine's CPU, the search keeps the run's own activation offloading, as a CPU run sizing
    itself does (planning/self_sizing.py): there is nothing to offload to, so it would be a slower step that saves
    nothing."""
    if device != "cpu":
        return None
    return lambda candidate: (bool(candidate.fields.get("activation_offloading")) == bool(config.activation_offloading)
                              and not candidate.fields.get("checkpoint_offload_layers"))  # no host apart either


def _nothing_fits(recommendation, configured) -> str:
    """The one line of `leantune plan --memory_budget` when no candidate fits: the budget and the least need."""
    least = recommendation.least()
    smallest = "" if least is None else (
        f"; the least a candidate needs is {size_words(least.total_bytes)} on the device, with " +
        ", ".join(f"{k}={v}" for k, v in sorted(least.fields.items()) if k in VARIED))
    return (f"--memory_budget {size_words(recommendation.budget)}: no configuration that learns the same thing "
            f"fits{smallest} (as configured: {size_words(configured.device_total_bytes)}); what changes what is learned "
            f"(a shorter length, LoRA, QLoRA) or more processes with a sharding engine is needed.")


def _quiet_progress_bars() -> None:
    disable_progress_bars()


def _max_length_suggestion(recommendation, plan, budget, model_args, plan_args, train, trainer_class, config_class,
                           fields, tokenizer):
    """leantune profile's keep-threshold max_length, apart from the same-result candidates (planning/
    length_suggestion.py); lengths from --lengths, else from the data through the trainer's tokenisation."""
    if plan_args.lengths:
        lengths, threshold = sequence_lengths_of(plan_args.lengths), keep_threshold_of(plan_args.lengths)
    else:
        try:
            lengths = data_lengths(train, tokenizer or load_tokenizer(model_args.model_name_or_path))
        except (OSError, ValueError) as error:
            print(f"no max_length suggestion: the data's lengths are unknown ({str(error).splitlines()[0]})")
            return None
        threshold = 0.99

    def search(shorter):
        return recommend(plan, budget, model_args.model_name_or_path, train, trainer_class,
                         peft_config_from(model_args), plan_args, shorter, tokenizer, limit=4)

    return suggest_for_budget(recommendation, lengths, config_class, fields, threshold, search)


def _qlora_suggestion(recommendation, plan, budget, model_args, plan_args, train, trainer_class, fields, tokenizer):
    """A 4-bit base for a LoRA run, apart from the same-result candidates (planning/qlora_suggestion.py)."""
    def search(quantized):
        return recommend(plan, budget, model_args.model_name_or_path, train, trainer_class,
                         peft_config_from(model_args), plan_args, quantized, tokenizer, limit=4)

    return suggest_qlora(recommendation, fields, bool(model_args.use_peft), search)
