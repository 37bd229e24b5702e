"""SFTTrainer: supervised fine-tuning, as a recipe over leantune's shared data, loss and memory pieces."""

from __future__ import annotations

import logging

from transformers import TrainingArguments

from ..data.chat_template import load_chat_template
from ..data.collators import CausalLMCollator
from ..data.sft_preparation import loss_mask_columns, prepare_sft_dataset, sft_stream_order
from ..data.training_templates import announce_mask_template
from ..losses.token_logprobs import IGNORE_INDEX, count_targets
from ..models.loading import (
    apply_peft,
    ensure_pad_token,
    load_causal_lm,
    load_tokenizer,
    parse_kwargs,
    with_quantization_config,
)
from ..models.segment_attention import SEGMENT_SDPA, use_segment_attention
from .base import LeantuneTrainer
from .reference import PolicyAndReference
from .settings import checkpointing_of
from .sft_config import SFTConfig

logger = logging.getLogger("leantune.sft")


class SFTTrainer(LeantuneTrainer):
    """Train a causal LM on text, prompt-completion or conversational data."""

    dataset_columns = ("input_ids", "labels", "completion_mask", "assistant_masks", "seq_lengths")
    method = "sft"  # its entry in leantune/methods.py

    def __init__(
        self,
        model,
        args: SFTConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
        formatting_func=None,
    ):
        args = self.default_args(model, args)
        if args.loss_type == "dft" and compute_loss_func is not None:
            raise ValueError("`loss_type='dft'` is the loss itself; a `compute_loss_func` would replace it. Pass one "
                             "or the other.")
        self._formatting_func = formatting_func
        # model and tokenizer; data tokenised, truncated, packed (each step counted and logged); batches of padded,
        # padding-free or packed rows, all with the same loss tokens
        self.construct(model, args, train_dataset, eval_dataset, processing_class, data_collator,
                       peft_config=peft_config, quantization_config=quantization_config,
                       compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                       optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                       preprocess_logits_for_metrics=preprocess_logits_for_metrics)

    def liger_notes(self, args) -> list[tuple[int, str]]:
        return [(logging.INFO, "use_liger_kernel=True: Liger's fused linear cross-entropy gives the loss and "
                               "mean_token_accuracy; it computes no entropies, so the `entropy` metric is not logged.")]

    def default_args(self, model, args):
        if isinstance(args, TrainingArguments) and not isinstance(args, SFTConfig):
            values = args.to_dict()
            values["hub_token"] = args.hub_token  # to_dict hides it
            return SFTConfig(**values)  # as TRL does: the given values, SFT's defaults for the rest
        return super().default_args(model, args)

    def load_models(self, model, ref_model, processing_class, peft_config, args, quantization_config):
        model_source = model
        model = load_causal_lm(model, with_quantization_config(model, args.model_init_kwargs, quantization_config),
                               trust_remote_code=args.trust_remote_code)
        tokenizer = load_tokenizer(model_source, processing_class, trust_remote_code=args.trust_remote_code)
        if args.chat_template_path:
            load_chat_template(tokenizer, args.chat_template_path)
        if args.assistant_only_loss:
            announce_mask_template(tokenizer)
        ensure_pad_token(tokenizer, args.pad_token)
        checkpointing = checkpointing_of(args)
        if checkpointing.enabled:
            model.config.use_cache = False
        if (self.layout.packing or self.layout.padding_free) and use_segment_attention(model):
            logger.info("Packed/padding-free rows: attention runs per sequence (%s).", SEGMENT_SDPA)
        return PolicyAndReference(apply_peft(model, peft_config, checkpointing.enabled), None, tokenizer,
                                  False)

    def make_collator(self, tokenizer, args, train_dataset):
        return CausalLMCollator(pad_token_id=tokenizer.pad_token_id,
                                loss_mask_columns=tuple(loss_mask_columns(train_dataset, args)),
                                padding_free=self.layout.padding_free,
                                pad_to_multiple_of=self.layout.pad_to_multiple_of)

    stream_order = staticmethod(sft_stream_order)  # a train stream with shuffle_dataset: shuffled by buffer

    def skips_preparation(self, args) -> bool:
        return bool(parse_kwargs(args.dataset_kwargs).get("skip_prepare_dataset", False))

    def prepare_split(self, dataset, split, tokenizer, args):
        if self.skips_preparation(args):
            return dataset, None
        return prepare_sft_dataset(dataset, tokenizer, args, split, self._formatting_func,
                                   packing=self.layout.packs(split))

    def is_prepared(self, dataset) -> bool:
        """One this trainer prepared, or TRL's prepared form: token ids and labels (maybe packed), nothing else."""
        columns = set(getattr(dataset, "column_names", None) or ())
        return super().is_prepared(dataset) or ({"input_ids", "labels"} <= columns
                                                 and columns <= {"input_ids", "labels", "seq_lengths", "position_ids"})

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The token-mean NLL (or DFT's probability-weighted NLL), with TRL's `entropy` and `mean_token_accuracy`
        metrics of the targets; a `compute_loss_func` given to the trainer gets the model's full-logits outputs."""
        inputs = dict(inputs)
        # under context parallelism the targets arrive shifted (each position's next token) and split with the batch
        shifted = inputs.pop("shift_labels", None)
        labels = inputs.pop("labels") if shifted is None else shifted
        if shifted is not None:
            self.context_parallel.check_layout(inputs)
        self.run_metrics.count_tokens(model, inputs)
        if self.compute_loss_func is not None:
            with self.logprobs.offloading_scope(model):
                outputs = model(**inputs, use_cache=False)
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss
        local_count = (labels != IGNORE_INDEX).sum() if shifted is not None else count_targets(labels)
        metrics = {}
        if self.args.loss_type == "nll" and self.logprobs.fused_nll_runs(model):  # Liger's summed NLL (CUDA)
            loss_sum, accuracy, _, outputs = self.logprobs.target_nll_sum(model, inputs, labels,
                                                                          shifted=shifted is not None)
            if accuracy is not None:
                metrics["mean_token_accuracy"] = accuracy
        else:
            # Liger's kernel gives no entropies: on its path the entropy metric is not logged (noted in __init__)
            scores = self.logprobs.target_logprobs(model, inputs, labels, stats=("top1",), shifted=shifted is not None,
                                                   entropy_where_free=True)
            logps, top1, outputs = scores.logps, scores.stats["top1"], scores.outputs
            if scores.entropy is not None:
                metrics["entropy"] = scores.entropy.mean()
            token_loss = -logps
            if self.args.loss_type == "dft":  # DFT (arXiv 2508.05629): the NLL times the token's own probability
                token_loss = token_loss * logps.detach().exp()
            loss_sum = token_loss.sum()
            metrics["mean_token_accuracy"] = top1.float().mean()
        if shifted is not None:  # each process's means over its part of every sequence -> the whole batch's
            metrics = self.context_parallel.whole_means(metrics, int(local_count))
        if metrics:
            self.run_metrics.record(model, **{name: value.reshape(1) for name, value in metrics.items()})
        loss = self.step_loss.normalise(self.model, loss_sum, local_count, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss
