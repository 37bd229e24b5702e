"""Which modules of a model the tiled MLP (memory/tiled_mlp.py) tiles, recognised by their structure, not their names.

A decoder layer is one of transformers' `GradientCheckpointingLayer`s (or a module with a `self_attn`), and its MLP
the child under one of the names transformers gives it (`mlp`, `feed_forward`, `ffn`, `block_sparse_moe`). Of an MLP
it tiles:

- a dense MLP, gated or not (Llama, Qwen2, GPT-2, GPT-NeoX / Pythia, Phi, Falcon, Bloom, GPT-J, StarCoder2, MPT...):
  a module with no parameters of its own whose children are two or more projections (`nn.Linear` and its
  bitsandbytes subclasses, GPT-2's `Conv1D`, PEFT's layers around either) and pointwise modules (activations,
  dropout). Projections and pointwise ops never look across tokens, so such a module is per-token;
- a mixture-of-experts block (Mixtral, Qwen2/3-MoE, gpt-oss, OLMoE, DeepSeek-V2/V3, Phi-MoE, GraniteMoE, Jamba...):
  its `experts`, called with the tokens, each token's expert indices and routing weights (each row of the output
  depends on that row of the three only), and its shared experts (dense MLPs). The router runs untiled on the whole
  sequence, so its logits (the load-balancing loss, `output_router_logits`), its top-k and any jitter are exactly the
  untiled ones: only the experts' [tokens x top_k, expert intermediate] is cut into tiles. Experts kept as a
  `ModuleList` of dense MLPs tile one expert at a time, each over the tokens routed to it.

Refused: an MLP whose projections live on the layer itself (OPT), experts called otherwise (Llama-4's, over
[experts x tokens] rows; JetMoE's), and experts split over ranks by expert parallelism (each tile would be its own
all-to-all, a count the ranks do not share).
"""

from __future__ import annotations

import inspect
import re

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.pytorch_utils import Conv1D

MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
# pointwise modules, by their kind: torch's and transformers' activations (transformers' are named `...Activation`,
# `GELUTanh`, Bloom's `BloomGelu`), dropout, identity
POINTWISE_NAME = re.compile(r"(?i)gelu|silu|relu|swish|sigmoid|tanh|activation")
POINTWISE_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def base_layer(module: nn.Module) -> nn.Module:
    """The module PEFT's layers wrap (LoRA on a projection, or on experts' parameters: `target_parameters`), else
    the module itself."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def projection_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a per-token projection: an `nn.Linear` (bitsandbytes' 4- and 8-bit layers are ones),
    GPT-2's `Conv1D` ([in, out] weight), or a PEFT layer around either; None for anything else."""
    base = base_layer(module)
    if isinstance(base, nn.Linear):
        return int(base.in_features), int(base.out_features)
    if isinstance(base, Conv1D):
        return int(base.weight.shape[0]), int(base.nf)
    return None


def is_pointwise(module: nn.Module) -> bool:
    """A module without parameters that acts on each element alone: an activation, dropout, identity."""
    if any(True for _ in module.parameters()):
        return False
    kind = type(module)
    return (isinstance(module, (nn.Dropout, nn.Identity)) or kind.__module__ in POINTWISE_MODULES
            or bool(POINTWISE_NAME.search(kind.__name__)))


def is_dense_mlp(module: nn.Module) -> bool:
    """A per-token MLP by structure: no parameters of its own, two or more projections, nothing else but pointwise
    modules (the gated Llama/Qwen2 kind and the GPT-2 / NeoX kind alike)."""
    if isinstance(module, nn.ModuleList) or any(True for _ in module.parameters(recurse=False)):
        return False
    children = list(module.children())
    projections = [child for child in children if projection_features(child) is not None]
    return len(projections) >= 2 and all(child in projections or is_pointwise(child) for child in children)


