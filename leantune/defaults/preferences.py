"""Bundled preference data for the no-argument `leantune dpo | reward | kto` runs.

The reverse-a-word task of the SFT demo, as pairs: the chosen completion is the correct reversal, the rejected one
a plausible mistake (the word left as it is, half reversed, or the reversal with one letter changed). Generated
deterministically at run time, so it ships with the package; held-out pairs use prompts never seen in training,
so "the model prefers the right answer" is measured on new words.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from .tasks import LETTERS, _random_word, reverse_answer


def _wrong_reversal(rng: random.Random, word: str) -> str:
    right = reverse_answer(word)
    mistakes = [word, word[: len(word) // 2][::-1] + word[len(word) // 2:]]
    position = rng.randrange(len(right))
    letter = rng.choice([c for c in LETTERS if c != right[position]])
    mistakes.append(right[:position] + letter + right[position + 1:])
    wrong = [m for m in mistakes if m != right]
    return rng.choice(wrong)


def build_default_preference_dataset(num_train: int, num_eval: int, seed: int = 0) -> DatasetDict:
    """`train` / `test` splits of {prompt, chosen, rejected}; prompts unique across both splits."""
    rng = random.Random(f"leantune-defaults/preferences/{seed}")
    seen: set[str] = set()
    splits = {}
    for name, count in (("test", num_eval), ("train", num_train)):
        rows = {"prompt": [], "chosen": [], "rejected": []}
        while len(rows["prompt"]) < count:
            word = _random_word(rng, 3, 6)
            prompt = f"reverse: {word} ="
            if prompt in seen or reverse_answer(word) == word:
                continue
            seen.add(prompt)
            rows["prompt"].append(prompt)
            rows["chosen"].append(f" {reverse_answer(word)}")
            rows["rejected"].append(f" {_wrong_reversal(rng, word)}")
        splits[name] = Dataset.from_dict(rows)
    return DatasetDict(splits)


def unpaired(dataset: Dataset, seed: int = 0) -> Dataset:
    """KTO's unpaired form of preference pairs: each pair gives a desirable and an undesirable example."""
    rows = {"prompt": [], "completion": [], "label": []}
    for row in dataset:
        for key, label in (("chosen", True), ("rejected", False)):
            rows["prompt"].append(row["prompt"])
            rows["completion"].append(row[key])
            rows["label"].append(label)
    return Dataset.from_dict(rows).shuffle(seed=seed)
