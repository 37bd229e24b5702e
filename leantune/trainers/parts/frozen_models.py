"""Models that run without training beside the policy (a reference, reward models), placed for the sharding engine.

accelerate prepares such a model for DDP and FSDP (`prepare_model(..., evaluation_mode=True)`: FSDP2 shards it like
the policy), but under DeepSpeed it only places it: a model loaded under ZeRO-3 (`zero.Init`, parameters partitioned
at load) then has empty weights outside any engine, and under ZeRO-1/2 each process keeps a whole copy. Here a
frozen model under DeepSpeed gets an inference engine of its own: ZeRO-3 partitioned (gathered layer by layer in its
forward, as the policy is), otherwise stage 0 (a plain replica: ZeRO-1/2 shard only optimizer states and gradients,
which a frozen model has none of)."""

from __future__ import annotations

import copy

import torch
from accelerate.utils import DistributedType
from transformers.integrations import is_deepspeed_zero3_enabled

from ...models.output_head import text_config_of
from .context_parallel import prepare_frozen_for_ring


def zero3_enabled() -> bool:
    """Whether models loaded now are partitioned at load (a ZeRO-3 DeepSpeed config is active)."""
    return bool(is_deepspeed_zero3_enabled())


def prepare_frozen_model(accelerator, model: torch.nn.Module | None, args,
                         in_ring: bool = True) -> torch.nn.Module | None:
    """`in_ring`: the model scores the policy's sequences beside it, split under context parallelism (a reference,
    a teacher); a reward model scores whole texts outside the ring."""
    if model is None:
        return None
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        model = accelerator.prepare_model(model, evaluation_mode=True)
        if in_ring:
            prepare_frozen_for_ring(accelerator, model, "frozen model")  # context parallelism: the policy's hooks
        return model
    import deepspeed

    config = inference_config(accelerator.state.deepspeed_plugin.deepspeed_config, args, accelerator.num_processes,
                              hidden_size_of(model))
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def inference_config(training_config: dict, args, processes: int, hidden_size: int | None) -> dict:
    """The training DeepSpeed config without optimizer and scheduler, its "auto" values resolved from the trainer's
    arguments (an engine is built here, before the Trainer resolves them for the policy)."""
    config = copy.deepcopy(training_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = accumulation
    config["train_batch_size"] = micro * accumulation * processes
    config.pop("gradient_clipping", None)
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:
        for key in ("stage3_prefetch_bucket_size", "reduce_bucket_size", "stage3_param_persistence_threshold"):
            if zero.get(key) == "auto":
                if hidden_size is None:
                    zero.pop(key)
                elif key == "stage3_param_persistence_threshold":
                    zero[key] = 10 * hidden_size
                else:
                    zero[key] = hidden_size * hidden_size if key == "reduce_bucket_size" else int(0.9 * hidden_size ** 2)
    else:
        config["zero_optimization"] = {"stage": 0}
    for precision in ("fp16", "bf16"):
        if isinstance(config.get(precision), dict) and config[precision].get("enabled") == "auto":
            config[precision]["enabled"] = bool(getattr(args, precision, False))
    return {key: value for key, value in config.items() if value != "auto"}


def hidden_size_of(model) -> int | None:
    return getattr(text_config_of(model), "hidden_size", None)