def is_routed_experts(module: nn.Module) -> bool:
    """Fused experts called as `experts(tokens, expert_indices, routing_weights)` (transformers' MoE blocks), on one
    rank (expert parallelism moves tokens between ranks per call); through PEFT's wrappers of their parameters."""
    module = base_layer(module)
    if isinstance(module, nn.ModuleList) or getattr(module, "_is_expert_parallel", False):
        return False
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


def tiled_parts(mlp: nn.Module) -> list[nn.Module] | None:
    """The modules of a layer's MLP that the tiled MLP wraps (the MLP itself, or an MoE block's experts and shared
    experts); None for an MLP it does not recognise."""
    if is_dense_mlp(mlp):
        return [mlp]
    experts = getattr(mlp, "experts", None)
    if isinstance(experts, nn.ModuleList) and len(experts) and all(is_dense_mlp(expert) for expert in experts):
        parts = list(experts)
    elif isinstance(experts, nn.Module) and is_routed_experts(experts):
        parts = [experts]
    else:
        return None
    shared = [getattr(mlp, name) for name in SHARED_EXPERT_NAMES if isinstance(getattr(mlp, name, None), nn.Module)]
    return parts + [expert for expert in shared if is_dense_mlp(expert)]


def is_decoder_layer(module: nn.Module) -> bool:
    return isinstance(module, GradientCheckpointingLayer) or isinstance(getattr(module, "self_attn", None), nn.Module)


def layer_mlps(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP (through any PEFT wrapper)."""
    mlps = []
    for module in model.modules():
        if is_decoder_layer(module):
            mlps += [getattr(module, name) for name in MLP_NAMES if isinstance(getattr(module, name, None), nn.Module)]
    return mlps


def untileable_kinds(model: nn.Module) -> list[str]:
    """The class names of the decoder MLPs the tiled MLP does not recognise (["no decoder layer with an MLP module"]
    for a model without one): empty where every one tiles."""
    mlps = layer_mlps(model)
    if not mlps:
        return ["no decoder layer with an MLP module"]
    return sorted({type(mlp).__name__ for mlp in mlps if tiled_parts(mlp) is None})


def output_projection_input(module: nn.Module, hidden_size: int) -> int | None:
    """The widest input of a projection back to `hidden_size` features (a dense MLP's down projection: its
    intermediate size), None if there is none."""
    widths = [features[0] for child in module.children()
              if (features := projection_features(child)) is not None and features[1] == hidden_size]
    return max(widths) if widths else None


def expert_intermediate_size(experts: nn.Module, hidden_size: int) -> int:
    """One expert's intermediate size: transformers' attribute for it, else the down projection's dimension that is
    not the hidden size ([experts, hidden, intermediate] or transposed)."""
    experts = base_layer(experts)
    for name in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if isinstance(getattr(experts, name, None), int):
            return getattr(experts, name)
    down = experts.down_proj
    dims = [int(size) for size in down.shape[1:]]
    return next((size for size in dims if size != hidden_size), dims[-1])


def config_intermediate_width(config) -> int | None:
    """The widest [tokens, width] a decoder MLP of `config` makes per token, for the planner's rule tile: a dense
    MLP's intermediate size (`intermediate_size`, Falcon's `ffn_hidden_size`, GPT-2's `n_inner`, else 4 x hidden),
    an MoE layer's top-k experts' together (`num_experts_per_tok` x `moe_intermediate_size`, or x
    `intermediate_size` where that is the experts'); None where the config names none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dense = next((getattr(text, name) for name in ("intermediate_size", "ffn_hidden_size", "n_inner")
                  if isinstance(getattr(text, name, None), int)), None)
    hidden = next((getattr(text, name) for name in ("n_embd", "hidden_size") if isinstance(getattr(text, name, None), int)),
                  None)
    if dense is None and hidden is not None:  # GPT-2's n_inner=None and Bloom's fixed width: 4 x hidden
        dense = 4 * hidden
    top_k = getattr(text, "num_experts_per_tok", None)
    expert = getattr(text, "moe_intermediate_size", None)
    expert = expert if isinstance(expert, int) else dense
    if not isinstance(top_k, int) or expert is None:
        return dense
    return max(dense or 0, top_k * expert)
