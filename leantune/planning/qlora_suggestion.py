"""QLoRA for a LoRA run that does not fit: offered apart from the same-result candidates, labelled.

A 4-bit base (nf4 with double quantization, bitsandbytes) holds about 0.52 byte per quantized weight instead of 2 or
4, and is the largest saving a LoRA run has left. It changes what is learned (the frozen weights the adapter trains
against are quantized), so, like a shorter `max_length` (length_suggestion.py), it is never one of recommend.py's
"same result" candidates; it is planned with its own budget search only when that search gave something up.
"""

from __future__ import annotations

from dataclasses import dataclass

NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
FLAGS = ("--load_in_4bit true", "--bnb_4bit_quant_type nf4", "--use_bnb_nested_quant true")


@dataclass
class QLoRASuggestion:
    search: object  # recommend.Recommendation with a 4-bit base

    def lines(self) -> list[str]:
        out = ["changes what is learned (the frozen base weights quantized to 4 bits), so not among the candidates "
               "above:", "  QLoRA: 4-bit nf4 base with double quantization, the same adapter"]
        out += [f"  {line}" for line in self.search.lines()[1:]]
        if self.search.chosen is not None:
            out += [f"    {flag}" for flag in FLAGS]
        return out


def quantized(fields: dict) -> bool:
    init = fields.get("model_init_kwargs") or {}
    return bool(fields.get("load_in_4bit") or fields.get("load_in_8bit") or fields.get("quantization_config")
                or init.get("quantization_config"))


def suggest_qlora(recommendation, fields: dict, uses_peft: bool, search) -> QLoRASuggestion | None:
    """The 4-bit search (`search(fields)` -> Recommendation) for a LoRA run that is not quantized, when the
    same-result search did not choose its fastest candidate or found nothing that fits; else None."""
    if not uses_peft or quantized(fields):
        return None
    considered = recommendation.considered
    if recommendation.chosen is not None and considered and recommendation.chosen is considered[0]:
        return None
    init = dict(fields.get("model_init_kwargs") or {})
    dtype = init.get("dtype")
    compute = {} if dtype in (None, "auto") else {"bnb_4bit_compute_dtype": dtype}  # compute in the run's dtype
    init["quantization_config"] = {**NF4, **compute}
    return QLoRASuggestion(search({**fields, "model_init_kwargs": init}))
