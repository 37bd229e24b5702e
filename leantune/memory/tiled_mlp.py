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
nothing to accumulate), Liger's SwiGLU forward bound onto the module. With gradient checkpointing the layer's
recompute calls the tiled MLP again, which again keeps one tile at a time.
"""

from __future__ import annotations

import contextlib
import logging

import psutil
import torch
from torch import nn

from ..losses.chunk_order import chunk_starts

logger = logging.getLogger(__name__)

# Below these many tokens a tile's matmuls are too small to keep the device busy: the launches, not the bytes, then
# set the time (GPU: a [1024, 4096] x [4096, 14336] matmul is ~0.2 ms on an H100, a launch ~5 us; CPU: a few
# hundred rows already fill a core's blocking).
MIN_TILE_TOKENS = {"cuda": 1024, "cpu": 256}
# The share of the budget one tile's [tile, intermediate] may take: the recompute holds ~4 such tensors at once (the
# gate and up projections, the activation and its product, and their gradients in turn), so 1/16 keeps them to ~1/4.
TILE_SHARE = 1 / 16


def tile_tokens(tokens: int, intermediate_size: int, dtype_bytes: int, budget_bytes: int, device_type: str) -> int:
    """The tokens per tile: the largest tile whose [tile, intermediate] in the compute dtype is at most `TILE_SHARE`
    of `budget_bytes` (the device's free memory, or what the plan leaves the layer's activations), but never below
    `MIN_TILE_TOKENS` of the device (there the added launches, one set of the MLP's matmuls per tile in the forward
    and two in the backward, would cost more time than the bytes save), and never above `tokens` (one tile: as
    untiled). Pure: the planner calls it with its own numbers.

    What it saves: (tokens - tile) x intermediate x dtype_bytes per intermediate tensor alive at once. What it adds:
    ceil(tokens / tile) - 1 more launches of each MLP matmul, and one more forward of the MLP (the recompute)."""
    if tokens <= 0 or intermediate_size <= 0 or dtype_bytes <= 0:
        raise ValueError(f"tile_tokens needs positive sizes, got tokens={tokens}, intermediate_size="
                         f"{intermediate_size}, dtype_bytes={dtype_bytes}.")
    by_budget = int(max(budget_bytes, 0) * TILE_SHARE) // (intermediate_size * dtype_bytes)
    floor = MIN_TILE_TOKENS.get(device_type, MIN_TILE_TOKENS["cuda"])
    return max(1, min(tokens, max(by_budget, floor)))


def free_device_bytes(device: torch.device) -> int:
    """What `tile_tokens` sizes against when the plan gave no tile: CUDA's free memory, else the host's available
    memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


