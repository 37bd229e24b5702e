"""RewardTrainer: a sequence-classification model learns to score chosen above rejected (Bradley-Terry).

A recipe over leantune's shared pieces: preference pairs are prepared (formats, drops, truncation, all counted) and
collated (chosen sequences, then rejected ones, padded or padding-free) exactly as for DPO. The reward of a sequence is
the score head's output at the token the model's own pooling reads at inference: the last token that is not the pad
token. The trainer reads it itself, from the per-token scores, so padded and padding-free batches give the same
rewards (the model's pooling looks for pad tokens and cannot see sequence boundaries inside one flat row).
"""

from __future__ import annotations

import contextlib
import copy
import logging

import numpy as np
import torch
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
from transformers import AutoModelForSequenceClassification

from ..data.chat_template import load_chat_template
from ..data.collators import MODEL_INPUTS
from ..data.formats import rename_legacy_token_columns
from ..data.preference_collator import PreferenceCollator
from ..data.preference_preparation import prepare_preference_dataset
from ..data.report import NothingLeft
from ..losses.reward import bradley_terry_loss
from ..losses.token_logprobs import per_sequence_sum
from ..models.loading import (
    apply_peft,
    ensure_pad_token,
    load_causal_lm,
    load_tokenizer,
    parse_kwargs,
    with_quantization_config,
)
from ..models.output_head import unwrap_model
from ..models.segment_attention import SEGMENT_SDPA, use_segment_attention
from .base import LeantuneTrainer
from .reference import PolicyAndReference, disable_dropout
from .reward_config import RewardConfig
from .settings import checkpointing_of

logger = logging.getLogger("leantune.reward")
SCORE_HEAD = "score"  # the per-token reward head of decoder *ForSequenceClassification models (Llama, Qwen2, GPT-2...)
REWARD_SEQUENCE_KEY = "cp_reward_sequence"  # context parallelism: per position, the sequence whose reward it holds


