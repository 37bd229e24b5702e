"""What `leantune vllm-serve` accepts in a /generate request: named fields of bounded values, nothing passed through.

A request's sampling options reach `model.generate(**kwargs)` (transformers) or `SamplingParams(**kwargs)` (vLLM),
and some of their keyword arguments load and run code (transformers' `custom_generate` with `trust_remote_code`).
So every field is checked here by name, type and range, and the `extra` options (a config's `generation_kwargs`) are
an allow-list mapped explicitly onto each engine's own argument name; anything else is a `RequestError` (HTTP 400)
naming the field. Prompt count, prompt length, `max_new_tokens` and token ids are bounded by `GenerationLimits`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .sampling import SamplingSettings

MAX_EOS_TOKEN_IDS = 64


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), with the field and what is wrong."""


@dataclass(frozen=True)
class GenerationOption:
    """One allowed `sampling.extra` option: its value check and its name in each engine (None: not supported)."""

    kind: type
    minimum: float | None
    maximum: float | None
    transformers: str | None
    vllm: str | None


# The `generation_kwargs` a served request may carry (the named SamplingSettings fields cover the rest).
GENERATION_OPTIONS = {
    "min_tokens": GenerationOption(int, 0, None, "min_new_tokens", "min_tokens"),
    "min_new_tokens": GenerationOption(int, 0, None, "min_new_tokens", "min_tokens"),
    "presence_penalty": GenerationOption(float, -2.0, 2.0, None, "presence_penalty"),
    "frequency_penalty": GenerationOption(float, -2.0, 2.0, None, "frequency_penalty"),
    "no_repeat_ngram_size": GenerationOption(int, 0, None, "no_repeat_ngram_size", None),
    "typical_p": GenerationOption(float, 0.0, 1.0, "typical_p", None),
}


@dataclass(frozen=True)
class GenerationLimits:
    """The server's bounds on one /generate request."""

    vocab_size: int
    context_length: int  # prompt tokens + new tokens
    max_prompts: int
    max_new_tokens: int


def checked_prompts(value, limits: GenerationLimits) -> list[list[int]]:
    if not isinstance(value, list):
        raise RequestError("prompts: must be a list of token-id lists")
    if len(value) > limits.max_prompts:
        raise RequestError(f"prompts: {len(value)} prompts, over the server's limit of {limits.max_prompts} "
                           "(--max_prompts); send fewer per request")
    prompts = []
    for index, ids in enumerate(value):
        if not isinstance(ids, list) or not ids:
            raise RequestError(f"prompts[{index}]: must be a non-empty list of token ids")
        if len(ids) >= limits.context_length:
            raise RequestError(f"prompts[{index}]: {len(ids)} tokens leave no room in the model's context of "
                               f"{limits.context_length}")
        prompts.append([_token_id(t, f"prompts[{index}]", limits) for t in ids])
    return prompts


