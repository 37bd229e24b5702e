"""Config behaviour shared by every trainer config."""

from __future__ import annotations

import torch


def resolve_bf16(args) -> None:
    """bf16=None (TRL's default) means: on when a bf16-capable GPU is used and fp16 is off."""
    if args.bf16 is None:
        capable = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        args.bf16 = not args.fp16 and not args.use_cpu and capable


def positive_or_none(value, name: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"`{name}` must be a positive integer or None, got {value!r}.")


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
