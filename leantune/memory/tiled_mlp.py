"""The sequence-tiled MLP: each decoder layer's MLP runs over tiles of the tokens, never holding [tokens, intermediate].

A decoder MLP is per-token (row i of its output depends on row i of its input only), so the tokens can be cut into
tiles and each tile run alone. In the forward the tiles run under no_grad, keeping only the MLP's input; the
backward recomputes one tile at a time with grad and adds its input and parameter gradients. The largest activation
a layer holds in its MLP is then [tile, intermediate] (a few of them), against [tokens, intermediate] untiled: at
65,536 tokens of Llama-3.1-8B (intermediate 14,336) that is ~1.75 GiB per bf16 tensor untiled, with several alive
at once in the recompute.

Being per-token makes it layout-free: padded, padding-free and packed rows, and the tokens one rank holds under
context parallelism (its shard of the sequence: the MLP never looks across tokens, so a shard's MLP is the same
whatever the other ranks hold), all tile alike. It wraps whatever the layer's `mlp` runs: a plain MLP, PEFT's LoRA
layers (their adapters' gradients come back through the same sum), bitsandbytes' 4-bit layers (frozen weights,
nothing to accumulate), Liger's SwiGLU forward bound onto the module. The tiling itself (the tiles, their
checkpointed recompute, the output written into one tensor) is memory/sequence_tiles.py's, shared with the attention
block's norms and projections (memory/tiled_projections.py, `tiled_attention_projections`). With gradient
checkpointing the layer's recompute calls the tiled MLP again, which again keeps one tile at a time.

Which modules it wraps (memory/mlp_kinds.py): dense MLPs, gated (Llama) or not (GPT-2, GPT-NeoX, Phi, Falcon), and
in an MoE layer the experts (with each token's expert indices and routing weights, cut at the same rows; the router
runs untiled, so the router logits and the load-balancing loss are the untiled ones) and the shared experts.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .mlp_kinds import (
    config_intermediate_width,
    expert_intermediate_size,
    layer_mlps,
    output_projection_input,
    tiled_parts,
    untileable_kinds,
)
from .sequence_tiles import (
    MIN_TILE_TOKENS,
    SequenceTiled,
    free_device_bytes,
    rule_tile,
    tile_tokens,
    tiled_class,
    untile,
)
from .tiled_projections import install_tiled_projections

logger = logging.getLogger(__name__)

def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """The modules the tiled MLP wraps in `model`: each decoder layer's dense MLP, an MoE layer's experts and shared
    experts (memory/mlp_kinds.py), through any PEFT wrapper."""
    return [part for mlp in layer_mlps(model) for part in tiled_parts(mlp) or []]


def can_tile(model: nn.Module) -> bool:
    """Whether every decoder layer's MLP of `model` is one this tiles (the planner asks before it offers
    `tiled_mlp`; `install_tiled_mlp` refuses the others)."""
    return not untileable_kinds(model)


class TiledMLP(SequenceTiled):
    """Mixed into an MLP's own class (`install_tiled_mlp`): calling the module runs it over tiles of the tokens
    (memory/sequence_tiles.py), `tiled_mlp_tile_size` each or, without one, `tile_tokens`' against the memory
    measured at the first call."""

    tiled_mlp_tile_size: int | None = None  # None: from `tile_tokens` against the memory measured at the first call
    tiled_mlp_budget: int | None = None

    def tile_for(self, tokens: int, inputs: list[torch.Tensor]) -> int:
        if self.tiled_mlp_tile_size is not None:
            return self.tiled_mlp_tile_size
        return rule_tile(self, "tiled_mlp_budget", tokens, mlp_intermediate_size(self, inputs), inputs[0])


def mlp_intermediate_size(mlp: nn.Module, inputs: list[torch.Tensor]) -> int:
    """The width per token of the MLP's [tokens, intermediate] tensors: a dense MLP's down projection's input (a LoRA
    or 4-bit layer keeps its features); experts': one expert's intermediate size times the experts each token is
    routed to (the expert indices' last dimension)."""
    hidden_size = inputs[0].shape[-1]
    width = output_projection_input(mlp, hidden_size)
    if width is not None:
        return width
    top_k = next((tensor.shape[-1] for tensor in inputs[1:] if not tensor.is_floating_point()), 1)
    return expert_intermediate_size(mlp, hidden_size) * top_k


def install_tiled_mlp(model: nn.Module, tile_size: int | None = None) -> int:
    """Tile every decoder layer's MLP of `model` (again: the tile updated); `tile_size`: tokens per tile, None = from
    `tile_tokens` against the device's free memory at the first call. Returns how many modules were tiled (an MoE
    layer's experts and shared experts each count); a model with a decoder MLP this does not recognise is a
    ValueError, in one line."""
    if tile_size is not None and tile_size <= 0:
        raise ValueError(f"`tiled_mlp_tile_size` must be a positive number of tokens, got {tile_size}.")
    if kinds := untileable_kinds(model):
        raise ValueError(f"`tiled_mlp=True` tiles per-token decoder MLPs (dense ones of projections and activations, "
                         f"or an MoE block's `experts(tokens, indices, weights)`); {type(model).__name__} has "
                         f"{', '.join(kinds)}: set `tiled_mlp=False`.")
    parts = decoder_mlps(model)
    for part in parts:
        if not isinstance(part, TiledMLP):
            part.__class__ = tiled_class(type(part), TiledMLP)
        part.tiled_mlp_tile_size, part.tiled_mlp_budget = tile_size, None
    logger.info("Tiled MLP: %d decoder MLPs (or MoE experts) run over tiles of %s.", len(parts),
                f"{tile_size} tokens" if tile_size is not None else "tokens sized at the first call by the free memory")
    return len(parts)


def tile_mlps(model: nn.Module, settings) -> None:
    """The trainers' hook (trainers/base.py, after Trainer's set-up, so PEFT's adapters are in place): `settings`
    (trainers/settings.py's TiledMlpSettings) on, every decoder MLP of `model` tiled; with `attention_projections`,
    the layers' norms and attention projections too, at the same tile (memory/tiled_projections.py)."""
    if settings.enabled:
        install_tiled_mlp(model, settings.tile_size)
    if settings.enabled and settings.attention_projections:
        config = getattr(model, "config", None)
        install_tiled_projections(model, settings.tile_size, None if config is None else config_intermediate_width(config))


def remove_tiled_mlp(model: nn.Module) -> None:
    """Every tiled MLP back to its own class."""
    for module in model.modules():
        if isinstance(module, TiledMLP):
            untile(module, ("tiled_mlp_tile_size", "tiled_mlp_budget"))


__all__ = ["MIN_TILE_TOKENS", "TiledMLP", "can_tile", "decoder_mlps", "free_device_bytes", "install_tiled_mlp",
           "remove_tiled_mlp", "tile_mlps", "tile_tokens"]
