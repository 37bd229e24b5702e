"""Prompts for the online trainers: recognised, tokenised once, cut or dropped by rule, and counted.

A prompt is text or a list of chat messages (`prompt` column; any other column goes to the reward functions).
Conversational prompts go through the chat template with the generation prompt added. `max_prompt_length` keeps
the end of a longer prompt (the question is usually last); a prompt that leaves no room for
`max_completion_length` new tokens in the model's context is dropped. Both are counted and logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .chat_template import require_chat_template, row_template_kwargs
from .formats import is_message_list
from .report import NothingLeft, PreparationReport

logger = logging.getLogger("leantune.data")

PROMPT_IDS = "prompt_ids"


@dataclass
class PromptReport(PreparationReport):
    num_truncated: int = 0
    num_too_long_dropped: int = 0
    conversational: bool = False

    UNIT = "prompt"
    HEADING = "prompts"
    OWN_NAMES = {"num_examples_in": "num_prompts_in", "num_examples_out": "num_prompts_out",
                 "tokens_dropped": "tokens_cut"}  # a prompt keeps its end: its first tokens are cut

    def log(self, args, context_limit: int | None) -> None:
        if self.num_empty_dropped:
            logger.warning("%s: dropped %d empty prompt(s) of %d.", self.split, self.num_empty_dropped,
                           self.num_examples_in)
        if self.num_truncated:
            logger.warning("%s: cut %d prompt(s) to max_prompt_length=%d (kept their ends), %d token(s) cut.",
                           self.split, self.num_truncated, args.max_prompt_length, self.tokens_dropped)
        if self.num_too_long_dropped:
            logger.warning(
                "%s: dropped %d prompt(s) too long to leave max_completion_length=%d tokens in the model's context "
                "of %s; set max_prompt_length to cut them instead.", self.split, self.num_too_long_dropped,
                args.max_completion_length, context_limit)
        self.log_summary()


def context_limit_of(model) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None) if config is not None else None


def is_conversational(dataset) -> bool:
    for value in dataset.select(range(min(len(dataset), 64)))["prompt"]:
        if value:
            return is_message_list(value)
    return False


def prompt_text(prompt, tokenizer, conversational: bool, chat_template_kwargs: dict | None = None) -> str:
    if not conversational:
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                         **(chat_template_kwargs or {}))


def prepare_prompt_dataset(dataset, tokenizer, args, split: str = "train", context_limit: int | None = None,
                           template_kwargs: dict | None = None):
    """(dataset with `prompt_ids` added, PromptReport). Raises when no prompt is left. `template_kwargs` go to every
    chat-template call (GRPO's `tools`), before each row's own."""
    if dataset is None:
        return None, None
    if len(dataset) == 0:  # before anything maps over it: a map of no rows adds no columns
        raise NothingLeft(f"The {split} dataset is empty (0 rows): the online trainers need prompts in a 'prompt' "
                          "column.", PromptReport(split=split))
    if "prompt" not in dataset.column_names:
        raise ValueError(f"The {split} dataset needs a 'prompt' column (text or a list of chat messages); "
                         f"it has {dataset.column_names}.")
    report = PromptReport(split=split, num_examples_in=len(dataset))
    report.log_args = (args, context_limit)  # a stream's live report logs as its buffers' do (data/streaming.py)
    report.conversational = is_conversational(dataset)
    if report.conversational:
        require_chat_template(tokenizer, "Conversational prompts")
    keep_budget = None if context_limit is None else context_limit - args.max_completion_length
    if keep_budget is not None and keep_budget <= 0:
        raise ValueError(f"max_completion_length={args.max_completion_length} leaves no room for a prompt in the "
                         f"model's context of {context_limit} tokens.")

    def tokenize(row):
        prompt = row["prompt"]
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            return {PROMPT_IDS: [], "_status": "empty", "_cut": 0}
        text = prompt_text(prompt, tokenizer, report.conversational,
                           {**(args.chat_template_kwargs or {}), **(template_kwargs or {}), **row_template_kwargs(row)})
        ids = tokenizer(text, add_special_tokens=not report.conversational)["input_ids"]
        cut = 0
        if args.max_prompt_length is not None and len(ids) > args.max_prompt_length:
            cut = len(ids) - args.max_prompt_length
            ids = ids[cut:]
        if keep_budget is not None and len(ids) > keep_budget:
            return {PROMPT_IDS: ids, "_status": "too_long", "_cut": cut}
        return {PROMPT_IDS: ids, "_status": "cut" if cut else "ok", "_cut": cut}

    tokenized = dataset.map(tokenize, num_proc=getattr(args, "dataset_num_proc", None),
                            desc=f"Tokenising {split} prompts")
    status, cuts = tokenized["_status"], tokenized["_cut"]
    report.num_empty_dropped = status.count("empty")
    report.num_too_long_dropped = status.count("too_long")
    report.num_truncated = sum(1 for s, c in zip(status, cuts) if c)
    report.tokens_dropped = int(sum(cuts))
    kept = [i for i, s in enumerate(status) if s in ("ok", "cut")]
    tokenized = tokenized.remove_columns(["_status", "_cut"])
    if len(kept) < len(tokenized):
        tokenized = tokenized.select(kept)
    report.num_examples_out = len(tokenized)
    report.log(args, context_limit)
    if not len(tokenized):
        raise NothingLeft(f"No {split} prompt is left after dropping empty and too-long prompts: {report.as_dict()}.",
                          report)
    return tokenized, report