class RewardTrainer(LeantuneTrainer):
    """Train a reward model (num_labels=1) on chosen / rejected pairs with the pairwise Bradley-Terry loss."""

    method = "reward"  # its entry in leantune/methods.py
    scores_vocabulary = False  # one score per sequence: no logits to chunk or fuse (a Liger flag chooses nothing)
    dataset_columns = ("chosen_ids", "rejected_ids", "margin")
    # No prepared_columns: TRL's tokenised input has the prepared columns' names, so only a dataset this trainer
    # prepared (its fingerprint) skips preparation; preparing prepared data again changes nothing.

    def __init__(
        self,
        model,
        args: RewardConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
    ):
        # reward model and tokenizer; pairs -> prompt / chosen / rejected ids, truncated and counted, an optional
        # margin per pair; batches of chosen then rejected sequences, padded or padding-free
        self.construct(model, args, train_dataset, eval_dataset, processing_class, data_collator,
                       peft_config=peft_config, quantization_config=quantization_config,
                       compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                       optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                       preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        # The loss needs no labels; evaluation still computes it, and hands the rewards to compute_metrics.
        self.label_names = []
        self.can_return_loss = True

    def load_models(self, model, ref_model, processing_class, peft_config, args, quantization_config):
        model_source = model
        model = load_reward_model(model, with_quantization_config(model, args.model_init_kwargs, quantization_config),
                                  trust_remote_code=args.trust_remote_code)
        tokenizer = load_tokenizer(model_source, processing_class, trust_remote_code=args.trust_remote_code)
        if args.chat_template_path:
            load_chat_template(tokenizer, args.chat_template_path)
        if args.eos_token is not None:
            if args.eos_token not in tokenizer.get_vocab():
                raise ValueError(f"eos_token {args.eos_token!r} is not in the tokenizer's vocabulary.")
            tokenizer.eos_token = args.eos_token
        ensure_pad_token(tokenizer, args.pad_token)
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.use_cache = False
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id == tokenizer.eos_token_id:
            logger.info("The pad token is the EOS token, so (as the model's own pooling does at inference) each "
                        "reward is read at the last token that is not EOS.")
        if getattr(unwrap_model(model), SCORE_HEAD, None) is None:
            if self.layout.padding_free:
                raise ValueError(f"padding_free needs a decoder reward model with a per-token `{SCORE_HEAD}` head; "
                                 f"{type(model).__name__} pools on its own. Use padded batches (padding_free=False).")
            logger.info("%s has no per-token `%s` head: rewards are the model's own pooled outputs.",
                        type(model).__name__, SCORE_HEAD)
        if self.layout.padding_free and use_segment_attention(model):
            logger.info("Padding-free batches: attention runs per sequence (%s).", SEGMENT_SDPA)
        model = apply_peft(model, reward_peft_config(peft_config, model), checkpointing_of(args).enabled)
        if args.disable_dropout:
            disable_dropout(model)
        return PolicyAndReference(model, None, tokenizer, False)

    def make_collator(self, tokenizer, args, train_dataset):
        return RewardCollator(tokenizer.pad_token_id, self.layout.padding_free, self.layout.pad_to_multiple_of)

    def prepare_split(self, dataset, split, tokenizer, args):
        return prepare_reward_dataset(dataset, tokenizer, args, split)

    # --- rewards --------------------------------------------------------------------------------------------------

    def items_in(self, batch: dict) -> torch.Tensor:
        return torch.as_tensor(batch["num_pairs"])

    def sequence_rewards(self, model, batch: dict) -> torch.Tensor:
        """One fp32 reward per sequence of the batch: [chosen..., rejected...]."""
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        head = getattr(unwrap_model(model), SCORE_HEAD, None)
        with self.logprobs.offloading_scope(model), capture_output(head) as captured:
            outputs = model(**inputs, use_cache=False)
        if head is None:
            return outputs.logits.reshape(-1).float()
        scores = captured["output"]
        if scores.shape[-1] != 1:
            raise ValueError(f"A reward model has one output per token (num_labels=1), got {scores.shape[-1]}.")
        if REWARD_SEQUENCE_KEY in batch:  # context parallelism: the rewards this process holds, made whole
            self.context_parallel.check_layout(inputs)
            sequence = batch[REWARD_SEQUENCE_KEY].reshape(-1)
            held = (sequence >= 0).nonzero().squeeze(-1)
            partial = per_sequence_sum(scores.reshape(-1).index_select(0, held).float(), sequence.index_select(0, held),
                                       2 * int(batch["num_pairs"]))
            return self.context_parallel.total(partial)
        index = reward_positions(batch, 2 * int(batch["num_pairs"]), self.processing_class.pad_token_id)
        return scores.reshape(-1).index_select(0, index).float()

    # --- context parallelism: each sequence's reward is read where its last token lands --------------------------

    def _prepare_context_parallel_inputs(self, model, inputs):
        sequences, pad = 2 * int(inputs["num_pairs"]), self.processing_class.pad_token_id

        def reward_grid(view: dict) -> dict:
            """Which sequence's reward each position holds (-1: none), read before the split."""
            index = reward_positions(view, sequences, pad)
            grid = torch.full((view["input_ids"].numel(),), -1, dtype=torch.long, device=index.device)
            grid[index] = torch.arange(sequences, device=index.device)
            return {REWARD_SEQUENCE_KEY: grid.view(view["input_ids"].shape)}

        return self.context_parallel.lay_out(inputs, pad, position_grids=reward_grid)

    def context_parallel_problem(self, args) -> str | None:
        if getattr(unwrap_model(self.model), SCORE_HEAD, None) is None:
            return (f"a reward model without a per-token `{SCORE_HEAD}` head (its own pooling would read one "
                    f"process's part of each sequence)")
        return None

    # --- the loss -------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = dict(inputs)
        self.run_metrics.count_tokens(model, batch)
        pairs = int(batch["num_pairs"])
        rewards = self.sequence_rewards(model, batch)
        chosen, rejected = rewards[:pairs], rewards[pairs:]
        losses = bradley_terry_loss(chosen, rejected, batch.get("margin"), self.args.center_rewards_coefficient)
        loss = self.step_loss.normalise(self.model, losses.sum(), pairs, num_items_in_batch,
                                        whole_sequences=REWARD_SEQUENCE_KEY in batch)  # the same on every process of a group
        self.run_metrics.record(model, **{"accuracy": (chosen > rejected).float(), "margin": chosen - rejected,
                                      "rewards/chosen": chosen, "rewards/rejected": rejected})
        if return_outputs:
            return loss, {"rewards_chosen": chosen.detach(), "rewards_rejected": rejected.detach()}
        return loss

    def summarise_metrics(self, store: dict[str, list[float]]) -> dict[str, float]:
        summary = super().summarise_metrics(store)
        every = store.get("rewards/chosen", []) + store.get("rewards/rejected", [])
        if every:
            summary.update(mean_reward=round(sum(every) / len(every), 6), min_reward=round(min(every), 6),
                           max_reward=round(max(every), 6))
        return summary


# --- model ----------------------------------------------------------------------------------------------------------


def load_reward_model(model, model_init_kwargs=None, trust_remote_code: bool = False):
    """A sequence-classification model with one output (the reward), from an id, a path or an object."""
    if isinstance(model, str):
        kwargs = {"dtype": "float32", **parse_kwargs(model_init_kwargs), "num_labels": 1}
        return load_causal_lm(model, kwargs, auto_class=AutoModelForSequenceClassification,
                              trust_remote_code=trust_remote_code)
    model = load_causal_lm(model, model_init_kwargs)
    num_labels = getattr(unwrap_model(model).config, "num_labels", None)
    if num_labels != 1:
        raise ValueError(f"reward models require `num_labels=1` (one score per sequence); this model has "
                         f"num_labels={num_labels}. "
                         "Build it with num_labels=1 (e.g. AutoModelForSequenceClassification.from_pretrained(..., "
                         "num_labels=1)) or pass its name or path as a string.")
    return model


def reward_peft_config(peft_config, model=None):
    """The adapter config with the reward head trained too: its weights are new, so a frozen random head would score
    with a fixed random projection of what the adapter learns.

    PEFT's SEQ_CLS task trains the head in full (`modules_to_save`): kept as given. Otherwise (no task type, or
    CAUSAL_LM, whose wrapper would treat the reward model as a language model) the task type is left unset and the
    head `score` gets a LoRA adapter beside the target modules (PEFT's defaults for the model type when none are
    named). For a one-output head that is no restriction: every update of a [1, hidden] matrix has rank 1. A target
    given as a pattern string (e.g. "all-linear", which leaves output layers out) gets the head in modules_to_save."""
    if peft_config is None:
        return None
    task = getattr(peft_config, "task_type", None)
    task = getattr(task, "value", task)
    if task == "SEQ_CLS":
        return peft_config
    config = copy.deepcopy(peft_config)
    if task == "CAUSAL_LM":
        config.task_type = None
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, str):
        saved = list(getattr(config, "modules_to_save", None) or [])
        if SCORE_HEAD not in saved:
            config.modules_to_save = [*saved, SCORE_HEAD]
            logger.info("PEFT: `%s` added to modules_to_save (the reward head is trained in full).", SCORE_HEAD)
        return config
    if targets is None and model is not None:
        targets = DEFAULTS.get(getattr(unwrap_model(model).config, "model_type", None))
    if targets is not None and SCORE_HEAD not in targets:
        config.target_modules = [*targets, SCORE_HEAD]
        logger.info("PEFT: a LoRA adapter on the reward head `%s` too, so it is trained.", SCORE_HEAD)
    return config


