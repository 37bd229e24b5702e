"""The attention block's per-token modules over sequence tiles: each decoder layer's norms and its attention's
projections (q, k, v, o, with whatever LoRA or 4-bit layer PEFT put around them) run over tiles of the tokens, in
the forward and in the layer's checkpointed recompute (memory/sequence_tiles.py). The attention itself (RoPE,
SDPA or FlashAttention over the whole sequence) stays untiled.

Why: with the MLP tiled and the layer inputs on the host, what is left of a long row's peak is these modules' work
at full length in fp32. Llama's RMSNorm upcasts its input to fp32 and its backward makes several fp32 [tokens,
hidden] temporaries; PEFT casts each adapter's input to the adapters' fp32 and, with `lora_dropout`, keeps a mask
and the dropped input per projection (Llama-3.1-8B QLoRA at 500,000 tokens: 53 GiB in the norms and 61 GiB in
q/k/v/o's adapters at the last layer's recompute, docs/benchmarks.md). Tiled, each exists for one tile at a time;
what stays at full length is each module's input and output in the compute dtype.

Which modules: of each decoder layer (memory/mlp_kinds.py's `is_decoder_layer`), its own norms (children whose
class is a LayerNorm or an RMSNorm: per-token over the last dimension) and its attention's projections (children
of `self_attn` that are projections: `nn.Linear`, bitsandbytes' layers, GPT-2's `Conv1D`, PEFT's around them). The
tile is the tiled MLP's (`tiled_mlp_tile_size`; without one, the same rule, `tile_tokens`, at the config's MLP
width), so one tile size is planned and searched for both.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .mlp_kinds import is_decoder_layer, projection_features
from .sequence_tiles import SequenceTiled, rule_tile, tiled_class, untile

logger = logging.getLogger(__name__)

ATTENTION_NAMES = ("self_attn", "attention", "attn")


def is_norm(module: nn.Module) -> bool:
    """A per-token normalisation over the last dimension: torch's LayerNorm or RMSNorm, or a class named so
    (transformers' `LlamaRMSNorm`, `Qwen2RMSNorm`, ...)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def attention_block_modules(model: nn.Module) -> list[nn.Module]:
    """What `tiled_attention_projections` tiles in `model`: each decoder layer's own norms and its attention's
    projections, in the order the layers hold them."""
    found = []
    for layer in model.modules():
        if not is_decoder_layer(layer):
            continue
        found += [child for child in layer.children() if is_norm(child)]
        attention = next((getattr(layer, name) for name in ATTENTION_NAMES
                          if isinstance(getattr(layer, name, None), nn.Module)), None)
        if attention is not None:
            found += [child for child in attention.children() if projection_features(child) is not None]
    return found


class TiledProjection(SequenceTiled):
    """Mixed into a norm's or a projection's own class (`install_tiled_projections`): called on [..., features], it
    runs over tiles of the tokens (memory/sequence_tiles.py)."""

    tiled_projection_tile_size: int | None = None  # None: the tiled MLP's rule at `tiled_projection_width`
    tiled_projection_width: int | None = None
    tiled_projection_budget: int | None = None

    def tile_for(self, tokens: int, inputs: list[torch.Tensor]) -> int:
        if self.tiled_projection_tile_size is not None:
            return self.tiled_projection_tile_size
        width = self.tiled_projection_width or inputs[0].shape[-1]
        return rule_tile(self, "tiled_projection_budget", tokens, width, inputs[0])


def install_tiled_projections(model: nn.Module, tile_size: int | None = None, rule_width: int | None = None) -> int:
    """Tile every decoder layer's norms and attention projections of `model` (again: the tile updated); `tile_size`:
    tokens per tile, None = `tile_tokens` at `rule_width` (the config's MLP width: the tiled MLP's rule) against the
    device's free memory at the first call. Returns how many modules were tiled; a model without one is a ValueError."""
    if tile_size is not None and tile_size <= 0:
        raise ValueError(f"`tiled_mlp_tile_size` must be a positive number of tokens, got {tile_size}.")
    modules = attention_block_modules(model)
    if not modules:
        raise ValueError(f"`tiled_attention_projections=True` tiles decoder layers' norms and attention projections; "
                         f"{type(model).__name__} has no decoder layer with either: set it False.")
    for module in modules:
        if not isinstance(module, TiledProjection):
            module.__class__ = tiled_class(type(module), TiledProjection)
        module.tiled_projection_tile_size, module.tiled_projection_width = tile_size, rule_width
        module.tiled_projection_budget = None
    logger.info("Tiled attention projections: %d norms and projections run over tiles of %s.", len(modules),
                f"{tile_size} tokens" if tile_size is not None else "tokens sized at the first call by the free memory")
    return len(modules)


def remove_tiled_projections(model: nn.Module) -> None:
    """Every tiled norm and projection back to its own class."""
    for module in model.modules():
        if isinstance(module, TiledProjection):
            untile(module, ("tiled_projection_tile_size", "tiled_projection_width", "tiled_projection_budget"))
