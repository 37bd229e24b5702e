"""What every leantune trainer shares on top of transformers' Trainer.

- The loss of an optimizer step is the mean over the real target tokens of that whole step (all micro-batches of
  gradient accumulation and, with `average_tokens_across_devices`, all processes), so micro-batch size,
  accumulation, padding and packing do not change it.
- Real tokens/s, padding fraction and peak memory are logged with the loss and reported at the end of training;
  one step's memory is broken down into its parts (parameters, gradients, optimizer states, activations, ...).
- The memory engine is composed here once for every trainer: target log-probabilities come from the full logits,
  the chunked head or Liger (`target_logprobs`, `target_nll_sum`), and the forward pass runs inside the
  activation-offloading scope when asked for.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections import defaultdict

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .. import methods
from ..data.streaming import is_stream, log_stream_report, require_max_steps, reset_counts, use_own_stream_reads
from ..losses.causal_lm import count_targets
from ..losses.dispatch import LogProbPath, choose_logprob_path
from ..losses.liger import (
    OLD_LIGER,
    liger_can_run,
    liger_head_problem,
    liger_nll_sum,
    liger_target_logprobs,
    per_target_gradients_supported,
)
from ..losses.token_logprobs import (
    Targets,
    TargetScores,
    chunked_logprobs,
    logprobs_from_logits,
    select_targets,
    token_stats_from_logits,
)
from ..memory import offloading
from ..memory.offloading import log_offloading_scope
from ..metrics.memory import memory_kind, peak_memory_bytes, reset_peak_memory
from ..metrics.memory_breakdown import MemoryBreakdown, MemoryBreakdownCallback
from ..metrics.throughput import TokenThroughput
from ..models import model_card
from ..models.output_head import OutputHead, text_config_of, unwrap_model
from . import checkpoint_files
from .context_parallel import ContextParallelism
from .cpu_loader import no_pinning_without_accelerator
from .distributed import check_world_size, leave_process_group_at_exit, named_collective_timeouts
from .memory_options import validate_memory_options
from .nonfinite import ROW_INDEX, NonFiniteGuard, validate_nonfinite_policy
from .step_logging import use_step_log_lines

logger = logging.getLogger("leantune.trainer")

MIB = 1024 * 1024


class LeantuneTrainer(NonFiniteGuard, ContextParallelism, Trainer):
    # compute_loss divides by the target count of the whole step, so the Trainer must not divide again.
    loss_is_scaled_for_ga = True
    # Dataset columns the collators read; everything else is removed by Trainer.
    dataset_columns: tuple[str, ...] = ()
    # Columns whose presence marks a dataset as already prepared by this trainer's recipe (see `is_prepared`).
    prepared_columns: tuple[str, ...] = ()
    # The key prefix of the evaluation running now ("eval", or "eval_<name>" for one of several eval datasets).
    _metric_prefix = "eval"
    # The trainer's entry in leantune/methods.py (config, TRL's names and defaults, the command line, the planner).
    method: str = ""
    # Whether `trainer.eval_dataset` stays the object the user passed (TRL's online trainers), its prepared form
    # kept aside for evaluate(), rather than being replaced by the prepared dataset.
    keeps_eval_dataset_as_given = False
    # Whether the trainer's log-probs are of logits divided by `args.temperature` (the online trainers').
    scores_at_temperature = False

    # --- construction: one sequence for every trainer, the method's steps as hooks --------------------------------

    def construct(self, model, args, train_dataset, eval_dataset, processing_class, data_collator, *,
                  peft_config=None, quantization_config=None, ref_model=None, **trainer_kwargs):
        """default args -> a train dataset is required -> models and tokenizer (`load_models`) -> each split prepared
        by the method's recipe (`prepare_split`) -> the collator (`make_collator`) -> Trainer's set-up -> the
        reference placed for the engine (`attach_reference`). Returns what `load_models` loaded."""
        # The trainer resolves its choices (Liger's patches on CUDA only, a stream's data-loader workers, ...) on its own
        # copy: the config object the user passed is never changed.
        args = copy.copy(self.default_args(model, args))
        self.require_train_dataset(train_dataset)
        loaded = self.load_models(model, ref_model, processing_class, peft_config, args, quantization_config)
        train_dataset, eval_dataset, reports = self.prepare_datasets(train_dataset, eval_dataset, loaded.tokenizer,
                                                                     args)
        if data_collator is None:
            data_collator = self.make_collator(loaded.tokenizer, args, train_dataset)
        LeantuneTrainer.__init__(self, model=loaded.model, args=args, data_collator=data_collator,
                                 train_dataset=train_dataset, eval_dataset=eval_dataset,
                                 processing_class=loaded.tokenizer, **trainer_kwargs)
        self.data_reports = reports
        self.attach_reference(loaded, args)
        return loaded

    def default_args(self, model, args):
        """TRL's default config: the method's config class with output_dir "<model name>-<method>"."""
        if args is not None:
            return args
        name, method = model if isinstance(model, str) else type(model).__name__, methods.of(self)
        return method.config_class(output_dir=f"{str(name).split('/')[-1]}-{method.output_suffix}")

    def load_models(self, model, ref_model, processing_class, peft_config, args, quantization_config):
        """The trained model (PEFT applied), its tokenizer and, for methods with one, the reference: a
        PolicyAndReference (trainers/reference.py)."""
        raise NotImplementedError

    def make_collator(self, tokenizer, args, train_dataset):
        raise NotImplementedError

    def attach_reference(self, loaded, args) -> None:
        """Place the reference for the engine once Trainer's set-up made the accelerator (methods without one: no-op)."""

    def __init__(self, *args, **kwargs):
        self.throughput = TokenThroughput()
        self.data_reports: dict = {}
        self.memory_breakdown: MemoryBreakdown | None = None
        # Per-example values of a trainer's own metrics, gathered across processes, averaged at each log.
        self.metric_values: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        config = kwargs["args"]
        check_world_size(config)  # several launched processes never train as duplicates (trainers/distributed.py)
        validate_memory_options(config)
        validate_nonfinite_policy(config)
        # TRL spells the request use_liger_kernel (SFT) or use_liger_loss (other trainers); either one asks for it.
        flags = [name for name in ("use_liger_kernel", "use_liger_loss") if getattr(config, name, False)]
        self.logprob_path = choose_logprob_path(bool(flags), config.device.type, " / ".join(flags) or "-",
                                                chunked=getattr(config, "chunked_loss", True))
        if getattr(config, "use_liger_kernel", False) and (self.logprob_path is not LogProbPath.LIGER
                                                           or config.device.type != "cuda"):
            # transformers would patch the model with liger's kernels (RMSNorm, RoPE, SwiGLU, ...): on CUDA only,
            # where they are compiled; under Triton's CPU interpreter they save no memory and cost time (docs/liger.md)
            config.use_liger_kernel = False
            if self.logprob_path is LogProbPath.LIGER:
                logger.info("use_liger_kernel=True on %s: Liger's fused linear cross-entropy computes the loss; its "
                            "model patches (RMSNorm, RoPE, SwiGLU) are applied on CUDA only.", config.device.type)
        no_pinning_without_accelerator(config)  # trainers/cpu_loader.py: pinning on CPU only warns
        self._offloader = None
        if config.activation_offloading:
            log_offloading_scope(logger)
        super().__init__(*args, **kwargs)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            leave_process_group_at_exit()  # no abort at interpreter exit (trainers/distributed.py)
        use_step_log_lines(self.callback_handler)  # trainers/step_logging.py: `step N/M | loss ...`
        self.tag_model()
        if self.logprob_path is LogProbPath.LIGER:
            self._note_liger_head()
        # TRL's attributes: a Mixture-of-Experts model whose config asks for router logits gets its load-balancing
        # loss added to the method's loss (see `normalise`)
        self.aux_loss_enabled, self.router_aux_loss_coef = router_loss_settings(self.model, config)
        self._router_loss = None
        self._check_context_parallelism()
        if config.memory_breakdown:
            self.add_callback(MemoryBreakdownCallback(self.args.device, self._record_memory_breakdown,
                                                      frozen_models=self.frozen_models))

    def _note_liger_head(self) -> None:
        """The one-line notice when the model's head keeps Liger from running (the chunked head runs instead)."""
        try:
            head = OutputHead.of(self.model, self.args.temperature if self.scores_at_temperature else 1.0)
        except ValueError:
            return
        problem = liger_head_problem(head, self.args.device.type)
        if problem is not None:
            logger.warning("Liger was asked for, but %s; using leantune's chunked loss instead (same memory saving, "
                           "exact).", problem)
        elif not per_target_gradients_supported():
            logger.warning("Liger was asked for, but %s.", OLD_LIGER)

    def note_router_loss(self, model, outputs) -> None:
        """Keep the router loss of a forward pass of the trained policy (not the reference, not a no-grad pass)."""
        aux = getattr(outputs, "aux_loss", None)
        if self.aux_loss_enabled and aux is not None and aux.requires_grad:
            self._router_loss = aux if self._router_loss is None else self._router_loss + aux

    def tag_model(self) -> None:
        """The Hub tags TRL's trainers put on the model (`trl`, the method) and leantune's own, so a pushed model is
        found by the same filters as one trained with TRL."""
        model = self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model
        if hasattr(model, "add_model_tags"):
            method = methods.of(self)
            model.add_model_tags(list(dict.fromkeys(["leantune", "trl", method.card_name, method.trl_tag])))

    # --- data: the train split and each eval split, prepared once by the trainer's own recipe --------------------

    def prepare_split(self, dataset, split: str, tokenizer, args):
        """(prepared dataset, report or None) of one split, by the trainer's recipe. Called before Trainer's own
        set-up (so it uses the `tokenizer` and `args` it is given, not `self.processing_class` / `self.args`)."""
        raise NotImplementedError

    def prepare_datasets(self, train_dataset, eval_dataset, tokenizer, args):
        """(train, eval, reports): `train_dataset` is required (as in TRL); `eval_dataset` is one dataset, or a dict
        / DatasetDict of named ones, each prepared (evaluation then reports `eval_<name>_...` per name). Any of them
        may be a stream (datasets.IterableDataset), prepared lazily (data/streaming.py); a streamed train split needs
        `max_steps`."""
        self.require_train_dataset(train_dataset)
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        streamed = any(map(is_stream, [train_dataset, *evals]))
        if streamed:
            use_own_stream_reads(args)
        if is_stream(train_dataset):
            require_max_steps(args)
        if streamed and getattr(args, "precompute_ref_log_probs", False):
            raise ValueError("`precompute_ref_log_probs` is not supported with IterableDataset (a stream): it reads "
                             "the whole dataset before training; turn it off, or pass a datasets.Dataset.")
        reports = {}
        train_dataset = self._prepare_and_remember(train_dataset, "train", tokenizer, args, reports)
        given = eval_dataset
        if isinstance(eval_dataset, dict):  # a DatasetDict is a dict too
            eval_dataset = {name: self._prepare_and_remember(data, f"eval_{name}", tokenizer, args, reports)
                            for name, data in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._prepare_and_remember(eval_dataset, "eval", tokenizer, args, reports)
        if self.keeps_eval_dataset_as_given and given is not None:
            pairs = given.items() if isinstance(given, dict) else [(None, given)]
            self._prepared_eval_splits = [(data, eval_dataset[name] if name is not None else eval_dataset)
                                          for name, data in pairs]
            eval_dataset = given
        return train_dataset, eval_dataset, reports

    def require_train_dataset(self, train_dataset) -> None:
        """TRL's trainers refuse to be built without a train dataset (no eval-only use); so do leantune's."""
        if train_dataset is None:
            raise ValueError(f"`train_dataset` is required by {type(self).__name__} (as by TRL's): pass the dataset "
                             "to train on, and `eval_dataset` for evaluation.")

    def skips_preparation(self, args) -> bool:
        """Whether the data is given trainer-ready (SFT's `dataset_kwargs={"skip_prepare_dataset": True}`)."""
        return False

    def _prepare_and_remember(self, dataset, split: str, tokenizer, args, reports: dict):
        if getattr(dataset, "_format_type", None) == "custom" and not self.skips_preparation(args):
            raise ValueError(f"The {split} dataset has a Dataset.with_transform() / set_transform() transform, which "
                             "runs when rows are read, after preparation would have tokenised them. Apply it with "
                             "dataset.map() instead, or pass dataset_kwargs={'skip_prepare_dataset': True} (SFT) with "
                             "a transform that returns trainer-ready rows (input_ids, labels).")
        dataset, report = self.prepare_split(dataset, split, tokenizer, args)
        if report is not None:
            reports[split] = report
        self.remember_prepared(dataset, report)
        return dataset

    def remember_prepared(self, dataset, report=None) -> None:
        if not hasattr(self, "_prepared_fingerprints"):
            self._prepared_fingerprints = set()
        if is_stream(dataset):  # no fingerprint: known by identity; its live report is logged as it is read
            self._prepared_fingerprints.add(id(dataset))
            if report is not None:
                self.stream_reports[id(dataset)] = report
            return
        fingerprint = getattr(dataset, "_fingerprint", None)
        if fingerprint is not None:
            self._prepared_fingerprints.add(fingerprint)

    def is_prepared(self, dataset) -> bool:
        """Whether `dataset` is already this trainer's prepared form: one it prepared (same fingerprint), or one
        holding all of the trainer's `prepared_columns`."""
        fingerprint = id(dataset) if is_stream(dataset) else getattr(dataset, "_fingerprint", None)
        if fingerprint is not None and fingerprint in getattr(self, "_prepared_fingerprints", ()):
            return True
        columns = set(getattr(dataset, "column_names", None) or ())
        return bool(self.prepared_columns) and set(self.prepared_columns) <= columns

    def finish_eval_split(self, dataset, split: str):
        """What an eval split passed to `evaluate` needs after preparation (e.g. precomputed reference log-probs)."""
        return dataset

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Trainer.evaluate on prepared data. A dataset passed here that is not prepared yet is prepared by the same
        recipe as the eval dataset; a dict / DatasetDict (passed or given at construction) is evaluated per name
        with metrics `<prefix>_<name>_...`; a str names one of the eval datasets given at construction."""
        if eval_dataset is None:
            eval_dataset = self.eval_dataset
            if eval_dataset is None:
                raise ValueError("evaluate() needs an eval_dataset: pass one here or to the trainer.")
        if isinstance(eval_dataset, dict):
            metrics = {}
            for name, dataset in eval_dataset.items():
                metrics.update(self.evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_dataset, dict) or eval_dataset not in self.eval_dataset:
                raise ValueError(f"evaluate({eval_dataset!r}): no eval dataset of that name was given to the trainer.")
            eval_dataset = self.eval_dataset[eval_dataset]
        prepared = next((ready for given, ready in getattr(self, "_prepared_eval_splits", ()) if given is eval_dataset),
                        None)
        if prepared is not None:
            eval_dataset = prepared
        elif not self.is_prepared(eval_dataset):
            if is_stream(eval_dataset):  # the accelerator exists already: it must not dispatch this stream either
                use_own_stream_reads(self.args)
                self.accelerator.dataloader_config.dispatch_batches = False
            eval_dataset, report = self.prepare_split(eval_dataset, metric_key_prefix, self.processing_class,
                                                      self.args)
            if report is not None:
                self.data_reports[metric_key_prefix] = report
            self.remember_prepared(eval_dataset, report)
            eval_dataset = self.finish_eval_split(eval_dataset, metric_key_prefix)
        stream_report = self.stream_reports.get(id(eval_dataset)) if is_stream(eval_dataset) else None
        if stream_report is not None:
            reset_counts(stream_report)  # an evaluation reads the stream from its start: count that pass
        previous, self._metric_prefix = self._metric_prefix, metric_key_prefix
        try:
            return self.evaluate_prepared(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._metric_prefix = previous
            if stream_report is not None and self.is_world_process_zero():
                log_stream_report(stream_report)

    def get_eval_dataloader(self, eval_dataset=None):
        """A streamed eval set is read by this process alone (its counts stay here); a map-style train set keeps
        its `dataloader_num_workers`: the override is scoped to this loader."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str) and isinstance(self.eval_dataset, dict):
            dataset = self.eval_dataset[dataset]
        if not is_stream(dataset) or not self.args.dataloader_num_workers:
            return super().get_eval_dataloader(eval_dataset)
        workers, self.args.dataloader_num_workers = self.args.dataloader_num_workers, 0
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.args.dataloader_num_workers = workers

    @property
    def stream_reports(self) -> dict:
        """Live reports of the streamed splits, by id of the prepared stream: counts of the rows read so far."""
        if "_stream_reports" not in self.__dict__:
            self._stream_reports = {}
        return self._stream_reports

    def evaluate_prepared(self, eval_dataset, ignore_keys, metric_key_prefix: str):
        """Evaluate one prepared dataset (Trainer's evaluation loop; the online trainers generate instead)."""
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            # and the row index that training's loader carries to the NaN/inf checks (trainers/nonfinite.py)
            self._signature_columns = [*self.dataset_columns, ROW_INDEX]

    # --- loss normalisation over the whole optimizer step -------------------------------------------------------

    def items_in(self, batch: dict) -> torch.Tensor:
        """What the loss is averaged over, in one collated batch: target tokens (pairs for preference losses)."""
        return count_targets(batch["labels"])

    def _get_num_items_in_batch(self, batch_samples: list, device):
        count = sum((self.items_in(b) for b in batch_samples if "labels" in b), torch.tensor(0))
        count = torch.as_tensor(count).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
            # every process of a context-parallel group counted the same whole batch (before it is split)
            count = count // self.cp_size
        return count

    def normalise(self, loss_sum: torch.Tensor, local_count, num_items_in_batch) -> torch.Tensor:
        """Divide a summed loss by the optimizer step's item count (the batch's own count outside training), and add
        the MoE router loss of this micro-batch's policy forwards (every trainer's loss ends here)."""
        local_count = torch.as_tensor(local_count, device=loss_sum.device)
        if (num_items_in_batch is None or not self.model.training) and self.cp_size > 1:
            # this process holds part of the batch: its share of the batch's mean, so that the mean over the
            # context-parallel group (evaluation averages the processes' losses) is the batch's mean
            whole = torch.as_tensor(self._cp_batch_targets, device=loss_sum.device).clamp(min=1)
            return self._plus_router_loss(loss_sum * self.cp_size / whole)
        if num_items_in_batch is None or not self.model.training:
            return self._plus_router_loss(loss_sum / local_count.clamp(min=1))
        loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            loss = loss * self.args.world_size  # DDP averages gradients over processes
        return self._plus_router_loss(loss)

    def _plus_router_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """router_aux_loss_coef x the noted router loss (divided by the accumulation steps in training, where each
        micro-batch's loss is its share of the step), logged as aux_loss."""
        aux, self._router_loss = self._router_loss, None
        if aux is None:
            return loss
        steps = getattr(self, "current_gradient_accumulation_steps", 1) if self.model.training else 1
        self.record_metrics(self.model, aux_loss=aux.detach().float().reshape(1))
        return loss + self.router_aux_loss_coef * aux.to(loss.dtype) / steps

    def count_tokens(self, model, inputs: dict) -> None:
        real = inputs.pop("num_real_tokens", None)
        if model.training and real is not None:
            self.throughput.add(int(real), int(inputs["input_ids"].numel()))

    # --- the memory engine: where log-probabilities come from, and offloading around the forward pass ----------

    def offloading_scope(self, model):
        """Saved activations of the forward pass go to CPU memory (one offloader, reused: it keeps its streams)."""
        args = self.args
        if not (args.activation_offloading and model.training and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        if self._offloader is None:
            self._offloader = offloading.offloading_context(
                True,
                model,
                min_offload_bytes=args.activation_offloading_min_bytes,
                use_streams=args.activation_offloading_use_streams,
            )
        return self._offloader

    def _needs_full_logits(self, model) -> bool:
        if self.logprob_path is LogProbPath.FULL:
            return True
        evaluating_with_metrics = self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None
        return not model.training and evaluating_with_metrics

    def _forward_hidden(self, model, inputs: dict, head: OutputHead):
        with self.offloading_scope(model), head.capture_hidden_states(head_follows=True) as captured:
            outputs = model(**inputs, use_cache=False)
        outputs.logits = None
        self.note_router_loss(model, outputs)
        return captured["hidden"], outputs

    def target_logprobs(self, model, inputs: dict, labels: torch.Tensor, temperature: float = 1.0,
                        with_entropy: bool = False, entropy_grad: bool = False, stats: tuple[str, ...] = (),
                        shifted: bool = False, with_hidden: bool = False) -> TargetScores:
        scores = self._target_logprobs(model, inputs, labels, temperature, with_entropy, entropy_grad, stats, shifted,
                                       with_hidden)
        if with_hidden:
            scores.hidden = scores.hidden.reshape(-1, scores.hidden.shape[-1]).index_select(0, scores.targets.index)
        else:
            scores.hidden = None  # not held past the loss that did not ask for it
        return scores

    def _target_logprobs(self, model, inputs: dict, labels: torch.Tensor, temperature: float, with_entropy: bool,
                         entropy_grad: bool, stats: tuple[str, ...], shifted: bool, with_hidden: bool) -> TargetScores:
        """The targets' fp32 log-probs (with entropies and the named `stats` of losses/token_logprobs.py's
        TOKEN_STATS when asked for) by the configured path: full logits, the chunked head or Liger. The entropies
        carry a gradient only with `entropy_grad` (an entropy bonus in the loss). `shifted`: `labels` already hold
        each position's next token (context parallelism's `shift_labels`). `with_hidden`: also the last hidden states
        at the target positions (`TargetScores.hidden`, what PPO's value head reads), on every path."""
        targets = select_targets(labels, shifted)
        if self._needs_full_logits(model):
            kept = {}
            hook = OutputHead.of(model).module.register_forward_pre_hook(
                lambda module, args: kept.__setitem__("hidden", args[0])) if with_hidden else None
            try:
                with self.offloading_scope(model):
                    outputs = model(**inputs, use_cache=False)
            finally:
                if hook is not None:
                    hook.remove()
            self.note_router_loss(model, outputs)
            scores = TargetScores(logprobs_from_logits(outputs.logits, targets, temperature), targets, outputs,
                                  hidden=kept.get("hidden"))
            if with_entropy:
                scores.entropy = _entropy_from_logits(outputs.logits, targets, temperature, entropy_grad)
            if stats:
                flat = outputs.logits.reshape(-1, outputs.logits.shape[-1]).index_select(0, targets.index)
                scores.stats = dict(zip(stats, token_stats_from_logits(flat / temperature, targets.tokens, stats)))
            return scores
        head = OutputHead.of(model, temperature)
        hidden, outputs = self._forward_hidden(model, inputs, head)
        liger = self.liger_scores(head, with_entropy, stats) and len(targets)
        trains = torch.is_grad_enabled() and (hidden.requires_grad or bool(head.trainable_parameters))
        if liger and (not trains or per_target_gradients_supported()):
            result = liger_target_logprobs(hidden, head, targets, with_top1=bool(stats))
            if stats:
                return TargetScores(result[0], targets, outputs, stats={"top1": result[1]}, hidden=hidden)
            return TargetScores(result, targets, outputs, hidden=hidden)
        result = chunked_logprobs(hidden, head, targets, self.args.loss_chunk_size, with_entropy, entropy_grad,
                                  stats)
        if not (with_entropy or stats):
            return TargetScores(result, targets, outputs, hidden=hidden)
        logps, *extra = result
        entropy = extra.pop(0) if with_entropy else None
        return TargetScores(logps, targets, outputs, entropy, dict(zip(stats, extra)), hidden=hidden)

    def liger_scores(self, head: OutputHead, with_entropy: bool = False, stats: tuple[str, ...] = ()) -> bool:
        """Whether Liger's fused kernel gives these per-target values: it yields each target's log-prob and whether
        the target is the argmax (`top1`), nothing else (no entropies, no other statistics: those batches take the
        chunked head, as the trainers say when they start)."""
        return (self.logprob_path is LogProbPath.LIGER and liger_can_run(head, self.args.device.type)
                and not with_entropy and set(stats) <= {"top1"} and len(stats) <= 1)

    def liger_head_runs(self, model, temperature: float = 1.0) -> bool:
        """Whether this forward pass's target log-probs come from Liger's fused kernel (per target), which computes
        no entropies: a trainer asks for the entropy metric only where it comes free (the chunked or full path)."""
        return not self._needs_full_logits(model) and self.liger_scores(OutputHead.of(model, temperature))

    def fused_nll_runs(self, model) -> bool:
        """Whether the summed NLL comes from Liger's summing kernel (its gradient formed in the forward pass, no
        per-token values). CUDA only: its backward scales the weight gradient one vocabulary row per Triton program,
        which Triton's CPU interpreter runs one at a time (measured ~70 s per step at a 32000 vocabulary, against
        ~1 s for the per-target kernel), so on CPU the per-target kernel computes the NLL."""
        return self.args.device.type == "cuda" and self.liger_head_runs(model)

    def target_nll_sum(self, model, inputs: dict, labels: torch.Tensor, shifted: bool = False):
        """(summed next-token NLL of the targets, their top-1 accuracy or None, Targets, model outputs): Liger's
        fused kernel where it runs, else -sum(target_logprobs)."""
        if self.fused_nll_runs(model):
            head = OutputHead.of(model)
            targets = select_targets(labels, shifted)
            hidden, outputs = self._forward_hidden(model, inputs, head)
            if len(targets):
                return (*liger_nll_sum(hidden, head, targets), targets, outputs)
            return -chunked_logprobs(hidden, head, targets, self.args.loss_chunk_size).sum(), None, targets, outputs
        scores = self.target_logprobs(model, inputs, labels, shifted=shifted)
        return -scores.logps.sum(), None, scores.targets, scores.outputs

    # --- saving: the output folder says what it holds (README.md, models/model_card.py) --------------------------

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Trainer's save (final save_model and every checkpoint), then the model card on the writing process. A
        README.md that is not leantune's (checked before PEFT writes its own template) is left as it is."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        card = self.args.should_save and model_card.may_write(output_dir)
        if state_dict is not None:
            state_dict = without_tied_copies(self.accelerator.unwrap_model(self.model), state_dict)
        super()._save(output_dir, state_dict=state_dict)
        if card:
            try:
                model_card.write_model_card(self, output_dir)
            except Exception as error:  # the weights are saved; a card that cannot be written must not end the run
                logger.warning("Could not write the model card README.md in %s: %s", output_dir, error)
        elif self.args.should_save:
            logger.info("%s already has a README.md not written by leantune: left as it is.", output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' checkpoint, written into `tmp-checkpoint-N/checkpoint-N` with the trainer's own state
        (`save_extra_state`), fsynced and renamed to `checkpoint-N` only when whole (checkpoint_files.py); then the
        rotation of --save_total_limit. A write that fails for want of space removes the staging folder and raises
        NoRoomError, the last complete checkpoint untouched."""
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        staging_root = checkpoint_files.staging_folder(run_dir, step)
        staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        if self.args.should_save:
            checkpoint_files.remove_tree(staging_root)  # a save of this step that a kill cut short
            os.makedirs(staged)
        self.accelerator.wait_for_everyone()
        # rotation and a push to the Hub (an upload that runs on in the background) come after the rename
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        push, self.args.push_to_hub = self.args.push_to_hub, False
        self._get_output_dir = lambda trial=None: staging_root
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every process's files (rng_state_<i>.pth) are in
            if self.args.should_save:
                self._point_best_checkpoint_at(run_dir, staged)
                self.save_extra_state(staged)
                checkpoint_files.publish(staged, final)
                checkpoint_files.remove_tree(staging_root)
        except Exception as error:
            if not (self.args.should_save and checkpoint_files.is_no_room(error, run_dir)):
                if self.args.should_save:  # a save that failed leaves nothing behind (non-finite weights, ...)
                    checkpoint_files.remove_tree(staging_root)
                raise
            written = checkpoint_files.folder_bytes(staging_root)
            checkpoint_files.remove_tree(staging_root)
            earlier = [checkpoint_files.folder_bytes(os.path.join(run_dir, entry)) for entry in os.listdir(run_dir)
                       if entry.startswith(f"{PREFIX_CHECKPOINT_DIR}-")]
            raise checkpoint_files.no_room_error(run_dir, max([written, *earlier]), f"checkpoint-{step}") from error
        finally:
            del self._get_output_dir
            self.args.save_total_limit, self.args.push_to_hub = save_total_limit, push
        self.accelerator.wait_for_everyone()
        if push:
            self._push_from_checkpoint(final)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _point_best_checkpoint_at(self, run_dir: str, staged: str) -> None:
        """transformers looked for the best checkpoint beside the staged one: the state names its final folder."""
        best = self.state.best_global_step
        if not best:
            return
        path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
        if best == self.state.global_step or os.path.isdir(path):
            self.state.best_model_checkpoint = path
            self.state.save_to_json(os.path.join(staged, "trainer_state.json"))

    def save_extra_state(self, folder: str) -> None:
        """The trainer's own state beyond transformers' (GRPO's adaptive entropy coefficient, ...), written into the
        staged checkpoint folder before it is renamed: a checkpoint holds it or does not exist."""

    def create_model_card(self, tags=None, **kwargs) -> None:
        """push_to_hub's card: leantune's (what the folder holds and how to load it), with the caller's tags and
        language / license / datasets metadata, in place of transformers' generic one."""
        if self.is_world_process_zero():
            dataset = kwargs.get("dataset_tags") or kwargs.get("dataset")
            metadata = {"language": kwargs.get("language"), "license": kwargs.get("license"), "datasets": dataset}
            model_card.write_model_card(self, self.args.output_dir, extra_tags=tags, metadata=metadata)

    # --- metrics ------------------------------------------------------------------------------------------------

    def train(self, *args, **kwargs):
        if getattr(self.args, "plan_check", False):
            from ..planning.plan_check import check_before_training

            self.memory_plan = check_before_training(self)  # planning/plan_check.py: training itself is unchanged
        if args and "resume_from_checkpoint" not in kwargs:
            kwargs["resume_from_checkpoint"], args = args[0], args[1:]
        if kwargs.get("resume_from_checkpoint") is True:  # the newest complete one, incomplete entries named
            kwargs["resume_from_checkpoint"] = checkpoint_files.latest_complete_checkpoint(self.args.output_dir)
            if kwargs["resume_from_checkpoint"] is None:
                raise ValueError(f"`resume_from_checkpoint`=True: no complete checkpoint (checkpoint-N with a "
                                 f"trainer_state.json) in {self.args.output_dir}.")
        reset_peak_memory(self.args.device)
        self.throughput.restart()
        with named_collective_timeouts(self.args):  # a stuck or dead process: one clear error (distributed.py)
            output = super().train(*args, **kwargs)
        resumed = bool(kwargs.get("resume_from_checkpoint"))
        self._trained_nothing = (resumed and self.state.global_step == getattr(self, "_initial_global_step", -1)
                                 and self.state.global_step >= self.state.max_steps)
        if self._trained_nothing and self.is_world_process_zero():
            logger.warning("Nothing to train: the checkpoint is at step %d of max_steps %d (the run is done); raise "
                           "max_steps (or num_train_epochs) to train further.", self.state.global_step,
                           self.state.max_steps)
        train_report = self.stream_reports.get(id(self.train_dataset))
        if train_report is not None and self.is_world_process_zero():
            log_stream_report(train_report)
        summary = self.training_summary()
        output.metrics.update(summary)
        self.log_metrics("train", summary)
        if self.memory_breakdown is not None and self.is_world_process_zero():
            logger.info(self.memory_breakdown.line())
        return output

    def _run_epoch(self, *args, **kwargs):
        """An epoch of transformers' loop, none once `max_steps` optimizer steps are done: transformers checks the
        limit only after a step, so a run resumed from its last checkpoint would train one step more."""
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    @property
    def trained_nothing(self) -> bool:
        """Whether the last train() resumed a checkpoint already at max_steps (or its epochs' end) and trained no
        step."""
        return getattr(self, "_trained_nothing", False)

    def frozen_models(self) -> list[torch.nn.Module]:
        """The models this trainer holds and runs without training (a reference copy, reward models, a teacher):
        their weights are resident through every step, a part of the memory breakdown of their own."""
        return []

    def _record_memory_breakdown(self, breakdown: MemoryBreakdown) -> None:
        self.memory_breakdown = breakdown

    def training_summary(self) -> dict:
        summary = {
            "real_tokens": self.throughput.real_tokens,
            "real_tokens_per_second": round(self.throughput.overall_rate(), 2),
            "padding_fraction": round(self.throughput.padding_fraction, 4),
            "peak_memory_mb": round(peak_memory_bytes(self.args.device) / MIB, 1),
            "peak_memory_kind": memory_kind(self.args.device),
        }
        if self.memory_breakdown is not None:
            summary.update(self.memory_breakdown.as_metrics())
        summary.update(self.nonfinite_summary())
        return summary

    def record_metrics(self, model, **values: torch.Tensor) -> None:
        """Keep per-example values (1-D tensors of equal length) of this step, gathered across processes."""
        names = list(values)
        stacked = torch.stack([values[name].detach().float() for name in names]).T.contiguous()
        gathered = self.accelerator.gather_for_metrics(stacked)
        store = self.metric_values["train" if model.training else "eval"]
        for name, column in zip(names, gathered.T):
            store[name].extend(column.tolist())

    def summarise_metrics(self, store: dict[str, list[float]]) -> dict[str, float]:
        """The logged form of the stored values: their means, NaN (nothing measured) left out."""
        summary = {}
        for name, values in store.items():
            values = [v for v in values if v == v]
            if values:
                summary[name] = round(sum(values) / len(values), 6)
        return summary

    def log(self, logs: dict, start_time: float | None = None) -> None:
        # A training step's log, or the run's closing summary (which takes the values since the last step's log)
        mode = "train" if "loss" in logs or "train_loss" in logs else "eval"
        prefix = f"{self._metric_prefix}_" if mode == "eval" else ""
        store = self.metric_values[mode]
        if store:
            logs.update({f"{prefix}{name}": value for name, value in self.summarise_metrics(store).items()})
            store.clear()
        self.mark_skipped_in_log(logs)  # trainers/nonfinite.py: a skipped step's window never logs a normal loss
        if self.model is not None and self.model.training and "loss" in logs:
            logs["real_tokens_per_second"] = round(self.throughput.window_rate(), 2)
            logs["padding_fraction"] = round(self.throughput.padding_fraction, 4)
            logs["peak_memory_mb"] = round(peak_memory_bytes(self.args.device) / MIB, 1)
        super().log(logs, start_time)


def router_loss_settings(model, args) -> tuple[bool, float]:
    """(whether the MoE router loss is added, its weight): on when the model's config has output_router_logits=True
    (TRL's rule); the weight is `router_aux_loss_coef`, else the config's own."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        return False, 0.0
    enabled = bool(getattr(config, "output_router_logits", False))
    coef = getattr(args, "router_aux_loss_coef", None)
    if coef is None:
        coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    return enabled, float(coef)


def _entropy_from_logits(logits: torch.Tensor, targets: Targets, temperature: float,
                         grad: bool = False) -> torch.Tensor:
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, targets.index).float() / temperature
        return torch.logsumexp(flat, -1) - (torch.softmax(flat, -1) * flat).sum(-1)


def without_tied_copies(model, state_dict: dict) -> dict:
    """A gathered full state dict (FSDP2, ZeRO-3) holds a tied output head as its own tensor, which transformers
    would write as a second vocabulary-sized matrix: the tied key is dropped when it equals the input embedding."""
    base = unwrap_model(model)
    config = text_config_of(base)
    if not getattr(config, "tie_word_embeddings", False):
        return state_dict
    embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
    if embeddings is None or head is None:
        return state_dict
    names = {id(module): name for name, module in model.named_modules()}
    embedding_key, head_key = f"{names.get(id(embeddings))}.weight", f"{names.get(id(head))}.weight"
    if (embedding_key in state_dict and head_key in state_dict and head_key != embedding_key
            and torch.equal(state_dict[embedding_key], state_dict[head_key])):
        state_dict = {k: v for k, v in state_dict.items() if k != head_key}
    return state_dict
