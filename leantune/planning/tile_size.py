"""The tiled MLP's tile from the plan (memory/tiled_mlp.py): what a tile saves against the launches it adds.

A tile of t tokens holds [t, intermediate] tensors in each MLP instead of [tokens, intermediate], and adds
ceil(tokens / t) - 1 launches of each MLP matmul: the larger the tile, the fewer launches and the more memory. So:

- with a budget (`--memory_budget`, or a run's `memory_budget`), the tile is the largest whose planned step fits it,
  among the launch floor (`MIN_TILE_TOKENS`: below it the launches, not the bytes, set the time) times powers of two;
  the step's peak only grows with the tile, so a bisection over those tiles finds it in a few plans;
- without one, the run's own rule (`tile_tokens`: a share of the device's memory, above the floor), with the memory of
  the device planned for (a GPU's size, or this machine's available memory on CPU), so that the plan traces the tile
  it names.

The planner offers `tiled_mlp` only where every decoder layer's MLP is one the tiled MLP can tile (`can_tile`: a
per-token dense MLP or an MoE block's experts, memory/mlp_kinds.py), judged on the model built with fake weights.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch

from ..memory.mlp_kinds import config_intermediate_width
from ..memory.tiled_mlp import MIN_TILE_TOKENS, can_tile, tile_tokens
from ..metrics.devices import parse_budget
from .fake_step import fake_model_from_config
from .planned_run import model_class_of, planning_session

UNBOUNDED_TOKENS = 1 << 40  # the rule's tile without a cap at a call's tokens (a call with fewer runs untiled)


def tiles_model(config, trainer_class) -> bool:
    """Whether the model of `config`, as `trainer_class` builds it, has only MLPs the tiled MLP can tile."""
    try:
        with planning_session() as mode:
            return can_tile(fake_model_from_config(config, mode, model_class_of(trainer_class)))
    except (ValueError, TypeError, KeyError, AttributeError):  # a config this cannot build: not offered
        return False


def launch_floor(device) -> int:
    """The smallest tile worth its launches on the device planned for (None or "cpu": this machine's CPU)."""
    return MIN_TILE_TOKENS["cpu" if device is None or str(device).lower() == "cpu" else "cuda"]


def rule_tile(config, dtype: torch.dtype, fields: dict, device) -> tuple[int | None, str]:
    """(the run's rule's tile for the device planned for, the plan's note saying so); (None, why) where the config
    names no `intermediate_size` (the run then sizes its tile at its first MLP call)."""
    intermediate = config_intermediate_width(config)  # GPT-2's n_inner, an MoE's top-k experts' together...
    if intermediate is None:
        return None, "tiled MLP: the config names no intermediate_size; the run sizes its tile at its first MLP call"
    on_cpu = device is None or str(device).lower() == "cpu"
    memory = psutil.virtual_memory().available if on_cpu else parse_budget(device)
    half = fields.get("bf16") or fields.get("fp16") or dtype.itemsize == 2
    tile = tile_tokens(UNBOUNDED_TOKENS, intermediate, 2 if half else dtype.itemsize, memory,
                       "cpu" if on_cpu else "cuda")
    where = "this machine's available memory" if on_cpu else f"{device}'s memory"
    return tile, (f"tiled MLP: {tile:,} tokens per tile, the run's rule against {where} (a share of it, never below "
                  f"{launch_floor(device):,}); --memory_budget plans the largest tile that fits instead, and "
                  f"--tiled_mlp_tile_size sets one")


def token_bound(fields: dict) -> int:
    """At least the tokens of one MLP call: a micro-batch's rows (x2: DPO's chosen and rejected, KTO's KL partners)
    at the longest length the config allows."""
    length = fields.get("max_length") or (
        (fields.get("max_prompt_length") or 512) + (fields.get("max_completion_length") or 256))
    return 2 * int(fields.get("per_device_train_batch_size", 8)) * int(length)


def solve_tile(plan_at: Callable[[int], object], budget: int, floor: int, bound: int, at_floor=None):
    """(the largest tile, floor x a power of two up to `bound`, whose plan's device total fits `budget`, its plan,
    plans made); the floor and its plan when even the floor does not fit. `at_floor`: the floor's plan, if made."""
    plans = {floor: at_floor if at_floor is not None else plan_at(floor)}
    made = int(at_floor is None)

    def fits(exponent: int) -> bool:
        nonlocal made
        tile = floor << exponent
        if tile not in plans:
            plans[tile], made = plan_at(tile), made + 1
        return plans[tile].device_total_bytes <= budget

    low, high = 0, 0
    while (floor << high) < bound:
        high += 1
    if not fits(0):
        return floor, plans[floor], made
    while low < high:  # low fits; every exponent above high is the same plan as high (one tile: untiled)
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return floor << low, plans[floor << low], made
