"""Sequence tiles: a per-token module run over tiles of its tokens, in the forward and in the backward's recompute.

A module is per-token when row i of its output depends on row i of its inputs only: a decoder MLP, a projection
(`nn.Linear`, with PEFT's LoRA or bitsandbytes' 4-bit layer around it), an RMSNorm or LayerNorm. Such a module can
run one tile of rows at a time. In the forward the tiles run under no_grad, each output written into one tensor
made once, keeping only the inputs; the backward recomputes one tile at a time with grad (the forward's autocast and
generator state replayed: a non-reentrant checkpoint per tile) and adds its input and parameter gradients. What the
module makes inside (an MLP's [tokens, intermediate], an RMSNorm's fp32 upcast and its backward's temporaries, a
LoRA adapter's fp32 input and dropout mask) then exists for one tile at a time.

Being per-token makes it layout-free: padded, padding-free and packed rows, and the tokens one rank holds under
context parallelism, all tile alike. Two techniques use it: the tiled MLP (memory/tiled_mlp.py) and the attention
block's per-token modules (memory/tiled_projections.py); each mixes `SequenceTiled` into the modules it tiles and
says how large a tile is (`tile_for`).
"""

from __future__ import annotations

import contextlib

import psutil
import torch

from ..losses.token_logprobs import chunk_starts

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


def rule_tile(module, budget_attribute: str, tokens: int, width: int, hidden: torch.Tensor) -> int:
    """`tile_tokens` for a tiled module given no tile: against the device's free memory measured at its first call
    and kept in `budget_attribute` (the same tokens then always get the same tiles), in the compute dtype."""
    if getattr(module, budget_attribute) is None:
        setattr(module, budget_attribute, free_device_bytes(hidden.device))
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    return tile_tokens(tokens, width, dtype.itemsize, getattr(module, budget_attribute), device_type)


