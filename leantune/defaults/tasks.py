"""Synthetic, exact-match tasks for the built-in demo run.

Why synthetic: ``leantune sft`` with no arguments must train on something that
ships with the package, is generated deterministically at run time (no files, no
network) and has a single correct answer per prompt, so "did the model learn?"
is a plain exact-match number before vs. after training.

Each example is in TRL's *prompt-completion* format: ``prompt`` is the question
(e.g. ``"reverse: cat ="``) and ``completion`` is the answer with a leading space
(``" tac"``).  The trainer is expected to append the tokenizer's eos token to
the completion and to compute the loss on completion tokens only.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from datasets import Dataset, DatasetDict

LETTERS = string.ascii_lowercase


def reverse_answer(word: str) -> str:
    """Ground truth for the ``reverse`` task."""
    return word[::-1]


def sort_answer(word: str) -> str:
    """Ground truth for the ``sort`` task."""
    return "".join(sorted(word))


def add_answer(a: int, b: int) -> str:
    """Ground truth for the ``add`` task."""
    return str(a + b)


def _random_word(rng: random.Random, min_len: int, max_len: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))


def _reverse_example(rng: random.Random) -> tuple[str, str]:
    word = _random_word(rng, 3, 6)
    return f"reverse: {word} =", f" {reverse_answer(word)}"


def _sort_example(rng: random.Random) -> tuple[str, str]:
    word = _random_word(rng, 3, 6)
    return f"sort: {word} =", f" {sort_answer(word)}"


def _add_example(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"add: {a} + {b} =", f" {add_answer(a, b)}"


# name -> generator of one (prompt, completion) pair from a seeded RNG.
TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "reverse": _reverse_example,
    "sort": _sort_example,
    "add": _add_example,
}
DEFAULT_TASK = "reverse"


def solve_prompt(prompt: str) -> str:
    """Independently recompute the answer (without leading space) for any task prompt."""
    op, _, rest = prompt.partition(": ")
    arg = rest.removesuffix(" =")
    if op == "reverse":
        return reverse_answer(arg)
    if op == "sort":
        return sort_answer(arg)
    if op == "add":
        a, b = arg.split(" + ")
        return add_answer(int(a), int(b))
    raise ValueError(f"unknown task prompt: {prompt!r}")


def build_default_dataset(
    num_train: int, num_eval: int, seed: int = 0, task: str = DEFAULT_TASK
) -> DatasetDict:
    """Generate ``train``/``test`` splits of a synthetic task, deterministically.

    Prompts are unique across the whole dataset, so the held-out ``test`` split
    measures generalisation, not memorisation.  The test split is drawn first,
    so it does not change when ``num_train`` changes.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    if num_train < 0 or num_eval < 0:
        raise ValueError("num_train and num_eval must be non-negative")
    make = TASKS[task]
    rng = random.Random(f"leantune-defaults/{task}/{seed}")
    seen: set[str] = set()
    splits: dict[str, dict[str, list[str]]] = {}
    max_tries = 50 * (num_train + num_eval) + 1000
    tries = 0
    for name, count in (("test", num_eval), ("train", num_train)):
        prompts: list[str] = []
        completions: list[str] = []
        while len(prompts) < count:
            tries += 1
            if tries > max_tries:
                raise ValueError(
                    f"task {task!r} cannot provide {num_train + num_eval} unique prompts"
                )
            prompt, completion = make(rng)
            if prompt in seen:
                continue
            seen.add(prompt)
            prompts.append(prompt)
            completions.append(completion)
        splits[name] = {"prompt": prompts, "completion": completions}
    return DatasetDict(
        train=Dataset.from_dict(splits["train"]), test=Dataset.from_dict(splits["test"])
    )


def as_prompts_with_answers(dataset: Dataset) -> Dataset:
    """Prompt-completion rows -> the online trainers' rows: `prompt` and the reference `answer` a reward checks."""
    answers = [completion.strip() for completion in dataset["completion"]]
    return dataset.remove_columns("completion").add_column("answer", answers)
