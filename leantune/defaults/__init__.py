"""Self-contained defaults for ``leantune sft`` with no arguments.

Everything here is generated in code at run time -- tokenizer, dataset, model
config -- so the demo run needs no files and no network, is deterministic for a
seed, and trains a randomly initialised tiny model on 2 CPU cores in about a
minute (400 steps), with an exact-match evaluation before and after to show it learned.

Typical use::

    tok = build_default_tokenizer()
    data = build_default_dataset(DEFAULT_TRAINING["num_train"], DEFAULT_TRAINING["num_eval"])
    model = AutoModelForCausalLM.from_config(build_default_model_config(tok))
    before = evaluate_exact_match(model, tok, data["test"])
    ...  # SFT on data["train"] with DEFAULT_TRAINING hyperparameters
    after = evaluate_exact_match(model, tok, data["test"])
"""

from leantune.defaults.evaluation import (
    evaluate_exact_match,
    exact_match_score,
    is_exact_match,
    normalize_answer,
)
from leantune.defaults.model import DEFAULT_TRAINING, RUN_ONLY_KEYS, build_default_model_config
from leantune.defaults.tasks import (
    DEFAULT_TASK,
    TASKS,
    as_prompts_with_answers,
    build_default_dataset,
    solve_prompt,
)
from leantune.defaults.tokenizer import CHAT_TEMPLATE, build_default_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_TASK",
    "DEFAULT_TRAINING",
    "RUN_ONLY_KEYS",
    "TASKS",
    "as_prompts_with_answers",
    "build_default_dataset",
    "build_default_model_config",
    "build_default_tokenizer",
    "evaluate_exact_match",
    "exact_match_score",
    "is_exact_match",
    "normalize_answer",
    "solve_prompt",
]