class RngState:
    """The generators' state when a tiled forward began: the backward replays it, so that dropout inside the module
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


class SequenceTilesFunction(torch.autograd.Function):
    """A per-token module over tiles of its inputs' tokens: forward under no_grad, keeping only the inputs; backward
    one tile at a time, recomputed with grad (under the forward's autocast and generator state), its inputs' gradients
    written into place and its parameters' gradients summed in fp32 and returned as this function's input gradients,
    so that autograd accumulates them (DDP's and FSDP's hooks see them as any other gradient).

    The inputs are the tokens and any per-token tensors called with them (an MoE's experts: each token's expert
    indices and routing weights; Bloom's MLP: the residual), all cut at the same rows.

    Holding the fp32 sums costs one copy of the module's trainable parameters during its backward: a LoRA adapter's
    few MiB; for a full fine-tune the module's weights, against its per-token tensors at full length saved."""

    @staticmethod
    def forward(ctx, run_tile, tile: int, count: int, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.run_tile, ctx.tile, ctx.count = run_tile, tile, count
        ctx.rng = RngState(tensors[0].device)
        device_type = tensors[0].device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(*tensors)
        with torch.no_grad():  # detached: a view of an input that requires grad would too, without a grad_fn
            return tiled_forward(run_tile, [tensor.detach() for tensor in tensors[:count]], tile)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = ctx.saved_tensors  # read once: checkpointing's saved-tensor hooks unpack each only once
        inputs, params = saved[:ctx.count], saved[ctx.count:]
        wants_input = list(ctx.needs_input_grad[3:3 + ctx.count])
        wanted = [i for i, needs in enumerate(ctx.needs_input_grad[3 + ctx.count:]) if needs]
        flats = token_rows(inputs)
        grad_flat = grad_out.reshape(flats[0].shape[0], *grad_out.shape[inputs[0].dim() - 1:])
        grad_inputs = [torch.zeros_like(flat) if wants else None for flat, wants in zip(flats, wants_input)]
        sums: list[torch.Tensor | None] = [None] * len(params)
        device_type, autocast_on, autocast_dtype = ctx.autocast
        with ctx.rng.replayed(), torch.enable_grad(), \
                torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
            for start in chunk_starts(flats[0], ctx.tile):  # every tile (a plan's fake step: first, second, last)
                pieces = [flat[start:start + ctx.tile].detach().requires_grad_(wants)
                          for flat, wants in zip(flats, wants_input)]
                targets = [piece for piece, wants in zip(pieces, wants_input) if wants] + [params[i] for i in wanted]
                grads = list(torch.autograd.grad(ctx.run_tile(*pieces), targets, grad_flat[start:start + ctx.tile],
                                                 allow_unused=True))
                for grad_input in grad_inputs:
                    grad = grads.pop(0) if grad_input is not None else None
                    if grad is not None:  # None: an input this tile's output does not depend on (zeros, as made)
                        grad_input[start:start + grad.shape[0]] = grad
                for i, grad in zip(wanted, grads):
                    if grad is not None:  # fp32 sums: a bf16 parameter's tiles add without bf16 rounding each time
                        sums[i] = grad.float() if sums[i] is None else sums[i].add_(grad)
        input_grads = [None if grad is None else grad.reshape(tensor.shape) for grad, tensor in zip(grad_inputs, inputs)]
        param_grads = [None if total is None else total.to(param.dtype) for total, param in zip(sums, params)]
        return (None, None, None, *input_grads, *param_grads)


def token_rows(inputs) -> list[torch.Tensor]:
    """Each input as [tokens, ...]: the tokens are the first input's leading dimensions ([batch, seq] or [tokens]),
    which every input shares."""
    lead = inputs[0].dim() - 1
    tokens = inputs[0].numel() // inputs[0].shape[-1]
    return [tensor.reshape(tokens, *tensor.shape[lead:]) for tensor in inputs]


def tiled_forward(run_tile, inputs, tile: int) -> torch.Tensor:
    """The module's output from its inputs' tokens `tile` at a time (any leading shape: [batch, seq, hidden] or
    [tokens, hidden]; `inputs`: a tensor, or the tokens and the per-token tensors called with them), each tile's
    output written into one [tokens, out] tensor as it comes."""
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    flats = token_rows(inputs)
    out = rows = None
    for start in chunk_starts(flats[0], tile):  # every tile; in a plan's fake step the repeats are skipped (chunk_starts)
        piece = run_tile(*[flat[start:start + tile] for flat in flats])
        if out is None:  # made in its final shape, not a view of one: the caller may add to it in place (Falcon)
            out = piece.new_empty(*inputs[0].shape[:-1], *piece.shape[1:])
            rows = out.view(flats[0].shape[0], *piece.shape[1:])
        rows[start:start + piece.shape[0]] = piece
    return out


def per_token_inputs(hidden, args: tuple) -> list[torch.Tensor] | None:
    """[hidden, *args] where the call is one this knows to be per-token: the tokens ([..., hidden], two or more
    dimensions) and any positional tensors with the same leading dimensions; None for any other call."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return None
    lead = hidden.shape[:-1]
    if not all(isinstance(arg, torch.Tensor) and arg.shape[:len(lead)] == lead for arg in args):
        return None
    return [hidden, *args]


class SequenceTiled:
    """Mixed into a per-token module's own class (`tiled_class`): calling the module runs it over tiles of the
    tokens, `tile_for(tokens, inputs)` tokens each.

    The class's `__call__` is replaced rather than the instance's `forward`, so whatever forward the module runs is
    tiled: its own, or one bound later onto the instance (Liger's SwiGLU, applied when training starts); the module's
    forward hooks run once per tile. Parameter names, state dicts and saved adapters are the module's own."""

    def tile_for(self, tokens: int, inputs: list[torch.Tensor]) -> int:
        raise NotImplementedError

    def __call__(self, hidden, *args, **kwargs):
        run_whole = super().__call__
        inputs = None if kwargs else per_token_inputs(hidden, args)
        if inputs is None:
            return run_whole(hidden, *args, **kwargs)  # not a call this knows to be per-token
        tokens = hidden.numel() // hidden.shape[-1]
        tile = self.tile_for(tokens, inputs)
        if tokens <= tile:
            return run_whole(*inputs)
        params = [param for param in self.parameters() if param.requires_grad]
        if not torch.is_grad_enabled() or not (any(tensor.requires_grad for tensor in inputs) or params):
            return tiled_forward(run_whole, [tensor.detach() for tensor in inputs], tile)
        return SequenceTilesFunction.apply(run_whole, tile, len(inputs), *inputs, *params)


_TILED_CLASSES: dict[tuple[type, type], type] = {}


def tiled_class(cls: type, mixin: type) -> type:
    """`cls` with `mixin` (a `SequenceTiled`) mixed in: one class per pair, named after `cls`."""
    if (cls, mixin) not in _TILED_CLASSES:
        _TILED_CLASSES[cls, mixin] = type(f"Tiled{cls.__name__}", (mixin, cls),
                                          {"__module__": cls.__module__, "untiled_class": cls})
    return _TILED_CLASSES[cls, mixin]


def untile(module, attributes: tuple[str, ...]) -> None:
    """A module tiled by `tiled_class` back to its own class, the mixin's instance `attributes` dropped."""
    module.__class__ = type(module).untiled_class
    for name in attributes:
        module.__dict__.pop(name, None)
