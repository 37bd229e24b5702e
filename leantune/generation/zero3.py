"""DeepSpeed ZeRO-3 and generation: gather the sharded weights once per round, or generate with them sharded.

Under ZeRO-3 every forward pass gathers each layer's shards as it runs and frees them after. A generation round
runs the model once per new token, so it gathers every layer that many times; `ds3_gather_for_generation=True`
gathers the whole model once for the round instead (fast, but the full weights sit on each GPU for the round);
False keeps the per-layer gathering (slow, never more than a layer's weights gathered). The weights, and so the
completions for the same seed, are the same either way.
"""

from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger("leantune.generation")


def is_zero3(accelerator) -> bool:
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin is not None and getattr(plugin, "zero_stage", None) == 3


@contextlib.contextmanager
def gathered_for_generation(model, accelerator, enabled: bool = True):
    """Inside: the model's ZeRO-3 shards gathered once (enabled), or left sharded; outside ZeRO-3, nothing."""
    if not (enabled and is_zero3(accelerator)):
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        yield model
