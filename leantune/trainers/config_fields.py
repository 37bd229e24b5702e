"""What a config's validation asks of its fields, shared by every config and its option groups (memory_options.py,
config_utils.py): which fields a user set away from their defaults."""

from __future__ import annotations

import dataclasses


def non_default(args, *names: str) -> list[str]:
    """The named fields whose values differ from their dataclass defaults (options that only matter when another
    field switches them on are rejected when set without it)."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    return [name for name in names if getattr(args, name) != defaults[name]]