class RngState:
    """The generators' state when a tiled forward began: the backward replays it, so that dropout inside the MLP
    (PEFT's `lora_dropout`) draws in each tile's recompute the mask it drew in the forward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replayed(self):
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, enabled=True):  # the run's own generators are left as they were
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class TiledMLPFunction(torch.autograd.Function):
    """The MLP over tiles of its input's tokens: forward under no_grad, keeping only the input; backward one tile at a
    time, recomputed with grad (under the forward's autocast and generator state), its input gradient written into
    place and its parameters' gradients summed in fp32 and returned as this function's input gradients, so that
    autograd accumulates them (DDP's and FSDP's hooks see them as any other gradient).

    Holding the fp32 sums costs one copy of the MLP's trainable parameters per layer during its backward: a LoRA
    adapter's few MiB; for a full fine-tune the layer's MLP weights, against [tokens, intermediate] saved."""

    @staticmethod
    def forward(ctx, run_tile, tile: int, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run_tile, ctx.tile = run_tile, tile
        ctx.rng = RngState(hidden.device)
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(hidden, *params)
        with torch.no_grad():  # detached: a view of an input that requires grad would too, without a grad_fn
            return tiled_forward(run_tile, hidden.detach(), tile)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, *params = ctx.saved_tensors
        wants_input = ctx.needs_input_grad[2]
        wanted = [i for i, needs in enumerate(ctx.needs_input_grad[3:]) if needs]
        flat = hidden.reshape(-1, hidden.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_hidden = torch.empty_like(flat) if wants_input else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        device_type, autocast_on, autocast_dtype = ctx.autocast
        with ctx.rng.replayed(), torch.enable_grad(), \
                torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
            for start in chunk_starts(flat, ctx.tile):  # every tile (a plan's fake step: first, second, last)
                piece = flat[start:start + ctx.tile].detach().requires_grad_(wants_input)
                grad_piece = grad_flat[start:start + ctx.tile]
                targets = ([piece] if wants_input else []) + [params[i] for i in wanted]
                grads = list(torch.autograd.grad(ctx.run_tile(piece), targets, grad_piece, allow_unused=True))
                if wants_input:
                    grad_hidden[start:start + piece.shape[0]] = grads.pop(0)
                for i, grad in zip(wanted, grads):
                    if grad is not None:  # fp32 sums: a bf16 parameter's tiles add without bf16 rounding each time
                        sums[i] = grad.float() if sums[i] is None else sums[i].add_(grad)
        param_grads = [None if total is None else total.to(param.dtype) for total, param in zip(sums, params)]
        return (None, None, None if grad_hidden is None else grad_hidden.reshape(hidden.shape), *param_grads)


def tiled_forward(run_tile, hidden: torch.Tensor, tile: int) -> torch.Tensor:
    """The MLP's output from its tokens `tile` at a time (any leading shape: [batch, seq, hidden] or [tokens,
    hidden]), each tile's output written into one [tokens, out] tensor as it comes."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = None
    for start in chunk_starts(flat, tile):  # every tile; in a plan's fake step the repeats are skipped (chunk_order)
        piece = run_tile(flat[start:start + tile])
        if out is None:
            out = piece.new_empty(flat.shape[0], piece.shape[-1])
        out[start:start + piece.shape[0]] = piece
    return out.reshape(*hidden.shape[:-1], out.shape[-1])


def is_gated_mlp(module: nn.Module) -> bool:
    """A Llama/Qwen2/Mistral-style per-token MLP (gate and up projections, or Phi-3's fused one, then down)."""
    return hasattr(module, "down_proj") and (hasattr(module, "up_proj") or hasattr(module, "gate_up_proj"))


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's `mlp` (a layer: a module with `self_attn` and `mlp`), through any PEFT wrapper."""
    return [module.mlp for module in model.modules()
            if isinstance(getattr(module, "mlp", None), nn.Module) and hasattr(module, "self_attn")]


def can_tile(model: nn.Module) -> bool:
    """Whether every decoder layer's MLP of `model` is one this tiles (the planner asks before it offers
    `tiled_mlp`; `install_tiled_mlp` refuses the others)."""
    mlps = decoder_mlps(model)
    return bool(mlps) and all(is_gated_mlp(mlp) for mlp in mlps)


