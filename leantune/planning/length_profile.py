"""Planning from `leantune profile`'s JSON instead of the data: rows of token ids with the profiled lengths.

The profile keeps every kept row's lengths in data order (`row_lengths`: SFT sequences and, for prompt-completion
data, their prompt tokens; preference pairs' prompt, chosen and rejected), as the trainer sees them after
tokenisation. The rows rebuilt here are pre-tokenised data of exactly those lengths (prompt tokens not targets), so
the trainer truncates, packs, shuffles and batches them as it would the real rows: the plan is the data's plan.
Token values are a filler id (no special token): a step's memory depends on shapes and target positions, not ids.
"""

from __future__ import annotations

import json
import os

import datasets
import numpy as np

from ..methods import METHODS, Method, find

# The rows a method's entry in leantune/methods.py says it is planned from (`profile_rows`), by the profile's kind.
ROWS_OF_KIND = {"sft": ("sequences",), "preference": ("pairs", "whole_pairs")}


def read_length_profile(source) -> dict:
    """The profile as a dict, from its JSON file (or the dict itself); a one-line error naming the file otherwise."""
    if isinstance(source, dict):
        profile = source
    else:
        path = os.fspath(source)
        try:
            with open(path, encoding="utf-8") as handle:
                profile = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"`lengths`: cannot read {path!r} as leantune profile's JSON ({error}).") from error
    if not isinstance(profile, dict) or "row_lengths" not in profile:
        raise ValueError("`lengths`: this JSON has no `row_lengths` (each row's lengths); write it with this version's "
                         "`leantune profile`.")
    return profile


def dataset_from_lengths(source, method, filler_token: int = 100):
    """A `datasets.Dataset` of pre-tokenised rows with the profile's lengths, in the profile's row order, for `method`
    (its entry in leantune/methods.py, or a name such as "sft" or "dpo")."""
    method = method if isinstance(method, Method) else find(method)
    profile = read_length_profile(source)
    rows, kind = profile["row_lengths"], profile.get("kind", "sft")
    if kind == "sft" and method.profile_rows == "sequences":
        sequences = rows["sequences"]
        prompts = rows.get("prompts") or [0] * len(sequences)
        data = {"input_ids": [[filler_token] * n for n in sequences]}
        if "prompts" in rows:
            data["completion_mask"] = [[0] * p + [1] * (n - p) for n, p in zip(sequences, prompts)]
        return datasets.Dataset.from_dict(data)
    if kind == "preference" and method.profile_rows in ("pairs", "whole_pairs"):
        prompt, chosen, rejected = (rows[name] for name in ("prompt", "chosen", "rejected"))
        whole = method.profile_rows == "whole_pairs"  # chosen_ids / rejected_ids with their prompt, as the reward's
        data = {"chosen_ids": [[filler_token] * ((p if whole else 0) + c) for p, c in zip(prompt, chosen)],
                "rejected_ids": [[filler_token] * ((p if whole else 0) + r) for p, r in zip(prompt, rejected)]}
        if not whole:
            data = {"prompt_ids": [[filler_token] * p for p in prompt], **data}
        return datasets.Dataset.from_dict(data)
    known = [m.card_name for m in METHODS.values() if m.profile_rows in ROWS_OF_KIND.get(kind, ROWS_OF_KIND["preference"])]
    raise ValueError(f"`lengths`: a profile of {kind} data plans methods {', '.join(known)}, not "
                     f"{method.card_name!r}.")


def sequence_lengths_of(source) -> np.ndarray:
    """The lengths the trainer truncates to `max_length`: SFT sequences, or each pair's prompt + chosen and prompt +
    rejected."""
    rows = read_length_profile(source)["row_lengths"]
    if "sequences" in rows:
        return np.asarray(rows["sequences"], dtype=np.int64)
    prompt = np.asarray(rows["prompt"], dtype=np.int64)
    return np.stack([prompt + np.asarray(rows["chosen"]), prompt + np.asarray(rows["rejected"])], axis=1).reshape(-1)


def keep_threshold_of(source, default: float = 0.99) -> float:
    profile = read_length_profile(source)
    return float((profile.get("recommendation") or {}).get("keep_threshold", default))
