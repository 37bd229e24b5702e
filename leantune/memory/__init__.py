"""Memory techniques that wrap the model's forward: activation offloading."""

from leantune.memory.offloading import (
    OFFLOADING_SCOPE_MESSAGE,
    ActivationOffloader,
    log_offloading_scope,
    offloading_context,
)

__all__ = ["OFFLOADING_SCOPE_MESSAGE", "ActivationOffloader", "log_offloading_scope", "offloading_context"]
