"""Reward functions for the online trainers (GRPO, RLOO): Python callables and sequence-classification reward models
behind one `score` call, with TRL's meanings for `reward_funcs`, `reward_weights` and `reward_processing_classes`.

What a function returns is checked before it reaches the advantages: a wrong length, a non-number or an infinity is
an error that names the function, while None ("not applicable to this completion") and NaN are both turned into
NaN and counted per function, so the trainer can log how often each happened instead of dropping them silently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

REWARD_MODEL_BATCH_SIZE = 64
"""Texts per reward-model forward pass: bounds the activation memory of scoring a large generation round."""

_RESERVED_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")


class RewardFunctionError(RuntimeError):
    """A user reward function raised; the message names the function, the original exception is the cause."""


@dataclass
class RewardScores:
    """The rewards of one generation round, one column per reward function."""

    per_function: torch.Tensor
    """[N, F] float32 on CPU; NaN where a function gave no reward."""
    names: list[str]
    missing: list[int]
    """Per function: completions it returned None for (deliberately "not applicable")."""
    nan: list[int]
    """Per function: completions it returned NaN for (counted, then treated like None)."""

    def combined(self, weights: torch.Tensor | list[float]) -> torch.Tensor:
        """[N]: the weighted sum over the functions that scored each completion; NaN where none did, so the trainer
        decides what an unscored completion means instead of it silently becoming a reward of 0."""
        weights = torch.as_tensor(weights, dtype=torch.float32).cpu()
        if weights.shape != (self.per_function.shape[1],):
            raise ValueError(f"expected {self.per_function.shape[1]} reward weights, got shape {tuple(weights.shape)}")
        scored = ~torch.isnan(self.per_function)
        weighted = torch.where(scored, self.per_function * weights, torch.zeros_like(self.per_function))
        total = weighted.sum(dim=1)
        overflowed = scored.any(dim=1) & ~torch.isfinite(total)
        if overflowed.any():
            raise ValueError(f"the weighted sum of the rewards of {int(overflowed.sum())} completion(s) is beyond "
                             f"float32's range (+-3.4e38) with reward_weights {weights.tolist()}; scale the rewards "
                             "or the weights down.")
        return torch.where(scored.any(dim=1), total, torch.full_like(total, float("nan")))

    def unscored(self) -> torch.Tensor:
        """[N] bool: completions that no function scored."""
        return torch.isnan(self.per_function).all(dim=1)


class RewardFunctions:
    """The reward functions of a trainer: loads reward models given by name, names every function, and scores a
    generation round with all of them."""

    def __init__(self, reward_funcs, reward_weights=None, reward_processing_classes=None, model_init_kwargs=None,
                 extra_funcs=()):
        """`extra_funcs`: reward sources the trainer adds after `reward_funcs` (GRPO's environment-owned rewards),
        weight 1 each; `reward_weights` and `reward_processing_classes` describe `reward_funcs` alone, as in TRL."""
        if reward_funcs is None:
            funcs = []
        else:
            funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs and not extra_funcs:
            raise ValueError("`reward_funcs` is empty: give at least one reward function or reward model.")
        tokenizers = _processing_classes_by_position(reward_processing_classes, funcs) if funcs else []
        self.funcs: list[Any] = []
        self.tokenizers: list[Any] = []
        for position, (func, tokenizer) in enumerate(zip(funcs, tokenizers)):
            func, tokenizer = _prepare(func, tokenizer, position, model_init_kwargs or {})
            self.funcs.append(func)
            self.tokenizers.append(tokenizer)
        weights = _checked_weights(reward_weights, len(self.funcs))
        self.funcs += list(extra_funcs)
        self.tokenizers += [None] * len(extra_funcs)
        self.names = _distinct(_name_of(func) for func in self.funcs)
        self.weights = torch.cat([weights, torch.ones(len(extra_funcs), dtype=torch.float32)])

    def to(self, device) -> RewardFunctions:
        """Moves the reward models (callables stay where they are)."""
        for func in self.funcs:
            if _is_model(func):
                func.to(device)
        return self

    def prepare_models(self, prepare) -> RewardFunctions:
        """Runs each reward model through what `prepare(model)` returns (the trainer's engine for frozen models, e.g.
        a ZeRO-3 inference engine); the model itself still names the function and gives its config."""
        self.runners = {index: prepare(func) for index, func in enumerate(self.funcs) if _is_model(func)}
        return self

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]],
              columns: dict[str, list] | None = None, trainer_state=None, log_extra=None,
              log_metric=None) -> RewardScores:
        """Rewards of N completions from every function: [N, F] float32 on CPU.

        `prompts[i]` is the prompt completion i was generated from (repeated per generation); `columns` are the other
        dataset columns, one entry per completion, passed to callables as keyword arguments as TRL does, with TRL's
        `log_extra(column, values)` (one value per completion, shown with the logged completions) and
        `log_metric(name, value)` (averaged into the next log) callbacks."""
        n = len(completions)
        columns = dict(columns or {})
        _check_inputs(prompts, completion_ids, columns, n)
        columns_out = [None] * len(self.funcs)
        pending = {}
        for index, (func, tokenizer, name) in enumerate(zip(self.funcs, self.tokenizers, self.names)):
            if _is_model(func):
                columns_out[index] = _score_with_model(func, tokenizer, prompts, completions,
                                                       getattr(self, "runners", {}).get(index))
                continue
            result = _call(func, name, n, prompts=prompts, completions=completions, completion_ids=completion_ids,
                           trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric, **columns)
            if inspect.isawaitable(result):
                pending[index] = result
            else:
                columns_out[index] = result
        if pending:
            for index, result in zip(pending, _await_all(list(pending.values()), [self.names[i] for i in pending], n)):
                columns_out[index] = result
        values, missing, nan = [], [], []
        for name, result in zip(self.names, columns_out):
            column, none_count, nan_count = _as_reward_column(result, name, n)
            values.append(column)
            missing.append(none_count)
            nan.append(nan_count)
        per_function = torch.stack(values, dim=1) if n else torch.zeros(0, len(self.funcs))
        return RewardScores(per_function=per_function, names=list(self.names), missing=missing, nan=nan)


# --- set-up --------------------------------------------------------------------------------------------------------


def _is_model(func) -> bool:
    from transformers import PreTrainedModel

    return isinstance(func, PreTrainedModel)


def _processing_classes_by_position(processing_classes, funcs) -> list:
    """One tokenizer (or None) per reward function: a list lines up with `reward_funcs`, a single one goes to the
    single reward model."""
    if processing_classes is None:
        return [None] * len(funcs)
    if isinstance(processing_classes, (list, tuple)):
        if len(processing_classes) != len(funcs):
            raise ValueError(f"the number of `reward_processing_classes` ({len(processing_classes)}) must match the "
                             f"number of reward functions ({len(funcs)}); give one per reward function (None for "
                             "callables).")
        return list(processing_classes)
    model_positions = [i for i, func in enumerate(funcs) if isinstance(func, str) or _is_model(func)]
    if len(model_positions) != 1:
        raise ValueError(f"a single `reward_processing_classes` needs exactly one reward model, found "
                         f"{len(model_positions)}: processing classes must match the reward functions, so give a list "
                         "with one entry per reward function (None for callables).")
    return [processing_classes if i == model_positions[0] else None for i in range(len(funcs))]


def _prepare(func, tokenizer, position: int, model_init_kwargs: dict):
    """Loads a reward model given by name, finds its tokenizer, and freezes it; callables pass through."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if isinstance(func, str):
        path = func
        func = AutoModelForSequenceClassification.from_pretrained(path, **{"num_labels": 1, **model_init_kwargs})
        if tokenizer is None:
            remote = {"trust_remote_code": True} if model_init_kwargs.get("trust_remote_code") else {}
            tokenizer = AutoTokenizer.from_pretrained(path, **remote)
    elif _is_model(func):
        if tokenizer is None:
            tokenizer = _tokenizer_from_model_name(func, position)
    elif callable(func):
        return func, None
    else:
        raise TypeError(f"reward function {position} is a {type(func).__name__}: expected a callable, a reward model "
                        "name or path, or a sequence-classification PreTrainedModel.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if func.config.pad_token_id is None:
        func.config.pad_token_id = tokenizer.pad_token_id
    func.eval()
    func.requires_grad_(False)
    return func, tokenizer


def _tokenizer_from_model_name(model, position: int):
    from transformers import AutoTokenizer

    name_or_path = getattr(model.config, "_name_or_path", "") or ""
    no_tokenizer = (f"reward model {position} ({type(model).__name__}) has no tokenizer: pass it in "
                    "`reward_processing_classes` at the same position")
    if not name_or_path:
        raise ValueError(f"{no_tokenizer} (its config names no checkpoint to load one from).")
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as error:  # any loading failure means the same thing to the user
        raise ValueError(f"{no_tokenizer} (loading one from {name_or_path!r} failed: {error}).") from error


def _name_of(func) -> str:
    """The name metrics are logged under: the function's own name, or the reward model's checkpoint name."""
    if _is_model(func):
        name_or_path = (getattr(func.config, "_name_or_path", "") or "").rstrip("/\\")
        return name_or_path.replace("\\", "/").split("/")[-1] or type(func).__name__
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def _distinct(names) -> list[str]:
    """Suffixes repeated names with _2, _3, ... so each function's metrics stay separate."""
    out: list[str] = []
    for name in names:
        candidate, count = name, 1
        while candidate in out:
            count += 1
            candidate = f"{name}_{count}"
        out.append(candidate)
    return out


def _checked_weights(reward_weights, count: int) -> torch.Tensor:
    if reward_weights is None:
        return torch.ones(count, dtype=torch.float32)
    weights = torch.as_tensor(reward_weights, dtype=torch.float32).flatten()
    if weights.numel() != count:
        raise ValueError(f"`reward_weights` has {weights.numel()} entries but there are {count} reward functions.")
    if not torch.isfinite(weights).all():
        raise ValueError(f"`reward_weights` must be finite, got {weights.tolist()}.")
    return weights


# --- scoring -------------------------------------------------------------------------------------------------------


def _check_inputs(prompts, completion_ids, columns: dict, n: int) -> None:
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"score() needs one prompt and one completion_ids per completion: got {len(prompts)} prompts, "
                         f"{n} completions, {len(completion_ids)} completion_ids.")
    for key, values in columns.items():
        if key in _RESERVED_KEYWORDS:
            raise ValueError(f"dataset column {key!r} clashes with a keyword every reward function receives.")
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} entries for {n} completions.")


