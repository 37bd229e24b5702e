"""QLoRA in the plan: a 4/8-bit bitsandbytes model built from its config with fake weights.

The model is quantized the way `from_pretrained` quantizes it, by transformers' own bitsandbytes quantizer (which
linear layers become `Linear4bit` / `Linear8bitLt`: not the output head, tied weights or `llm_int8_skip_modules`),
and each layer's weight is then quantized by bitsandbytes' own `Params4bit` / `Int8Params` code, on a fake weight.
bitsandbytes registers a fake-tensor kernel for each of its ops, so the packed weight, the block scales (`absmax`),
the nested scales and code tables of double quantization, 8-bit row scales, and, at every forward and backward, the
dequantized weight in the compute dtype, are the tensors bitsandbytes itself would allocate, with their sizes and
lifetimes (what its autograd functions save for backward), and none takes memory. The measured side counts the
quantization states and the dequantized weight inside bitsandbytes' fused 4-bit matmul the same way
(metrics/quantized_weights.py), so plan and run compare like for like.
"""

from __future__ import annotations

import torch
from transformers import BitsAndBytesConfig
from transformers.quantizers.auto import AutoHfQuantizer

from ..models.loading import _import_bitsandbytes

QUANTIZATION_FIELDS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                       "use_bnb_nested_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage",
                       "llm_int8_skip_modules", "llm_int8_threshold", "quantization_config")


def quantization_from_fields(fields: dict):
    """The `BitsAndBytesConfig` a plan's fields ask for, or None; the fields that are not a trainer config's are
    removed from `fields`.

    Accepted, as the trainers and the command line take them: `quantization_config` (TRL's trainer keyword) or
    `model_init_kwargs["quantization_config"]` (a dict or a `BitsAndBytesConfig`), or the command line's flags
    `load_in_4bit` / `load_in_8bit`, `bnb_4bit_quant_type`, `use_bnb_nested_quant` (and the config's own names)."""
    flags = {name: fields.pop(name) for name in QUANTIZATION_FIELDS if name in fields}
    given = flags.pop("quantization_config", None)
    init = dict(fields.get("model_init_kwargs") or {})
    in_init = init.get("quantization_config")
    if given is not None and in_init is not None:
        raise ValueError("`quantization_config` is set both as a plan argument and in `model_init_kwargs`; set it in "
                         "one place.")
    given = given if given is not None else in_init
    if "use_bnb_nested_quant" in flags:
        flags.setdefault("bnb_4bit_use_double_quant", flags.pop("use_bnb_nested_quant"))
    if given is not None and any(value not in (None, False) for value in flags.values()):
        name = next(name for name, value in flags.items() if value not in (None, False))
        raise ValueError(f"`{name}` and a `quantization_config` are both given; set the quantization in one place.")
    if given is None and not (flags.get("load_in_4bit") or flags.get("load_in_8bit")):
        unused = [name for name, value in flags.items() if value not in (None, False)]
        if unused:
            raise ValueError(f"`{unused[0]}` has no effect without `load_in_4bit` or `load_in_8bit`.")
        return None

    _import_bitsandbytes()  # a plan of a 4/8-bit model needs bitsandbytes, as the run does

    if given is None:
        config = BitsAndBytesConfig(**{k: v for k, v in flags.items() if v is not None})
    elif isinstance(given, dict):
        config = BitsAndBytesConfig(**given)
    else:
        config = given
    if config.load_in_4bit and config.load_in_8bit:
        raise ValueError("Choose one of `load_in_8bit` and `load_in_4bit`.")
    return config


def quantize_fake_model(model, quantization_config, mode):
    """`model` (fake parameters, built by fake_step) with its linear layers replaced and quantized as
    `from_pretrained(..., quantization_config=...)` does on the CPU, every tensor fake.

    The layers are bitsandbytes' own classes (so PEFT, transformers and the trainers treat them as in a real run);
    their weight is the stand-in: a fake parameter holding the packed weight, carrying the quantization state that
    bitsandbytes' quantization computed from the fake full-precision weight (`Params4bit` / `Int8Params` cannot wrap
    a fake tensor, the attributes their forward reads are the same)."""
    import bitsandbytes as bnb
    from bitsandbytes import functional

    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    if "dynamic" not in functional.name2qmap:  # bitsandbytes' cached code table of double quantization: made real,
        functional.name2qmap["dynamic"] = functional.create_dynamic_map().to("cpu")  # never a fake in its cache
    weights = {name: (module.weight, module.bias) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear)}
    # the new layers are made on the meta device (as from_pretrained makes them); their weights are set below
    quantizer.preprocess_model(model, dtype=_model_dtype(model), device_map={"": "cpu"})
    with mode.building():
        for name, module in model.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                _quantize_4bit(module, weights[name][0])
            elif isinstance(module, bnb.nn.Linear8bitLt):
                _quantize_8bit(module, weights[name][0])
            else:
                continue
            bias = weights[name][1]
            if bias is not None:
                module.bias = torch.nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model


def _quantize_4bit(module, weight) -> None:
    """`Params4bit._quantize` on a fake weight: packed values and the quantization state bitsandbytes makes."""
    from bitsandbytes import functional

    meta = module.weight
    packed, state = functional.quantize_4bit(weight.detach().contiguous(), blocksize=meta.blocksize,
                                             compress_statistics=meta.compress_statistics, quant_type=meta.quant_type,
                                             quant_storage=meta.quant_storage)
    stand_in = torch.nn.Parameter(packed, requires_grad=False)
    for name in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
        setattr(stand_in, name, getattr(meta, name))
    stand_in.quant_state, stand_in.bnb_quantized, stand_in.module = state, True, module
    module.weight = stand_in
    module.quant_state = state


def _quantize_8bit(module, weight) -> None:
    """`Int8Params._quantize` on a fake weight: int8 rows and their float32 scales (fp16 in between, as bitsandbytes)."""
    from bitsandbytes import functional

    meta = module.weight
    rows, scales, _ = functional.int8_vectorwise_quant(weight.detach().contiguous().to(torch.float16))
    stand_in = torch.nn.Parameter(rows, requires_grad=False)
    stand_in.CB, stand_in.SCB, stand_in.has_fp16_weights = rows, scales, meta.has_fp16_weights
    module.weight = stand_in


def parameter_count(param) -> int:
    """The parameters a weight stands for: a packed 4-bit weight holds two in a byte (its quantization state knows the
    full shape), as transformers' `num_parameters` counts them."""
    state = getattr(param, "quant_state", None)
    shape = getattr(state, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else param.numel()


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype
