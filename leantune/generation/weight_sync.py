"""The policy's weights as a generation engine loads them: plain Hugging Face checkpoint names, adapters merged.

A vLLM engine (colocated or a server) holds its own copy of the policy and is refreshed from the training model by
`policy_weights_for_sync`. What it yields, one `(name, tensor)` pair at a time:

- names as in the underlying model's checkpoint (`model.layers.0.self_attn.q_proj.weight`): DDP, DeepSpeed and
  accelerate wrappers are unwrapped, `torch.compile`'s `_orig_mod.` and activation checkpointing's
  `_checkpoint_wrapped_module.` are dropped;
- parameters and persistent buffers (what `state_dict` holds), each tensor once: a tied weight (Llama's
  `lm_head.weight` sharing `model.embed_tokens.weight`) comes once, under its first name in module order, which is
  how `save_pretrained` writes it and what vLLM's `load_weights` expects (it skips the tied head);
- PEFT: the adapters of each tuner layer merged into its base weight by PEFT's own `merge` (LoRA, DoRA, ...),
  computed on a scratch copy so the base weights are never written: they are bitwise unchanged afterwards and the
  adapter stays active. Names lose `base_model.model.` and `.base_layer`, no `lora_` tensor is sent, and a
  `modules_to_save` module is sent from its trained copy under the original module's name;
- under DeepSpeed ZeRO-3 the shards are gathered a module at a time (a tuner layer with its adapters), so the full
  model is never gathered at once. Gathering is collective: every process must run the iteration, also where only
  the main process sends what it yields.

A yielded tensor may be freed (ZeRO-3) or a scratch copy (PEFT) once the iteration moves on: load or copy it before
asking for the next one.

Verified on CPU (tests/generation/test_weight_sync.py): names and values for a plain model, tied or not, a LoRA
model and `modules_to_save`, and that the PEFT model is untouched. ZeRO-3 gathering runs on a GPU
(tests/generation/test_gpu_online.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from accelerate.utils import extract_model_from_parallel
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import ModulesToSaveWrapper

try:
    from peft.utils.other import AuxiliaryTrainingWrapper
except ImportError:  # older PEFT: no such wrappers
    AuxiliaryTrainingWrapper = ()

from .zero3 import is_zero3

DROPPED_NAME_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def policy_weights_for_sync(model, accelerator=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the policy's `(checkpoint name, tensor)` pairs, adapters merged, gathering ZeRO-3 shards per module."""
    model = unwrap_training_model(model, accelerator)
    gather = _zero3_gatherer() if accelerator is not None and is_zero3(accelerator) else _no_gathering
    seen: set[int] = set()
    with torch.no_grad():
        yield from _module_weights(_checkpoint_root(model), "", seen, gather)


def unwrap_training_model(model, accelerator=None):
    """The model inside DDP / DeepSpeed / accelerate wrappers (a PEFT model stays a PEFT model)."""
    if accelerator is not None:
        return accelerator.unwrap_model(model)

    return extract_model_from_parallel(model)


def base_model_name_or_path(model, accelerator=None) -> str:
    """Where the policy's (base) weights came from: what an engine loads before the first sync ('' if unknown)."""
    root = _checkpoint_root(unwrap_training_model(model, accelerator))
    config = getattr(root, "config", None)
    return getattr(config, "_name_or_path", "") or ""


def checkpoint_model(model, accelerator=None):
    """The transformers model whose checkpoint names the sync uses (the base model of a PEFT model)."""
    return _checkpoint_root(unwrap_training_model(model, accelerator))


def _checkpoint_root(model):
    if not isinstance(model, PeftModel):
        return model
    config = model.peft_config.get(model.active_adapter)
    if config is not None and getattr(config, "is_prompt_learning", False):
        raise NotImplementedError(
            "Syncing a prompt-learning PEFT model (prompt/prefix tuning) to a generation engine is not supported: "
            "its virtual tokens cannot be merged into the weights. Use LoRA, or the transformers backend."
        )
    return model.get_base_model()


