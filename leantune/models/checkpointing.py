"""Activation checkpointing under either of its names: transformers 5.19 renamed `gradient_checkpointing*` to
`activation_checkpointing*`. Shared by the configs (trainers/config_utils.py resolves the setting once), the trainers
that enable it on a model of their own, and the planner, which reads and varies it."""

from __future__ import annotations

import dataclasses


def checkpointing_field(args) -> str:
    """The name this transformers reads: `activation_checkpointing` from 5.19 (the rename), else the old one.

    A declared field, not `hasattr`: setting `args.activation_checkpointing` on an older transformers' config makes
    the attribute exist without transformers ever reading it."""
    declared = {field.name for field in dataclasses.fields(args)}
    return "activation_checkpointing" if "activation_checkpointing" in declared else "gradient_checkpointing"


def checkpointing_setting(args) -> tuple[bool, dict | None]:
    """(on, kwargs) of activation checkpointing, after `resolve_checkpointing`, whichever name transformers reads."""
    name = checkpointing_field(args)
    return bool(getattr(args, name)), getattr(args, f"{name}_kwargs")


def set_checkpointing(args, enabled: bool) -> None:
    setattr(args, checkpointing_field(args), enabled)


def enable_model_checkpointing(model, kwargs: dict | None) -> bool:
    """Turn on a model's checkpointing under the method's new name or its old one; False when it has neither."""
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(model, "gradient_checkpointing_enable",
                                                                                None)
    if enable is None:
        return False
    enable(kwargs)
    return True
