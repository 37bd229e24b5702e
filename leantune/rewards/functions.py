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

from .reward_models import is_reward_model, prepared_reward_source, processing_classes_by_position, score_with_model

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

    @property
    def complete(self) -> bool:
        """Every function scored every completion: no missing or NaN reward to count."""
        return not any(self.missing) and not any(self.nan)

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
        tokenizers = processing_classes_by_position(reward_processing_classes, funcs) if funcs else []
        self.funcs: list[Any] = []
        self.tokenizers: list[Any] = []
        for position, (func, tokenizer) in enumerate(zip(funcs, tokenizers)):
            func, tokenizer = prepared_reward_source(func, tokenizer, position, model_init_kwargs or {})
            self.funcs.append(func)
            self.tokenizers.append(tokenizer)
        weights = _checked_weights(reward_weights, len(self.funcs))
        self.funcs += list(extra_funcs)
        self.tokenizers += [None] * len(extra_funcs)
        self.names = _distinct(_name_of(func) for func in self.funcs)
        self.model_positions = {index for index, func in enumerate(self.funcs) if is_reward_model(func)}
        self.runners = {}  # the reward models as the trainer's engine runs them (`prepare_models`)
        self.weights = torch.cat([weights, torch.ones(len(extra_funcs), dtype=torch.float32)])

    def to(self, device) -> RewardFunctions:
        """Moves the reward models (callables stay where they are)."""
        for index in self.model_positions:
            self.funcs[index].to(device)
        return self

    def prepare_models(self, prepare) -> RewardFunctions:
        """Runs each reward model through what `prepare(model)` returns (the trainer's engine for frozen models, e.g.
        a ZeRO-3 inference engine); the model itself still names the function and gives its config."""
        self.runners = {index: prepare(self.funcs[index]) for index in sorted(self.model_positions)}
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
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric, **columns)
        results = [self._model_rewards(index, prompts, completions) if index in self.model_positions
                   else _call(func, name, n, **kwargs)
                   for index, (func, name) in enumerate(zip(self.funcs, self.names))]
        pending = [index for index, result in enumerate(results) if inspect.isawaitable(result)]
        if pending:  # async functions (an LLM judge) run concurrently
            awaited = _await_all([results[i] for i in pending], [self.names[i] for i in pending], n)
            for index, result in zip(pending, awaited):
                results[index] = result
        checked = [_as_reward_column(result, name, n) for result, name in zip(results, self.names)]
        columns_of_rewards = [column for column, _, _ in checked]
        per_function = torch.stack(columns_of_rewards, dim=1) if n else torch.zeros(0, len(self.funcs))
        return RewardScores(per_function=per_function, names=list(self.names),
                            missing=[missing for _, missing, _ in checked], nan=[nan for _, _, nan in checked])

    def _model_rewards(self, index: int, prompts: list, completions: list) -> torch.Tensor:
        """The rewards of the reward model at `index` (run as the engine prepared it)."""
        return score_with_model(self.funcs[index], self.tokenizers[index], prompts, completions,
                                self.runners.get(index), self.names[index])


# --- set-up --------------------------------------------------------------------------------------------------------










def _name_of(func) -> str:
    """The name metrics are logged under: the function's own name, or the reward model's checkpoint name."""
    if is_reward_model(func):
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
    """[n] float32 from what a function returned; None -> NaN; (values, None count, NaN count). A list of floats,
    the common return, is taken as it is; anything else is checked item by item (`_reward_numbers`)."""
    plain = isinstance(result, list) and len(result) == n and all(type(item) is float for item in result)
    values, none_count = (result, 0) if plain else _reward_numbers(result, name, n)
    # checked on the float32 column the advantages are computed from: a finite Python float beyond float32's range
    # (|x| > 3.4e38, e.g. 1e39) becomes inf there
    column = torch.tensor(values, dtype=torch.float32)
    infinite = int(torch.isinf(column).sum())
    if infinite:
        raise ValueError(f"reward function {name!r} returned {infinite} infinite reward(s) out of {n} (inf, or beyond "
                         "float32's range of +-3.4e38); return None for a completion that should get no reward.")
    return column, none_count, int(torch.isnan(column).sum()) - none_count


def _reward_numbers(result, name: str, n: int) -> tuple[list[float], int]:
    """(one float per completion, NaN for None; the None count) from a list, tuple, 1-D tensor or array of numbers
    or None; anything else is an error naming the function."""
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
    values, none_count = [], 0
    for index, item in enumerate(items):
        if item is None:
            none_count += 1
            values.append(math.nan)
            continue
        value = _as_number(item)
        if value is None:
            raise TypeError(f"reward function {name!r} returned a {type(item).__name__} at index {index}; expected a "
                            "number or None.")
        values.append(value)
    return values, none_count


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