@contextlib.contextmanager
def capture_output(module):
    """Keep the output of `module` (the per-token scores) during the forward passes run inside the block."""
    captured = {}
    if module is None:
        yield captured
        return

    def keep(_module, _inputs, output):
        captured["output"] = output

    handle = module.register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def reward_positions(batch: dict, num_sequences: int, pad_token_id: int | None) -> torch.Tensor:
    """Flat position of each sequence's reward: its last token that is not the pad token (the model's own pooling
    rule; with pad == EOS that skips the final EOS), in padded rows or in the segments of a padding-free row."""
    input_ids = batch["input_ids"]
    flat = input_ids.reshape(-1)
    if "cu_seq_lens_q" in batch:
        offsets = batch["cu_seq_lens_q"].to(flat.device).long()
        starts, ends = offsets[:num_sequences], offsets[1: num_sequences + 1]
    else:
        rows, width = input_ids.shape
        mask = batch["attention_mask"].to(flat.device).bool()
        columns = torch.arange(width, device=flat.device)
        row_starts = torch.arange(rows, device=flat.device) * width
        # First and last attended column of each row, so right- and left-padded rows both work.
        starts = row_starts + torch.where(mask, columns, width).min(-1).values
        ends = row_starts + torch.where(mask, columns, -1).max(-1).values + 1
    positions = torch.arange(flat.numel(), device=flat.device)
    if pad_token_id is None:
        return ends - 1
    real = torch.where(flat != pad_token_id, positions, torch.full_like(positions, -1))
    last_real = torch.cummax(real, 0).values.index_select(0, ends - 1)
    return torch.where(last_real >= starts, last_real, ends - 1)