def checked_sampling(data, limits: GenerationLimits, longest_prompt: int = 0) -> SamplingSettings:
    """SamplingSettings from a request's JSON, every field checked (RequestError names the first bad one)."""
    if not isinstance(data, dict):
        raise RequestError("sampling: must be an object of SamplingSettings fields")
    known = {f.name for f in dataclasses.fields(SamplingSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RequestError(f"unknown sampling field(s): {', '.join(unknown)}")
    if "max_new_tokens" not in data:
        raise RequestError("sampling.max_new_tokens: required")
    room = limits.context_length - longest_prompt
    cap = min(limits.max_new_tokens, room)
    fields = {
        "max_new_tokens": _number(data["max_new_tokens"], "sampling.max_new_tokens", int, 1, cap),
        "temperature": _number(data.get("temperature", 1.0), "sampling.temperature", float, 0.0, None),
        "top_p": _number(data.get("top_p", 1.0), "sampling.top_p", float, 0.0, 1.0),
        "top_k": _optional(data.get("top_k"), "sampling.top_k", int, 0, limits.vocab_size),
        "min_p": _optional(data.get("min_p"), "sampling.min_p", float, 0.0, 1.0),
        "repetition_penalty": _number(data.get("repetition_penalty", 1.0), "sampling.repetition_penalty", float,
                                      0.0, None),
        "eos_token_ids": _eos_ids(data.get("eos_token_ids"), limits),
        "pad_token_id": None if data.get("pad_token_id") is None
        else _token_id(data["pad_token_id"], "sampling.pad_token_id", limits),
        "extra": checked_extra(data.get("extra")),
        "seed": _optional(data.get("seed"), "sampling.seed", int, 0, 2**63 - 1),
        "logprobs": data.get("logprobs", True),
    }
    if fields["top_p"] == 0 or fields["repetition_penalty"] == 0:
        raise RequestError("sampling.top_p and sampling.repetition_penalty: must be above 0")
    if not isinstance(fields["logprobs"], bool):
        raise RequestError("sampling.logprobs: must be true or false")
    return SamplingSettings(**fields)


def checked_extra(value) -> dict:
    """The `extra` options: each an allowed name with a value of its kind and range."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError("sampling.extra: must be an object of generation options")
    checked = {}
    for name, option_value in value.items():
        option = GENERATION_OPTIONS.get(name)
        if option is None:
            raise RequestError(f"sampling.extra.{name}: not a generation option this server accepts (allowed: "
                               f"{', '.join(sorted(GENERATION_OPTIONS))})")
        checked[name] = _number(option_value, f"sampling.extra.{name}", option.kind, option.minimum, option.maximum)
    return checked


def engine_extra(extra: dict, engine: str) -> dict:
    """The checked `extra` options under the engine's own argument names; one it has no equivalent of is refused."""
    kwargs = {}
    for name, value in extra.items():
        option = GENERATION_OPTIONS.get(name)
        target = None if option is None else getattr(option, engine)
        if target is None:
            raise RequestError(f"sampling.extra.{name}: not supported by the {engine} engine")
        kwargs[target] = value
    return kwargs


def _eos_ids(value, limits: GenerationLimits) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_EOS_TOKEN_IDS:
        raise RequestError(f"sampling.eos_token_ids: must be a list of at most {MAX_EOS_TOKEN_IDS} token ids")
    return tuple(_token_id(t, "sampling.eos_token_ids", limits) for t in value)


def _token_id(value, where: str, limits: GenerationLimits) -> int:
    if not _is_int(value) or not 0 <= value < limits.vocab_size:
        raise RequestError(f"{where}: token ids must be integers in [0, {limits.vocab_size}), got {value!r}")
    return int(value)


def _optional(value, where: str, kind: type, minimum, maximum):
    return None if value is None else _number(value, where, kind, minimum, maximum)


def _number(value, where: str, kind: type, minimum, maximum):
    if kind is int:
        if not _is_int(value):
            raise RequestError(f"{where}: must be an integer, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{where}: must be a finite number, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"[{minimum if minimum is not None else '-inf'}, {maximum if maximum is not None else 'inf'}]"
        raise RequestError(f"{where}: {value!r} is outside {bounds}")
    return kind(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- the JSON of a request's sampling and an answer's log-probs (server and client) ------------------------------


def sampling_to_json(sampling: SamplingSettings) -> dict:
    data = dataclasses.asdict(sampling)
    data["eos_token_ids"] = list(sampling.eos_token_ids)
    return data


def logprobs_to_json(logprobs: list[list[float]] | None) -> list[list[float | None]] | None:
    """NaN (not reported) and -inf travel as null: JSON has neither."""
    if logprobs is None:
        return None
    return [[v if math.isfinite(v) else None for v in row] for row in logprobs]


def logprobs_from_json(rows: list[list[float | None]] | None) -> list[list[float]] | None:
    if rows is None:
        return None
    return [[float("nan") if v is None else float(v) for v in row] for row in rows]
