"""The resolved config as small frozen settings, one per part: each part is given its own and never the config.

Built once at construction from the trainer's resolved copy of the config (parts/resolved_config.py); nothing here
changes afterwards. A flag's config name is read here (or by the config's own resolver, config_utils) and nowhere
else, so a renamed field (transformers' `activation_checkpointing`) is followed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config_utils import checkpointing_setting


@dataclass(frozen=True)
class Checkpointing:
    """Activation (gradient) checkpointing, whichever name transformers reads: on or off, reentrant or not.

    On, the model's cache is off (`use_cache=False`) and a PEFT model's frozen embeddings give outputs that require
    grad (`enable_input_require_grads`), without which reentrant checkpointing trains no adapter."""

    enabled: bool
    kwargs: dict = field(default_factory=dict)

    @property
    def reentrant(self) -> bool:
        return bool(self.enabled and self.kwargs.get("use_reentrant", True))  # torch's default is reentrant


def checkpointing_of(args) -> Checkpointing:
    enabled, kwargs = checkpointing_setting(args)  # after config_utils.resolve_checkpointing, under either name
    return Checkpointing(enabled, dict(kwargs or {}))