# --- data -----------------------------------------------------------------------------------------------------------


def prepare_reward_dataset(dataset, tokenizer, args, split: str):
    """Preference preparation shared with DPO (keeping a `margin` column), dropping (and counting) the pairs that
    truncation left identical (no preference left to learn); the pairs come out as TRL's whole sequences,
    `chosen_ids` / `rejected_ids` (prompt included)."""
    if dataset is not None and type(dataset).__name__ == "Dataset":
        dataset = split_whole_sequences(rename_legacy_token_columns(dataset))
    dataset, report = prepare_preference_dataset(dataset, tokenizer, args, split, keep_columns=("margin",))
    same = np.fromiter((c == r for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"])), bool,
                       len(dataset))
    if same.any():
        logger.warning("%s: dropped %d pair(s) whose chosen and rejected are identical after truncation.", split,
                       int(same.sum()))
        report.num_identical_dropped += int(same.sum())
        report.num_examples_out -= int(same.sum())
        if same.all():
            raise NothingLeft(f"No {split} pair is left after preparation: {report.as_dict()}.", report)
        dataset = dataset.select(np.flatnonzero(~same))

    def whole(batch):
        return {side: [list(p) + list(c) for p, c in zip(batch["prompt_ids"], batch[side])]
                for side in ("chosen_ids", "rejected_ids")}

    dataset = dataset.map(whole, batched=True, remove_columns=["prompt_ids"], desc=f"Joining {split} sequences")
    return dataset, report


def split_whole_sequences(dataset):
    """Whole-sequence pairs ({chosen_ids, rejected_ids}, no `prompt_ids`: TRL's tokenised reward data, or this
    trainer's own output) as prompt / chosen / rejected ids: the tokens both share are the prompt, so truncation
    cuts both sequences alike."""
    columns = set(dataset.column_names)
    if "prompt_ids" in columns or not {"chosen_ids", "rejected_ids"} <= columns:
        return dataset

    def split(batch):
        out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
        for c, r in zip(batch["chosen_ids"], batch["rejected_ids"]):
            shared = 0
            while shared < min(len(c), len(r)) - 1 and c[shared] == r[shared]:
                shared += 1
            out["prompt_ids"].append(list(c[:shared]))
            out["chosen_ids"].append(list(c[shared:]))
            out["rejected_ids"].append(list(r[shared:]))
        return out

    removed = [c for c in dataset.column_names if c != "margin"]
    return dataset.map(split, batched=True, remove_columns=removed, desc="Splitting tokenised pairs")


class RewardCollator(PreferenceCollator):
    """The preference pair layout (chosen sequences, then rejected), plus the optional per-pair `margin`."""

    def __call__(self, pairs: list[dict]) -> dict[str, torch.Tensor]:
        batch = super().__call__(pairs)
        if pairs and pairs[0].get("margin") is not None:
            batch["margin"] = torch.tensor([float(pair["margin"]) for pair in pairs], dtype=torch.float32)
        return batch
