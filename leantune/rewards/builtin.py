"""Reward functions that ship with leantune, and how the command line names reward functions.

Built-ins check a completion against the row's reference answer (an `answer` or `solution` column): they are the
verifiable rewards of the demo and of math data such as GSM8K. A row without a reference gets None from them, which
the trainer counts as "not scored by this function" instead of reading it as a reward of 0.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable

from ..data.formats import completion_text

REFERENCE_COLUMNS = ("answer", "solution")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _references(kwargs: dict) -> list:
    for name in REFERENCE_COLUMNS:
        if name in kwargs:
            return list(kwargs[name])
    raise ValueError(f"this reward needs a reference column ({' or '.join(REFERENCE_COLUMNS)}) in the dataset; "
                     f"the rows have {sorted(k for k in kwargs if k not in ('trainer_state', 'completion_ids'))}.")


def reference_answer(reference) -> str | None:
    """The checkable part of a reference: GSM8K's "... #### 42" gives "42"; other text is kept, stripped."""
    if reference is None:
        return None
    text = str(reference)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip()


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _against_references(completions, kwargs: dict, score: Callable[[str, str], float]) -> list[float | None]:
    """score(completion text stripped, checkable reference) per completion; None where the row has no reference."""
    out: list[float | None] = []
    for completion, reference in zip(completions, _references(kwargs)):
        expected = reference_answer(reference)
        out.append(None if expected is None else score(completion_text(completion).strip(), expected))
    return out


def _states_answer(text: str, expected: str) -> float:
    number = _as_number(expected)
    if number is None:
        return float(text == expected)
    found = _NUMBER.findall(text)
    return float(bool(found) and _as_number(found[-1]) == number)


def _share_in_place(text: str, expected: str) -> float:
    return sum(a == b for a, b in zip(text, expected)) / max(len(text), len(expected), 1)


def correct_answer(completions, **kwargs) -> list[float | None]:
    """1.0 when the completion states the reference answer, else 0.0.

    A numeric reference is compared with the last number in the completion (so "... the answer is 42." counts);
    any other reference must equal the whole completion, surrounding space ignored.
    """
    return _against_references(completions, kwargs, _states_answer)


def characters_in_place(completions, **kwargs) -> list[float | None]:
    """Share of the reference's characters the completion has at the right position (a denser signal than exact
    match: partly right answers score between 0 and 1; extra characters count against it)."""
    return _against_references(completions, kwargs, _share_in_place)


BUILTIN_REWARDS: dict[str, Callable] = {
    "correct_answer": correct_answer,
    "characters_in_place": characters_in_place,
}


def resolve_reward_funcs(names: list[str]) -> list:
    """Command-line names -> what `reward_funcs` takes: a built-in's name, `package.module:function`, or a reward
    model (Hub id or local folder, loaded by the trainer)."""
    resolved = []
    for name in names:
        if name in BUILTIN_REWARDS:
            resolved.append(BUILTIN_REWARDS[name])
        elif os.path.isdir(name):
            resolved.append(name)  # a reward model in a folder; the trainer loads it
        elif ":" in name:
            module_name, _, attribute = name.partition(":")
            try:
                func = getattr(importlib.import_module(module_name), attribute)
            except (ImportError, AttributeError) as error:
                raise ValueError(f"reward function {name!r} could not be imported: {error}") from error
            if not callable(func):
                raise ValueError(f"reward function {name!r} is a {type(func).__name__}, not a callable.")
            resolved.append(func)
        elif "/" in name:
            resolved.append(name)  # a reward model's Hub id; the trainer loads it
        else:
            raise ValueError(f"unknown reward function {name!r}: use a built-in ({', '.join(BUILTIN_REWARDS)}), "
                             "package.module:function, or a reward model's Hub id or folder.")
    return resolved
