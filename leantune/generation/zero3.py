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
    """Inside: the model's ZeRO-3 shards gathered once (enabled), or left sharded; outside ZeRO-3, nothing.

    Gathering alone would not last: ZeRO-3's module hooks re-partition each layer after its forward pass. So the
    hooks are taken off for the round (the same calls DeepSpeed uses to destroy and to set them up) and put back
    before the shards are released. Verified on GPU only (tests/generation/test_gpu_online.py,
    tests/trainers/test_gpu_grpo.py).
    """
    if not (enabled and is_zero3(accelerator)):
        yield model
        return
    import deepspeed

    offload = _parameter_offload(model)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        if offload is not None:
            offload._remove_module_hooks()
        try:
            yield model
        finally:
            if offload is not None:
                offload.setup_zero_stage3_hooks()


def _parameter_offload(model):
    """The ZeRO-3 hook owner of a DeepSpeed engine (None when the model is not one)."""
    optimizer = getattr(model, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is None or not hasattr(offload, "_remove_module_hooks") or not hasattr(offload,
                                                                                        "setup_zero_stage3_hooks"):
        if offload is not None:
            logger.warning("This DeepSpeed version's ZeRO-3 hooks cannot be lifted for generation: the weights are "
                           "gathered but re-partitioned layer by layer (correct, slower).")
        return None
    return offload
