"""Sequence-classification reward models among the reward functions: loaded by name or path with their tokenizer,
frozen, and scored in right-padded chunks (logits[:, 0]), never truncated."""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

REWARD_MODEL_BATCH_SIZE = 64
"""Texts per reward-model forward pass: bounds the activation memory of scoring a large generation round."""


def is_reward_model(func) -> bool:
    return isinstance(func, PreTrainedModel)


def processing_classes_by_position(processing_classes, funcs) -> list:
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
    model_positions = [i for i, func in enumerate(funcs) if isinstance(func, str) or is_reward_model(func)]
    if len(model_positions) != 1:
        raise ValueError(f"a single `reward_processing_classes` needs exactly one reward model, found "
                         f"{len(model_positions)}: processing classes must match the reward functions, so give a list "
                         "with one entry per reward function (None for callables).")
    return [processing_classes if i == model_positions[0] else None for i in range(len(funcs))]


def _tokenizer_from_model_name(model, position: int):
    name_or_path = getattr(model.config, "_name_or_path", "") or ""
    no_tokenizer = (f"reward model {position} ({type(model).__name__}) has no tokenizer: pass it in "
                    "`reward_processing_classes` at the same position")
    if not name_or_path:
        raise ValueError(f"{no_tokenizer} (its config names no checkpoint to load one from).")
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as error:  # any loading failure means the same thing to the user
        raise ValueError(f"{no_tokenizer} (loading one from {name_or_path!r} failed: {error}).") from error


def prepared_reward_source(func, tokenizer, position: int, model_init_kwargs: dict):
    """Loads a reward model given by name, finds its tokenizer, and freezes it; callables pass through."""
    if isinstance(func, str):
        path = func
        func = AutoModelForSequenceClassification.from_pretrained(path, **{"num_labels": 1, **model_init_kwargs})
        if tokenizer is None:
            remote = {"trust_remote_code": True} if model_init_kwargs.get("trust_remote_code") else {}
            tokenizer = AutoTokenizer.from_pretrained(path, **remote)
    elif is_reward_model(func):
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


def score_with_model(model, tokenizer, prompts: list, completions: list, runner=None,
                     name: str = "") -> torch.Tensor:
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
                         f"{name!r}, longer than its max_position_embeddings ({limit}); shorten "
                         "max_completion_length or the prompts.")
    if any(len(row) == 0 for row in ids):
        raise ValueError(f"a text for the reward model {name!r} tokenised to no tokens at all.")
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
