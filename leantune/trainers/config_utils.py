"""Config behaviour shared by every trainer config."""

from __future__ import annotations

import torch

from .distributed import resolve_launch


def resolve_bf16(args) -> None:
    """bf16=None (TRL's default) means: on when a bf16-capable GPU is used and fp16 is off.

    Every config calls this before TrainingArguments sets up its devices, so the launch is resolved here first: a
    multi-process launch without a GPU trains on CPU in all its processes, or stops (trainers/distributed.py)."""
    resolve_launch(args)
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


def non_default(args, *names: str) -> list[str]:
    """The named fields whose values differ from their dataclass defaults (options that only matter when another
    field switches them on are rejected when set without it)."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    return [name for name in names if getattr(args, name) != defaults[name]]


def resolve_checkpointing(args, default: bool = True) -> None:
    """Gradient checkpointing on by default, non-reentrant, under TRL's name or transformers' newer one.

    transformers 5 renamed `gradient_checkpointing*` to `activation_checkpointing*`; both are accepted here and the
    old name is cleared so that transformers does not warn about a name our users are told to use.
    """
    enabled = args.activation_checkpointing
    if enabled is None:
        enabled = args.gradient_checkpointing
    if enabled is None:
        enabled = default
    kwargs = args.activation_checkpointing_kwargs or args.gradient_checkpointing_kwargs
    if isinstance(kwargs, str):
        import json

        kwargs = json.loads(kwargs)
    if enabled:
        kwargs = {"use_reentrant": False, **(kwargs or {})}
    args.activation_checkpointing, args.activation_checkpointing_kwargs = enabled, kwargs
    args.gradient_checkpointing = args.gradient_checkpointing_kwargs = None
