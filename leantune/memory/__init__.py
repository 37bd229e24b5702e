"""Memory techniques that wrap the model's forward: activation offloading, the sequence-tiled MLP."""

from leantune.memory.offloading import (
    OFFLOADING_SCOPE_MESSAGE,
    ActivationOffloader,
    log_offloading_scope,
    offloading_context,
)
from leantune.memory.tiled_mlp import install_tiled_mlp, remove_tiled_mlp, tile_tokens

__all__ = ["OFFLOADING_SCOPE_MESSAGE", "ActivationOffloader", "install_tiled_mlp", "log_offloading_scope",
           "offloading_context", "remove_tiled_mlp", "tile_tokens"]
