"""Model and tokenizer loading shared by every trainer: ids or local paths, dtypes, quantisation, PEFT."""

from __future__ import annotations

import json
import logging
import os
import warnings

import torch
from accelerate import PartialState
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from ..utils.imports import require

logger = logging.getLogger("leantune.models")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_kwargs(value) -> dict:
    """model_init_kwargs and friends arrive as dicts from Python and as JSON strings from the CLI."""
    if value is None:
        return {}
    if isinstance(value, str):
        return json.loads(value)
    return dict(value)


def _resolve_dtype(kwargs: dict) -> None:
    if "torch_dtype" in kwargs:
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    dtype = kwargs.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'.")
        kwargs["dtype"] = DTYPES[dtype]


def _import_bitsandbytes():
    require("bitsandbytes", "4/8-bit quantisation")
    import bitsandbytes

    return bitsandbytes


def _quantized_device_map(bitsandbytes) -> dict:
    """Where a 4/8-bit model is loaded: the trainer's device (accelerate's), as one block, because the Trainer never
    moves a quantised model: on CUDA the current device; on CPU (recent bitsandbytes runs there; tested: 0.50.2)
    "cpu"."""
    device = PartialState().device
    supported = set(getattr(bitsandbytes, "supported_torch_devices", {"cuda"}))
    if device.type not in supported:
        raise RuntimeError(
            f"4/8-bit quantisation: the installed bitsandbytes {getattr(bitsandbytes, '__version__', '?')} has no "
            f"backend for this machine's training device ({device.type}; it supports {', '.join(sorted(supported))}). "
            "Upgrade it (pip install -U 'leantune[bitsandbytes]'), train in bf16/fp32, or pass your own `device_map` "
            "in model_init_kwargs.")
    if device.type == "cuda":
        return {"": torch.cuda.current_device()}
    if device.type == "cpu":
        return {"": "cpu"}
    return {"": str(device)}


def _resolve_quantization(kwargs: dict) -> None:
    config = kwargs.get("quantization_config")
    if config is None:
        return
    bitsandbytes = _import_bitsandbytes()
    if isinstance(config, dict):
        kwargs["quantization_config"] = BitsAndBytesConfig(**config)
    if "device_map" not in kwargs:
        kwargs["device_map"] = _quantized_device_map(bitsandbytes)


def keep_4bit_layers_trainable(model) -> int:
    """Keep bitsandbytes' 4-bit layers on their differentiable path; return how many were repacked before.

    On a CPU with AVX512-BF16, bitsandbytes' `Linear4bit` repacks its weights in place into an inference-only layout
    the first time it runs in eval mode on an input that does not require grad (a no-grad forward right after
    `from_pretrained`, an evaluation, a reference or generation pass). From then on every forward, in training too,
    goes through `gemv_4bit`, which has no backward: the input gradient through the frozen base weight is lost and
    the LoRA gradients of every earlier layer are wrong, silently (at most a UserWarning). Switching the layout off
    on every layer keeps all forwards on the dequantise-and-matmul path (the gradients of an fp32 model holding the
    dequantised weights). A layer already repacked is unpacked; its block scales were rounded to bf16 by the
    repacking, so it now holds slightly different weights than the checkpoint (a warning says so).
    """
    repacked = 0
    for module in model.modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue
        module.support_avx512bf16_for_cpu = False
        state = getattr(module.weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                module.weight.data, state)
            repacked += 1
    if repacked:
        logger.warning(
            "%d 4-bit layers had been repacked by bitsandbytes for CPU inference (an eval-mode forward without "
            "gradient before training); they were unpacked for training, with their block scales rounded to bf16 by "
            "the repacking. Load the model again and pass it untouched (or pass its name or path) to train on the "
            "checkpoint's exact 4-bit weights.", repacked)
    return repacked


def resolve_source(name: str) -> str:
    """A local folder as an absolute path, so what is saved from it (an adapter's `base_model_name_or_path`, the
    config's `_name_or_path`) names it from any working directory; anything else (a Hub id) unchanged."""
    if not isinstance(name, str) or not name:
        return name
    local = os.path.expanduser(name)
    return os.path.abspath(local) if os.path.isdir(local) else name