def _call(func, name: str, n: int, **kwargs):
    try:
        return func(**kwargs)
    except Exception as error:
        raise RewardFunctionError(
            f"reward function {name!r} raised {type(error).__name__}: {error} (while scoring {n} completions)"
        ) from error


def _await_all(awaitables: list, names: list[str], n: int) -> list:
    """Runs the async reward functions concurrently (an LLM judge is mostly waiting), in a private event loop on a
    worker thread so it works whether or not the caller is itself inside an event loop."""

    async def guarded(awaitable, name):
        try:
            return await awaitable
        except Exception as error:
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(error).__name__}: {error} (while scoring {n} completions)"
            ) from error

    async def gather():
        return await asyncio.gather(*(guarded(a, name) for a, name in zip(awaitables, names)))

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _as_reward_column(result, name: str, n: int) -> tuple[torch.Tensor, int, int]:
    """[n] float32 from what a function returned; None -> NaN; (values, None count, NaN count)."""
    if isinstance(result, torch.Tensor | np.ndarray):
        if result.ndim != 1:
            raise TypeError(f"reward function {name!r} returned a {result.ndim}-D {type(result).__name__} of shape "
                            f"{tuple(result.shape)}; expected one reward per completion (1-D).")
        items = result.detach().cpu().tolist() if isinstance(result, torch.Tensor) else list(result)
    elif isinstance(result, list | tuple):
        items = result
    else:
        raise TypeError(f"reward function {name!r} returned {type(result).__name__}; expected a list with one "
                        f"reward (a number or None) per completion.")
    if len(items) != n:
        raise ValueError(f"reward function {name!r} returned {len(items)} rewards for {n} completions.")
    values, none_count, nan_count = [], 0, 0
    for index, item in enumerate(items):
        if item is None:
            none_count += 1
            values.append(math.nan)
            continue
        value = _as_number(item)
        if value is None:
            raise TypeError(f"reward function {name!r} returned a {type(item).__name__} at index {index}; expected a "
                            "number or None.")
        nan_count += math.isnan(value)
        values.append(value)
    # checked on the float32 column the advantages are computed from: a finite Python float beyond float32's range
    # (|x| > 3.4e38, e.g. 1e39) becomes inf there
    column = torch.tensor(values, dtype=torch.float32)
    infinite = int(torch.isinf(column).sum())
    if infinite:
        raise ValueError(f"reward function {name!r} returned {infinite} infinite reward(s) out of {n} (inf, or beyond "
                         "float32's range of +-3.4e38); return None for a completion that should get no reward.")
    return column, none_count, nan_count


