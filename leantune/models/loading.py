"""Model and tokenizer loading shared by every trainer: ids or local paths, dtypes, quantisation, PEFT."""

from __future__ import annotations

import json
import logging
import os
import warnings

import torch

from ..utils.imports import require, require_cuda

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


def _resolve_quantization(kwargs: dict) -> None:
    config = kwargs.get("quantization_config")
    if config is None:
        return
    require("bitsandbytes", "4/8-bit quantisation")
    require_cuda("4/8-bit quantisation with bitsandbytes")
    if isinstance(config, dict):
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(**config)
    kwargs.setdefault("device_map", {"": torch.cuda.current_device()})


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
    from transformers import AutoModelForCausalLM

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
    return auto_class.from_pretrained(resolve_source(model), **kwargs)


def load_tokenizer(model, processing_class=None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

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


def apply_peft(model, peft_config, args):
    """Wrap the model in a PEFT adapter, ready for (k-bit) training with gradient checkpointing."""
    if peft_config is None:
        if is_quantized(model):
            raise ValueError("A quantised model can only be trained through an adapter: pass `peft_config`.")
        return model
    require("peft", "peft_config")
    from peft import get_peft_model, prepare_model_for_kbit_training

    if is_quantized(model):
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
        )
    elif args.gradient_checkpointing:
        # Checkpointed blocks need an input that requires grad when the embeddings are frozen.
        model.enable_input_require_grads()
    model = get_peft_model(model, peft_config)
    for config in model.peft_config.values():
        # A model object loaded from a relative folder: the adapter must name its base from anywhere.
        config.base_model_name_or_path = resolve_source(config.base_model_name_or_path)
    return model
