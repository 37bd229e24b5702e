"""Exact-match evaluation by greedy generation.

Why exact match: the built-in tasks have one correct answer per prompt, so the
fraction of held-out prompts answered exactly right is an unambiguous "did it
learn?" signal, unlike loss values that mean little to a first-time user.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..data.formats import completion_text


def normalize_answer(text: str) -> str:
    """Canonical form used for comparison: surrounding whitespace removed."""
    return text.strip()


def is_exact_match(prediction: str, reference: str) -> bool:
    """True when the prediction equals the reference after normalisation."""
    return normalize_answer(prediction) == normalize_answer(reference)


def exact_match_score(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of predictions that exactly match their reference (0.0 for no examples)."""
    if len(predictions) != len(references):
        raise ValueError(
            f"got {len(predictions)} predictions for {len(references)} references"
        )
    if not references:
        return 0.0
    hits = sum(is_exact_match(p, r) for p, r in zip(predictions, references))
    return hits / len(references)


def _prompt_and_reference(example: Mapping[str, Any], tokenizer) -> tuple[str, str]:
    """Prompt text (as fed to the model) and expected answer for one example.

    Supports string prompt-completion rows and conversational rows (lists of
    ``{"role", "content"}`` messages, rendered with the chat template).
    """
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(prompt, str):
        return prompt, completion
    text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    return text, completion_text(completion)


@torch.no_grad()
def evaluate_exact_match(
    model,
    tokenizer,
    dataset: Iterable[Mapping[str, Any]],
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    num_examples_to_show: int = 5,
) -> dict[str, Any]:
    """Greedy-decode each prompt and score the stripped output against the completion.

    Returns ``{"exact_match": float, "num_examples": int, "examples": [(prompt,
    expected, got), ...]}``.  ``max_new_tokens`` defaults to the longest expected
    answer plus two tokens (room for eos), which keeps evaluation fast and also
    fails answers that ramble on.  The model's train/eval mode and the
    tokenizer's padding side are restored afterwards.
    """
    rows = [_prompt_and_reference(ex, tokenizer) for ex in dataset]
    prompts = [p for p, _ in rows]
    references = [r for _, r in rows]
    if max_new_tokens is None:
        longest = max(
            (len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in references),
            default=0,
        )
        max_new_tokens = longest + 2
    # Chat-rendered prompts already contain bos; plain prompts get it from the tokenizer.
    add_special = not any(
        tokenizer.bos_token and p.startswith(tokenizer.bos_token) for p in prompts
    )

    was_training = model.training
    old_padding_side = tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # decoder-only batched generation needs left padding
    device = next(model.parameters()).device
    predictions: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(
                prompts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=add_special,
            ).to(device)
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            new_tokens = out[:, batch["input_ids"].shape[1] :]
            predictions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = old_padding_side
        model.train(was_training)

    examples = [
        (p, normalize_answer(r), normalize_answer(g))
        for p, r, g in list(zip(prompts, references, predictions))[:num_examples_to_show]
    ]
    return {
        "exact_match": exact_match_score(predictions, references),
        "num_examples": len(references),
        "examples": examples,
    }