def with_quantization_config(model, model_init_kwargs, quantization_config):
    """TRL's `quantization_config` trainer keyword: it joins the `from_pretrained` kwargs when `model` is a name or
    path (set in both places: an error), and is ignored, with a warning, for a model object."""
    if quantization_config is None:
        return model_init_kwargs
    if not isinstance(model, str):
        logger.warning("quantization_config is ignored: the model is already instantiated.")
        return model_init_kwargs
    kwargs = parse_kwargs(model_init_kwargs)
    if kwargs.get("quantization_config") is not None:
        raise ValueError("quantization_config is set both as a trainer argument and in model_init_kwargs; set it in "
                         "one place (preferably the trainer argument).")
    return {**kwargs, "quantization_config": quantization_config}


def load_causal_lm(model, model_init_kwargs=None, auto_class=None, trust_remote_code: bool = False):
    """Return a model object from an id, a local path or a model object.

    A name or path loads in float32 unless `model_init_kwargs` gives `dtype` (or `torch_dtype`), as TRL's trainers do
    ('auto' = the checkpoint's dtype); with `bf16=True` the Trainer then trains under bf16 autocast.
    """
    auto_class = auto_class or AutoModelForCausalLM
    kwargs = parse_kwargs(model_init_kwargs)
    if not isinstance(model, str):
        if kwargs:
            warnings.warn("model_init_kwargs are ignored because `model` is already instantiated.", stacklevel=3)
        return model
    if trust_remote_code:  # the config's `trust_remote_code`; one in model_init_kwargs wins, as in TRL
        kwargs.setdefault("trust_remote_code", True)
    _resolve_dtype(kwargs)
    kwargs.setdefault("dtype", torch.float32)
    _resolve_quantization(kwargs)
    loaded = auto_class.from_pretrained(resolve_source(model), **kwargs)
    if is_quantized(loaded):
        keep_4bit_layers_trainable(loaded)  # before anything runs it in eval mode (from_pretrained returns eval mode)
    return loaded


def load_tokenizer(model, processing_class=None, trust_remote_code: bool = False):
    if processing_class is not None:
        return processing_class
    name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", None)
    if not name:
        raise ValueError("Pass `processing_class` (a tokenizer): the model object does not say where it was loaded from.")
    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    return AutoTokenizer.from_pretrained(resolve_source(name), **kwargs)


def ensure_pad_token(tokenizer, pad_token: str | None = None) -> None:
    if pad_token is not None:
        if pad_token not in tokenizer.get_vocab():
            raise ValueError(f"pad_token {pad_token!r} is not in the tokenizer's vocabulary.")
        tokenizer.pad_token = pad_token
    elif tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("The tokenizer has neither a pad token nor an EOS token; set `pad_token`.")
        tokenizer.pad_token = tokenizer.eos_token


def is_quantized(model) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def has_adapter(model) -> bool:
    """A PEFT model (e.g. a 4-bit base with its LoRA adapter already attached): it trains through that adapter."""
    return isinstance(model, PeftModel)


def apply_peft(model, peft_config, checkpointed: bool):
    """Wrap the model in a PEFT adapter, ready for (k-bit) training; `checkpointed`: whether the trainer turns
    activation checkpointing on (the trainer's resolved setting, trainers/settings.py)."""
    if is_quantized(model):
        keep_4bit_layers_trainable(model)  # a model object may not have come through load_causal_lm
    if peft_config is None:
        if is_quantized(model) and not has_adapter(model):
            raise ValueError("A quantised model can only be trained through an adapter: pass `peft_config`, or a "
                             "model that already has one (a PeftModel).")
        return model
    require("peft", "peft_config")

    # A quantized base is prepared as any other: no `prepare_model_for_kbit_training`, whose cast of every
    # unquantized weight (embeddings, head, norms) to fp32 makes the residual stream fp32 and doubles every
    # checkpointed layer input (32 GiB of Llama-3.1-8B's 66 at 65,536 tokens on an H100, docs/benchmarks.md). TRL
    # 1.16 does not cast either. get_peft_model freezes the base; the Trainer turns gradient checkpointing on.
    if checkpointed:
        # Checkpointed blocks need an input that requires grad when the embeddings are frozen.
        model.enable_input_require_grads()
    model = get_peft_model(model, peft_config)
    for config in model.peft_config.values():
        # A model object loaded from a relative folder: the adapter must name its base from anywhere.
        config.base_model_name_or_path = resolve_source(config.base_model_name_or_path)
    return model