class TiledMLP:
    """Mixed into an MLP's own class (`install_tiled_mlp`): calling the module runs it over tiles of the tokens.

    The class's `__call__` is replaced rather than the instance's `forward`, so whatever forward the module runs is
    tiled: its own, or one bound later onto the instance (Liger's SwiGLU, applied when training starts); the module's
    forward hooks run once per tile. Parameter names, state dicts and saved adapters are the module's own."""

    tiled_mlp_tile_size: int | None = None  # None: from `tile_tokens` against the memory measured at the first call
    tiled_mlp_budget: int | None = None

    def __call__(self, hidden, *args, **kwargs):
        run_whole = super().__call__
        if args or kwargs or not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            return run_whole(hidden, *args, **kwargs)  # not the one-tensor call this knows to be per-token
        tokens = hidden.numel() // hidden.shape[-1]
        tile = self.tile_for(tokens, hidden)
        if tokens <= tile:
            return run_whole(hidden)
        params = [param for param in self.parameters() if param.requires_grad]
        if not torch.is_grad_enabled() or not (hidden.requires_grad or params):
            return tiled_forward(run_whole, hidden.detach() if not torch.is_grad_enabled() else hidden, tile)
        return TiledMLPFunction.apply(run_whole, tile, hidden, *params)

    def tile_for(self, tokens: int, hidden: torch.Tensor) -> int:
        if self.tiled_mlp_tile_size is not None:
            return self.tiled_mlp_tile_size
        if self.tiled_mlp_budget is None:  # measured once: the same tokens then always get the same tiles
            self.tiled_mlp_budget = free_device_bytes(hidden.device)
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        return tile_tokens(tokens, mlp_intermediate_size(self), dtype.itemsize, self.tiled_mlp_budget, device_type)


def mlp_intermediate_size(mlp: nn.Module) -> int:
    """The width of the MLP's [tokens, intermediate] tensors: its down projection's input (a LoRA or 4-bit layer
    keeps `in_features`)."""
    down = mlp.down_proj
    size = getattr(down, "in_features", None)
    return int(size if size is not None else down.weight.shape[-1])


_TILED_CLASSES: dict[type, type] = {}


def tiled_class(cls: type) -> type:
    """`cls` with the tiled call mixed in (one per MLP class, named after it)."""
    if cls not in _TILED_CLASSES:
        _TILED_CLASSES[cls] = type(f"Tiled{cls.__name__}", (TiledMLP, cls), {"__module__": cls.__module__})
    return _TILED_CLASSES[cls]


def install_tiled_mlp(model: nn.Module, tile_size: int | None = None) -> int:
    """Tile every decoder layer's MLP of `model` (again: the tile updated); `tile_size`: tokens per tile, None = from
    `tile_tokens` against the device's free memory at the first call. Returns how many MLPs were tiled; a model
    without a decoder MLP this recognises is a ValueError, in one line."""
    if tile_size is not None and tile_size <= 0:
        raise ValueError(f"`tiled_mlp_tile_size` must be a positive number of tokens, got {tile_size}.")
    mlps = decoder_mlps(model)
    if not can_tile(model):
        kinds = sorted({type(mlp).__name__ for mlp in mlps}) or ["no decoder layer with an `mlp`"]
        raise ValueError(f"`tiled_mlp=True` tiles a Llama/Qwen2/Mistral-style per-token MLP (`layer.mlp` with "
                         f"gate/up/down projections); {type(model).__name__} has {', '.join(kinds)}: set "
                         f"`tiled_mlp=False`.")
    for mlp in mlps:
        if not isinstance(mlp, TiledMLP):
            mlp.__class__ = tiled_class(type(mlp))
        mlp.tiled_mlp_tile_size, mlp.tiled_mlp_budget = tile_size, None
    logger.info("Tiled MLP: %d decoder MLPs run over tiles of %s tokens.", len(mlps),
                tile_size if tile_size is not None else "planned (free memory)")
    return len(mlps)


def tile_mlps(model: nn.Module, settings) -> None:
    """The trainers' hook (trainers/base.py, after Trainer's set-up, so PEFT's adapters are in place): `settings`
    (trainers/settings.py's TiledMlpSettings) on, every decoder MLP of `model` tiled."""
    if settings.enabled:
        install_tiled_mlp(model, settings.tile_size)


def remove_tiled_mlp(model: nn.Module) -> None:
    """Every tiled MLP back to its own class."""
    for mlp in decoder_mlps(model):
        if isinstance(mlp, TiledMLP):
            mlp.__class__ = type(mlp).__mro__[2]
            for name in ("tiled_mlp_tile_size", "tiled_mlp_budget"):
                mlp.__dict__.pop(name, None)