def _module_weights(module, prefix: str, seen: set[int], gather) -> Iterator[tuple[str, torch.Tensor]]:
    kind = _peft_kind(module)
    if kind == "modules_to_save":
        yield from _module_weights(_modules_to_save_source(module), prefix, seen, gather)
        return
    if kind == "tuner_layer":
        with gather(list(module.parameters())):
            yield from _merged_tuner_layer_weights(module, prefix, seen)
        return
    if kind == "unsupported":
        raise NotImplementedError(f"Syncing PEFT's {type(module).__name__} (at {prefix!r}) to a generation engine "
                                  "is not supported; use the transformers backend.")
    own = [(name, param) for name, param in module.named_parameters(recurse=False) if id(param) not in seen]
    with gather([param for _, param in own]):
        yield from _own_tensors(module, prefix, seen)
    for child_name, child in module.named_children():
        yield from _module_weights(child, f"{prefix}{child_name}.", seen, gather)


def _own_tensors(module, prefix: str, seen: set[int], swaps=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's direct parameters and persistent buffers, each tensor once (`swaps`: id -> tensor sent instead)."""
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    tensors = list(module.named_parameters(recurse=False))
    tensors += [(name, buf) for name, buf in module.named_buffers(recurse=False) if name not in non_persistent]
    for name, tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        sent = swaps.get(id(tensor), tensor) if swaps else tensor
        yield _checkpoint_name(prefix + name), sent.detach()


def _all_tensors(module, prefix: str, seen: set[int], swaps=None) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _own_tensors(module, prefix, seen, swaps)
    for child_name, child in module.named_children():
        yield from _all_tensors(child, f"{prefix}{child_name}.", seen, swaps)


def _merged_tuner_layer_weights(layer, prefix: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The base layer's tensors with the active adapters merged, by PEFT's `merge` on scratch copies."""
    base = layer.get_base_layer()
    needs_merge = not layer.merged and not getattr(layer, "disable_adapters", False) and bool(layer.active_adapters)
    if not needs_merge:
        yield from _all_tensors(base, prefix, seen)
        return
    _refuse_quantized(base, prefix)
    params = list(base.parameters())
    originals = [param.data for param in params]
    merged_before = list(layer.merged_adapters)
    caches_before = set(getattr(layer, "_caches", {}))
    try:
        for param in params:
            param.data = param.data.clone()
        layer.merge()
        merged = {id(param): param.data for param in params}
    finally:
        for param, original in zip(params, originals):
            param.data = original
        layer.merged_adapters = merged_before
        caches = getattr(layer, "_caches", None)
        for key in set(caches or {}) - caches_before:
            caches.pop(key)
    yield from _all_tensors(base, prefix, seen, swaps=merged)


def _refuse_quantized(base, prefix: str) -> None:
    weight = getattr(base, "weight", None)
    if type(weight).__module__.startswith("bitsandbytes") or type(base).__module__.startswith("bitsandbytes"):
        raise NotImplementedError(
            f"Merging an adapter into a quantized base layer ({prefix.rstrip('.')}) for a generation engine is not "
            "supported; use the transformers backend for QLoRA, or train LoRA on an unquantized base."
        )


def _peft_kind(module) -> str | None:
    if isinstance(module, ModulesToSaveWrapper):
        return "modules_to_save"
    if AuxiliaryTrainingWrapper and isinstance(module, AuxiliaryTrainingWrapper):
        return "unsupported"
    if isinstance(module, BaseTunerLayer):
        return "tuner_layer"
    return None


def _modules_to_save_source(wrapper):
    """The trained copy of a `modules_to_save` module while its adapter is active, else the original."""
    active = [name for name in wrapper.active_adapters if name in wrapper.modules_to_save]
    if getattr(wrapper, "disable_adapters", False) or not active:
        return wrapper.original_module
    return wrapper.modules_to_save[active[0]]


def _checkpoint_name(name: str) -> str:
    for part in DROPPED_NAME_PARTS:
        name = name.replace(part, "")
    return name


@contextlib.contextmanager
def _no_gathering(params):
    yield


def _zero3_gatherer() -> Callable:
    import deepspeed

    @contextlib.contextmanager
    def gather(params):
        if not params:
            yield
            return
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield

    return gather
