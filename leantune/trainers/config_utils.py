"""Config behaviour shared by every trainer config."""

from __future__ import annotations


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