def _as_number(item) -> float | None:
    """A real number as float, or None if `item` is not one (strings, complex numbers, containers)."""
    if isinstance(item, bool | np.bool_):
        return float(item)
    if isinstance(item, numbers.Real):
        return float(item)
    if isinstance(item, torch.Tensor) and item.ndim == 0 and not item.is_complex():
        return float(item.item())
    if isinstance(item, np.ndarray) and item.ndim == 0:
        return _as_number(item.item())
    return None


def _is_conversational(example) -> bool:
    return isinstance(example, list) and all(isinstance(m, dict) and "role" in m for m in example) and bool(example)


def _reward_model_texts(tokenizer, prompts: list, completions: list) -> tuple[list[str], bool]:
    """The text a reward model reads for each completion, and whether it already holds its special tokens."""
    conversational = _is_conversational(prompts[0]) if prompts else False
    texts = []
    for prompt, completion in zip(prompts, completions):
        if _is_conversational(prompt) != conversational or _is_conversational(completion) != conversational:
            raise ValueError("prompts and completions must be all conversational (lists of messages) or all plain "
                             f"text to be scored by a reward model; got a {type(prompt).__name__} prompt and a "
                             f"{type(completion).__name__} completion.")
        if conversational:
            texts.append(tokenizer.apply_chat_template(prompt + completion, tokenize=False))
        else:
            texts.append(prompt + completion)
    return texts, conversational


