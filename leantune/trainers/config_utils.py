"""Config behaviour shared by every trainer config."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from ..models.checkpointing import checkpointing_field
from .config_fields import non_default
from .memory_options import validate_memory_options
from .parts.distributed import resolve_launch, start_cpu_process_group


def resolve_bf16(args) -> None:
    """bf16=None (TRL's default) means: on when a bf16-capable GPU is used and fp16 is off.

    Every config calls this before TrainingArguments sets up its devices, so the launch is resolved here first: a
    multi-process launch without a GPU trains on CPU in all its processes, or stops (trainers/parts/distributed.py)."""
    resolve_launch(args)
    start_cpu_process_group(args)
    if args.bf16 is None:
        capable = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        args.bf16 = not args.fp16 and not args.use_cpu and capable


def positive_or_none(value, name: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"`{name}` must be a positive integer or None, got {value!r}.")


def validate_batch_sizes(args) -> None:
    """Batch sizes and accumulation steps are positive integers (TrainingArguments accepts 0 and fails later)."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}; set `{name}` to 1 or more.")


# TRL fields that leantune accepts with TRL's default but does not implement yet, each with the closest thing leantune
# offers. A config refuses any other value when it is built (refuse_unsupported_trl_fields); implementing one removes
# its entry here. Fields a config does not have are skipped.
UNSUPPORTED_TRL_FIELDS: dict[str, str] = {
    # GRPO, RLOO: generation
    "vllm_model_impl": "leantune's vLLM engine uses vLLM's own model implementation",
    "vllm_structured_outputs_regex": "completions are sampled freely; check their form in a reward function",
    "vllm_group_port": "`vllm_mode='server'` syncs weights over HTTP on `vllm_server_port`",
    "use_transformers_continuous_batching": "generate with `use_vllm=True`, or with transformers' generate (default)",
    "transformers_continuous_batching_config": "it only matters with `use_transformers_continuous_batching=True`",
    "use_transformers_paged": "generate with `use_vllm=True`, or with transformers' generate (default)",
    "log_unique_prompts": "`num_completions_to_print` limits how many completions `log_completions` logs",
    "log_completions_hub_repo": "`log_completions=True` logs completions with the training log",
    # Online DPO (PPO implements it: PPOConfig.implemented_trl_fields)
    "reward_model_path": "pass the reward model (a Hub id, a folder or a model object) in `reward_funcs`",
}


def refuse_unsupported_trl_fields(args) -> None:
    """A value other than TRL's default for a field leantune does not implement yet is a one-line ValueError."""
    implemented = set(getattr(type(args), "implemented_trl_fields", ()))  # a config that implements a listed name
    names = {f.name for f in dataclasses.fields(args)} - implemented
    for name in non_default(args, *(name for name in UNSUPPORTED_TRL_FIELDS if name in names)):
        raise ValueError(f"`{name}`={getattr(args, name)!r} is not supported by leantune yet; "
                         f"{UNSUPPORTED_TRL_FIELDS[name]}.")


def resolve_checkpointing(args, default: bool = True) -> None:
    """Gradient checkpointing on by default, non-reentrant, under TRL's name or transformers' newer one.

    transformers 5 renamed `gradient_checkpointing*` to `activation_checkpointing*`; both are accepted here and the
    old name is cleared so that transformers does not warn about a name our users are told to use.
    """
    renamed = checkpointing_field(args) == "activation_checkpointing"  # before 5.19: only the old name
    enabled = args.activation_checkpointing if renamed else None
    if enabled is None:
        enabled = args.gradient_checkpointing
    if enabled is None:
        enabled = default
    kwargs = (args.activation_checkpointing_kwargs if renamed else None) or args.gradient_checkpointing_kwargs
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if enabled:
        kwargs = {"use_reentrant": False, **(kwargs or {})}
    if not renamed:
        args.gradient_checkpointing, args.gradient_checkpointing_kwargs = enabled, kwargs
        return
    args.activation_checkpointing, args.activation_checkpointing_kwargs = enabled, kwargs
    args.gradient_checkpointing = args.gradient_checkpointing_kwargs = None


def resolve_shared_settings(args) -> None:
    """What every config decides before transformers sets up: bf16 and (default-on) gradient checkpointing."""
    resolve_bf16(args)
    resolve_checkpointing(args)


def validate_shared_options(args) -> None:
    """What every config validates: the memory engine's fields, TRL fields not supported yet, batch sizes."""
    validate_memory_options(args)
    refuse_unsupported_trl_fields(args)
    validate_batch_sizes(args)
    validate_reference_sync(args)


def validate_reference_sync(args) -> None:
    """TR-DPO's reference sync (DPO, KTO, GRPO, RLOO) needs a reference model that training reads."""
    if not getattr(args, "sync_ref_model", False):
        return
    if getattr(args, "precompute_ref_log_probs", False):
        raise ValueError("`sync_ref_model=True` moves the reference during training, so reference log-probs computed "
                         "once (`precompute_ref_log_probs=True`) would go stale: turn one of them off.")
    if getattr(args, "beta", None) == 0.0 and hasattr(args, "num_generations"):
        raise ValueError("`sync_ref_model=True` with `beta=0.0`: no reference model is used, so there is nothing to "
                         "synchronize; set `sync_ref_model=False`, or a non-zero `beta`.")
    if not 0.0 <= args.ref_model_mixup_alpha <= 1.0:
        raise ValueError(f"`ref_model_mixup_alpha` must be in [0, 1], got {args.ref_model_mixup_alpha}.")
    if not isinstance(args.ref_model_sync_steps, int) or args.ref_model_sync_steps < 1:
        raise ValueError(f"`ref_model_sync_steps` must be a positive integer, got {args.ref_model_sync_steps!r}.")


def requested_cp_size(args) -> int:
    """The context-parallel size a config will run with: its `parallelism_config`, else the one accelerate builds from
    an accelerate config file (`parallelism_config_cp_size`, passed to the processes as environment variables)."""
    config = getattr(args, "parallelism_config", None)
    if config is not None and getattr(config, "cp_size", None):
        return int(config.cp_size)
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        return int(os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1") or 1)
    return 1


def resolve_pad_to_multiple_of(args) -> None:
    """Under context parallelism rows must split into 2 x cp_size equal chunks (torch's load balancing): the default
    becomes 2 x cp_size, and an explicit value that is not a multiple of it is refused."""
    cp = requested_cp_size(args)
    if cp <= 1:
        return
    needed = 2 * cp
    if args.pad_to_multiple_of is None:
        args.pad_to_multiple_of = needed
    elif args.pad_to_multiple_of % needed:
        raise ValueError(f"`pad_to_multiple_of={args.pad_to_multiple_of}` must be a multiple of 2 x cp_size = {needed} "
                         f"under context parallelism (cp_size={cp}): each row is split into {needed} equal chunks; "
                         f"set it to a multiple of {needed} or leave it unset ({needed}).")