def _score_with_model(model, tokenizer, prompts: list, completions: list, runner=None) -> torch.Tensor:
    """logits[:, 0] of the reward model per text, in right-padded chunks; no truncation (a too-long text is an
    error, since scoring a cut-off completion would reward the wrong thing)."""
    texts, has_special_tokens = _reward_model_texts(tokenizer, prompts, completions)
    if not texts:
        return torch.zeros(0)
    ids = tokenizer(texts, add_special_tokens=not has_special_tokens)["input_ids"]
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    if limit is not None and len(ids[longest]) > limit:
        raise ValueError(f"completion {longest} is {len(ids[longest])} tokens for the reward model "
                         f"{_name_of(model)!r}, longer than its max_position_embeddings ({limit}); shorten "
                         "max_completion_length or the prompts.")
    if any(len(row) == 0 for row in ids):
        raise ValueError(f"a text for the reward model {_name_of(model)!r} tokenised to no tokens at all.")
    rewards = []
    with torch.no_grad():
        for start in range(0, len(ids), REWARD_MODEL_BATCH_SIZE):
            chunk = ids[start:start + REWARD_MODEL_BATCH_SIZE]
            input_ids, attention_mask = _right_padded(chunk, tokenizer.pad_token_id, model.device)
            logits = (runner or model)(input_ids=input_ids, attention_mask=attention_mask).logits
            rewards.append(logits[:, 0].float().cpu())
    return torch.cat(rewards)


def _right_padded(rows: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, :len(row)] = 1
    return input_ids.to(device), attention_mask.to(device)
