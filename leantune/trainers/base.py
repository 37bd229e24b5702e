"""What every leantune trainer shares on top of transformers' Trainer: one construction sequence, and the parts it
holds (trainers/parts/): the resolved config, the split preparer, the log-prob engine, the run metrics
(metrics/run_metrics.py) and the staged checkpoints, plus context parallelism, the reference (trainers/reference.py:
none held but for DPO, KTO and the online methods) and the non-finite guard (trainers/parts/step_guards.py), which
Trainer's step hooks below call in one line each. The step's loss normaliser (`StepLoss`, at the end) is here, beside
the trainer that counts the step's items and whose every loss ends in it.

A method's trainer says what is its own (its models, its recipe for a split, its collator, its loss) and reads as
config -> parts -> loss.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import RemoveColumnsCollator
from transformers.utils import logging as transformers_logging

from .. import methods
from ..data.streaming import is_stream, log_stream_report, reset_counts
from ..memory.checkpoint_offload import offload_checkpoints
from ..memory.tiled_mlp import tile_mlps
from ..metrics.memory_breakdown import MemoryBreakdownCallback
from ..metrics.run_metrics import RunMetrics
from ..models.output_head import unwrap_model
from ..planning.checkpoint_offload_plan import refuse_run_before_loading
from ..planning.plan_check import check_before_training
from ..planning.self_sizing import fit_to_budget
from .method_hooks import MethodHooks
from .online.round_parts import RoundParts
from .parts.batches import kept_columns
from .parts.context_parallel import ContextParallelism
from .parts.distributed import leave_process_group_at_exit, named_collective_timeouts
from .parts.frozen_models import prepare_frozen_model
from .parts.logprob_engine import LogProbEngine, engine_head_kind
from .parts.optimizer_in_backward import OptimizerInBackward
from .parts.resolved_config import resolve_config
from .parts.saving import (
    StagedCheckpoint,
    agreed_resume_checkpoint,
    save_final_model,
    tag_model,
    write_hub_card,
)
from .parts.split_preparer import SplitPreparer
from .parts.step_guards import GradientCheck, NonFiniteGuard, OutOfMemoryRetry
from .reference import Reference
from .run_bounds import RunBounds, report_run_end
from .settings import checkpoint_offload_of, layout_of, optimizer_in_backward_of, resolve_settings, tiled_mlp_of
from .step_logging import use_step_log_lines
from .trainer_attributes import TrainerAttributes


class LeantuneTrainer(MethodHooks, TrainerAttributes, Trainer):
    """A transformers Trainer holding leantune's parts; what a method says about itself is in `MethodHooks`
    (method_hooks.py), what is read from it from outside in `TrainerAttributes` (trainer_attributes.py). The private
    methods of transformers' Trainer it overrides or calls are docs/transformers_seam.md's, no other."""

    # compute_loss divides by the target count of the whole step, so the Trainer must not divide again.
    loss_is_scaled_for_ga = True
    # The key prefix of the evaluation running now ("eval", or "eval_<name>" for one of several eval datasets).
    _metric_prefix = "eval"

    # --- construction: one sequence for every trainer -----------------------------------------------------------

    def construct(self, model, args, train_dataset, eval_dataset, processing_class, data_collator, *,
                  peft_config=None, quantization_config=None, ref_model=None, **trainer_kwargs):
        """default args -> the resolved config -> models and tokenizer (`load_models`) -> each split prepared by the
        method's recipe (`prepare_split`) -> the collator -> Trainer's set-up -> the parts -> the reference placed.
        Returns what `load_models` loaded."""
        args = self.default_args(model, args)
        self.memory_budget_fit = None  # planning/self_sizing.py: what `memory_budget` planned and changed
        if getattr(args, "memory_budget", None) is not None:  # before any weight loads: the run sized to its budget
            args, self.memory_budget_fit = fit_to_budget(type(self), model, args, train_dataset, processing_class,
                                                         peft_config, **self.frozen_model_sources())
        args, logprob_path = resolve_config(type(self).__name__, args, train_dataset, eval_dataset,
                                            self.scores_vocabulary)
        self.layout = layout_of(args)  # before the models load: loading reads it (trainers/settings.py)
        refuse_run_before_loading(type(self), model, args, peft_config)  # offloads the host cannot hold
        loaded = self.load_models(model, ref_model, processing_class, peft_config, args, quantization_config)
        self.splits = SplitPreparer(self.prepare_split, self.prepared_columns, self.stream_order,
                                    self.skips_preparation(args))
        train_dataset, eval_dataset = self.splits.prepare(train_dataset, eval_dataset, loaded.tokenizer, args,
                                                          keep_eval_as_given=self.keeps_eval_dataset_as_given)
        if data_collator is None:
            data_collator = self.make_collator(loaded.tokenizer, args, train_dataset)
        Trainer.__init__(self, model=loaded.model, args=args, data_collator=data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=loaded.tokenizer,
                         **trainer_kwargs)
        self._signature_columns = kept_columns(self)  # what Trainer keeps of a dataset for the collator
        self.optimizer_in_backward = OptimizerInBackward(optimizer_in_backward_of(args), self.accelerator)
        self.run_bounds = None  # run_bounds.py: a resumed train()'s start and end (train() adds it when resuming)
        # step_guards.py: each step's NaN/inf check before the optimizer, ahead of every other callback
        self.callback_handler.callbacks.insert(0, GradientCheck(
            self.accelerator, lambda model, grad_norm: self.nonfinite.check_step(model, grad_norm)))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            leave_process_group_at_exit(self.release_parallel_wrappers)  # no abort at exit (parts/distributed.py)
        # a collective that timed out, named (trainers/parts/distributed.py); one process runs no collective
        self.collective_timeouts = (functools.partial(named_collective_timeouts, args) if args.world_size > 1
                                    else contextlib.nullcontext)
        use_step_log_lines(self.callback_handler)  # trainers/step_logging.py: `step N/M | loss ...`
        self.trained_nothing = False
        self.settings = resolve_settings(args, self.generates_rounds, self.layout)  # each part's own (trainers/settings.py)
        tile_mlps(self.model, tiled_mlp_of(args))  # memory/tiled_mlp.py: off unless `tiled_mlp`
        offload_checkpoints(self.model, checkpoint_offload_of(args))  # memory/checkpoint_offload.py: off unless set
        self.nonfinite = NonFiniteGuard(self.settings.nonfinite, self.accelerator, self.is_world_process_zero,
                                        lambda: self.state.global_step)
        tag_model(self)  # the Hub tags of TRL's trainer of the method (parts/saving.py)
        self.context_parallel = ContextParallelism(self.accelerator)
        self.run_metrics = RunMetrics(self.accelerator, self.settings.device, self.context_parallel.size,
                                      lambda store: self.summarise_metrics(store))
        self.context_parallel.check(type(self).__name__, self.context_parallel_loss is not None, self.model,
                                    self.compute_loss_func, self.layout.pad_to_multiple_of,
                                    self.context_parallel_problem(args))
        # `accumulation`: the micro-batches a step's loss is spread over (read where an MoE router loss is added):
        # gradient accumulation's, each in parts after an out-of-memory retry
        self.step_loss = StepLoss(self.settings.step_loss, self.accelerator, self.context_parallel, self.model,
                                  self.items_in, self.run_metrics.record, accumulation=lambda: getattr(
                                      self, "current_gradient_accumulation_steps", 1) * self.oom_retry.parts)
        # the temperature the trainer's log-probs are of: the sampling one (GRPO, RLOO, PPO), else 1
        self.scoring_temperature = args.temperature if self.scores_at_temperature else 1.0
        # a model without an MoE router loss to add (a dense one) notes nothing after its forward passes
        self.logprobs = LogProbEngine(
            self.settings.head, logprob_path, lambda: self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None,
            self.step_loss.note_router_loss if self.step_loss.router_loss_enabled else None, self.scoring_temperature,
            engine_head_kind(self.accelerator))
        self.logprobs.announce(self.model, self.liger_notes(args))
        if args.memory_breakdown:
            self.add_callback(MemoryBreakdownCallback(args.device, self.run_metrics.keep_memory_breakdown,
                                                      frozen_models=self.frozen_models))
        self.reference = Reference(loaded, self.settings.reference,  # placed for the engine (frozen_models.py)
                                   prepare_frozen_model(self.accelerator, loaded.ref_model, args))
        if self.scores_vocabulary:  # the heads found once, here, not in the first step (a reward model has none)
            for scored in (self.model, self.reference.model):
                if scored is not None:
                    self.logprobs.head_of(scored, self.scoring_temperature)
        self.oom_retry = OutOfMemoryRetry(self.settings.batch, self.accelerator, self.is_world_process_zero, self.step_state,
                                          self.run_metrics.mark, RoundParts(self) if self.generates_rounds else None)
        return loaded

    # --- evaluation: several eval sets, streams read by this process ---------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Trainer.evaluate on prepared data. A dataset passed here that is not prepared yet is prepared by the same
        recipe as the eval dataset; a dict / DatasetDict (passed or given at construction) is evaluated per name
        with metrics `<prefix>_<name>_...`; a str names one of the eval datasets given at construction."""
        self.reference.precompute(self)  # evaluating before training must find the reference log-probs too
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
        eval_dataset = self.splits.for_evaluation(eval_dataset, metric_key_prefix, self)
        stream_report = self.splits.stream_report_of(eval_dataset)
        if stream_report is not None:
            reset_counts(stream_report)  # an evaluation reads the stream from its start: count that pass
        previous, self._metric_prefix = self._metric_prefix, metric_key_prefix
        try:
            return self.evaluate_prepared(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._metric_prefix = previous
            if stream_report is not None and self.is_world_process_zero():
                log_stream_report(stream_report)

    def evaluate_prepared(self, eval_dataset, ignore_keys, metric_key_prefix: str):
        """Evaluate one prepared dataset (Trainer's evaluation loop; the online trainers generate instead)."""
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def get_eval_dataloader(self, eval_dataset=None):
        """A streamed eval set is read by this process alone, without worker processes (its counts stay here); a
        map-style train set keeps its `dataloader_num_workers`."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str) and isinstance(self.eval_dataset, dict):
            dataset = self.eval_dataset[dataset]
        if not is_stream(dataset) or not self.args.dataloader_num_workers:
            return super().get_eval_dataloader(eval_dataset)
        collator = self.data_collator
        if self.args.remove_unused_columns:  # as Trainer's own loader: the columns it keeps (parts/batches.py)
            collator = RemoveColumnsCollator(collator, kept_columns(self), transformers_logging.get_logger(
                "transformers.trainer"), self.model.__class__.__name__, "Evaluation")
        return self.accelerator.prepare(DataLoader(dataset, self.args.eval_batch_size, collate_fn=collator,
                                                   pin_memory=self.args.dataloader_pin_memory))

    def get_train_dataloader(self):
        build = super().get_train_dataloader
        return self.nonfinite.train_loader(self, lambda: self.oom_retry.train_loader(self, build))

    # --- the step: its items counted by the loss normaliser, batches laid out for context parallelism ------------

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The step's micro-batches as trained on and their item count over all processes (`StepLoss`); none
        once a resumed run's max_steps are done, which transformers checks only after a step (run_bounds.py)."""
        if self.run_bounds is not None and self.run_bounds.start_step is not None \
                and self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return [], None
        batches = self.trained_batches(list(itertools.islice(epoch_iterator, num_batches)))
        return batches, self.step_loss.count(batches, device)

    @property
    def generates_rounds(self) -> bool:
        """Whether the micro-batches come from generation rounds (the online methods), not from the train loader."""
        method = methods.METHODS.get(self.method)
        return method is not None and method.online

    @property
    def context_parallel_loss(self) -> str | None:
        """How the method's loss runs under context parallelism (its entry in leantune/methods.py; None: refused).
        With per-sequence sums each target's sequence travels with it through the split and those sums are made
        whole over the group (trainers/parts/context_parallel.py)."""
        method = methods.METHODS.get(self.method)
        return method.context_parallel if method is not None else None

    def _prepare_context_parallel_inputs(self, model, inputs):
        """transformers' seam (docs/transformers_seam.md): the batch laid out for the ring by leantune, in place of
        transformers' own layout, with accelerate's context manager that splits it; without a ring, as it is."""
        if self.context_parallel.size == 1:
            return contextlib.nullcontext, inputs
        return self.context_parallel.lay_out(inputs, getattr(self.data_collator, "pad_token_id", None),
                                             per_sequence=self.context_parallel_loss == methods.SEQUENCE_SUMS)

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = super().training_step
        return self.oom_retry.training_step(  # parts/step_guards.py: out of memory -> half the micro-batch
            lambda *arguments: self.nonfinite.training_step(step, *arguments), model, inputs, num_items_in_batch)

    def create_optimizer(self, model=None):
        """Trainer's optimizer, or one per parameter stepped inside the backward (parts/optimizer_in_backward.py)."""
        built = super().create_optimizer(model)
        if not self.optimizer_in_backward.settings.enabled:
            return built
        cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model or self.model)
        self.optimizer = self.optimizer_in_backward.install(built, cls, kwargs)
        return self.optimizer

    def step_state(self):
        """A callable that puts the parts' records of the step so far back (an attempt that ran out of memory)."""
        back = [self.run_metrics.mark(), self.nonfinite.mark(), self.step_loss.drop_router_loss,
                self.optimizer_in_backward.mark()]
        return lambda: [restore() for restore in back]

    # --- saving: staged checkpoints, each saved folder with its model card (parts/saving.py) ----------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # staged and moved in, with its card and without the Hub token (parts/saving.py)
        save_final_model(self, output_dir, _internal_call, super().save_model)

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' seam (docs/transformers_seam.md): Trainer's checkpoint written into a staging folder, fsynced
        and renamed when whole (parts/saving.py), and only of finite weights (step_guards.py)."""
        checkpoint = StagedCheckpoint(self)
        checkpoint.save(model, trial, self.nonfinite.finite_weights_saved(super()._save_checkpoint))

    def create_model_card(self, tags=None, **kwargs) -> None:
        write_hub_card(self, tags, **kwargs)

    # --- training and its metrics (metrics/run_metrics.py) ------------------------------------------------------

    def train(self, *args, **kwargs):
        if self.reference.works_before_training:
            self.reference.before_training(self)  # precomputed log-probs, TR-DPO's sync
        if getattr(self.args, "plan_check", False):
            self.memory_plan = check_before_training(self)  # planning/plan_check.py: training itself is unchanged
        if args and "resume_from_checkpoint" not in kwargs:
            kwargs["resume_from_checkpoint"], args = args[0], args[1:]
        if self.run_bounds is not None:  # a previous train()'s
            self.remove_callback(self.run_bounds)
            self.run_bounds = None
        # Every process takes process 0's checkpoint, or all stop. With several processes each one joins the
        # agreement, resuming or not: a process that found no checkpoint must still hear process 0's choice.
        if kwargs.get("resume_from_checkpoint") or self.args.world_size > 1:
            with self.collective_timeouts():
                resume = agreed_resume_checkpoint(kwargs.get("resume_from_checkpoint"), self.args)
            kwargs["resume_from_checkpoint"] = resume
            if resume:
                self.run_bounds = RunBounds(self.load_extra_state, resume)
                self.add_callback(self.run_bounds)
        self.run_metrics.restart()
        with self.collective_timeouts(), self.nonfinite.training_run():  # distributed.py, step_guards.py
            output = super().train(*args, **kwargs)
        return report_run_end(self, output)

    def training_summary(self) -> dict:
        return {**self.run_metrics.summary(), **self.nonfinite.summary()}

    def release_parallel_wrappers(self) -> None:
        """At interpreter exit (parts/distributed.py): the DDP wrapper's reducer holds the process group, so it goes
        before the group is destroyed; the unwrapped model stays."""
        self.model_wrapped = self.model
        self.accelerator.free_memory()  # accelerate's own release of what it prepared

    def log(self, logs: dict, start_time: float | None = None) -> None:
        # A training step's log, or the run's closing summary (which takes the values since the last step's log)
        self.run_metrics.add_method_values(logs, self._metric_prefix)
        self.nonfinite.mark_skipped_in_log(logs)  # a skipped step's window never logs a normal loss
        if self.model is not None and self.model.training and "loss" in logs:
            self.run_metrics.add_step_values(logs)
        super().log(logs, start_time)


class StepLoss:
    """The loss of an optimizer step, every trainer's: the mean over the real items (target tokens, pairs, examples) of
    that whole step. Every micro-batch of gradient accumulation and, with `average_tokens_across_devices`, every
    process counts towards the step's divisor, so micro-batch size, accumulation, padding and packing do not change
    the loss. A Mixture-of-Experts model whose config asks for router logits gets its load-balancing loss added here
    (TRL's rule), once per micro-batch.

    Counts the step's items and divides each micro-batch's summed loss by them. `items_in(batch)` is the method's
    count of one collated batch; `record` keeps a per-example metric (the logged `aux_loss`); `accumulation()`: the
    micro-batches the optimizer step's loss is spread over now."""

    def __init__(self, settings, accelerator, context_parallel, model, items_in: Callable[[dict], torch.Tensor],
                 record: Callable[..., None], accumulation: Callable[[], int] = lambda: 1):
        self.settings = settings  # StepLossSettings (trainers/settings.py)
        self.accelerator = accelerator
        self.context_parallel = context_parallel
        self.items_in = items_in
        self.record = record
        self.accumulation = accumulation
        # TRL's attributes (kept on the trainer too): whether the router loss is added, and its weight
        self.router_loss_enabled, self.router_loss_coef = router_loss_settings(model, settings.router_aux_loss_coef)
        self._router_loss = None

    def count(self, batch_samples: list, device) -> torch.Tensor:
        """The step's item count: its micro-batches', summed over the processes when they average together."""
        count = sum((self.items_in(b) for b in batch_samples if "labels" in b or "target_index" in b), torch.tensor(0))
        count = torch.as_tensor(count).to(device)
        if self.settings.average_tokens_across_devices and self.settings.world_size > 1:
            return self._over_processes(count)
        return count

    def _over_processes(self, count: torch.Tensor) -> torch.Tensor:
        """Every process's count summed, where the processes average together; every process of a context-parallel
        group counted the same whole batch (before it is split)."""
        return self.accelerator.gather(count).sum() // self.context_parallel.size

    def drop_router_loss(self) -> None:
        """A discarded attempt's router loss, noted by its forward and not added by its loss: none is pending
        between micro-batches (each loss adds the one its forward noted)."""
        self._router_loss = None

    def note_router_loss(self, model, outputs) -> None:
        """Keep the router loss of a forward pass of the trained policy (not the reference, not a no-grad pass)."""
        aux = getattr(outputs, "aux_loss", None)
        if self.router_loss_enabled and aux is not None and aux.requires_grad:
            self._router_loss = aux if self._router_loss is None else self._router_loss + aux

    def normalise(self, model, loss_sum: torch.Tensor, local_count, num_items_in_batch,
                  whole_sequences: bool = False) -> torch.Tensor:
        """Divide a summed loss by the optimizer step's item count (the batch's own count outside training), and add
        the router loss of this micro-batch's policy forwards (every trainer's loss ends here). Under context
        parallelism: `_normalised_in_ring` (`whole_sequences`: a loss over sequence sums made whole across the
        context-parallel group)."""
        if self.context_parallel.size > 1:
            loss = self._normalised_in_ring(model, loss_sum, local_count, num_items_in_batch, whole_sequences)
        elif num_items_in_batch is None or not model.training:
            loss = loss_sum / torch.as_tensor(local_count, device=loss_sum.device).clamp(min=1)
        else:
            loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
            if self.settings.average_tokens_across_devices and self.settings.world_size > 1:
                loss = loss * self.settings.world_size  # DDP averages gradients over processes
        if self._router_loss is None:  # no MoE router loss noted (always so for a dense model)
            return loss
        return self._plus_router_loss(model, loss)

    def _normalised_in_ring(self, model, loss_sum: torch.Tensor, local_count, num_items_in_batch,
                            whole_sequences: bool) -> torch.Tensor:
        """`normalise` under context parallelism, where this process holds part of the batch.

        `whole_sequences`: a loss formed from per-sequence sums made whole over the context-parallel group
        (ContextParallelism.total), so the same value on each of its processes, and `local_count` the whole batch's.
        The sums' all-reduce sums the gradients of those cp_size copies in its backward, so in training each copy is
        divided by cp_size (where the gradient all-reduce then averages over every process, data x context, as for
        any loss); in evaluation the processes' equal losses average to it."""
        cp = self.context_parallel.size
        evaluating = num_items_in_batch is None or not model.training
        if whole_sequences:
            if evaluating:
                return loss_sum / torch.as_tensor(local_count, device=loss_sum.device).clamp(min=1)
            loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
            if self.settings.average_tokens_across_devices:  # the count is the step's over every data-parallel group
                loss = loss * self.settings.world_size / cp
            return loss
        if evaluating:
            # this process holds part of the batch: its share of the batch's mean, so that the mean over the
            # context-parallel group (evaluation averages the processes' losses) is the batch's mean
            whole = torch.as_tensor(self.context_parallel.batch_targets, device=loss_sum.device).clamp(min=1)
            return loss_sum * cp / whole
        loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
        if self.settings.average_tokens_across_devices and self.settings.world_size > 1:
            loss = loss * self.settings.world_size  # DDP averages gradients over processes
        return loss

    def _plus_router_loss(self, model, loss: torch.Tensor) -> torch.Tensor:
        """router_aux_loss_coef x the noted router loss (divided by the accumulation steps in training, where each
        micro-batch's loss is its share of the step), logged as aux_loss."""
        aux, self._router_loss = self._router_loss, None
        steps = self.accumulation() if model.training else 1
        self.record(model, aux_loss=aux.detach().float().reshape(1))
        return loss + self.router_loss_coef * aux.to(loss.dtype) / steps


def router_loss_settings(model, coef: float | None) -> tuple[bool, float]:
    """(whether the MoE router loss is added, its weight): on when the model's config has output_router_logits=True
    (TRL's rule); the weight is `router_aux_loss_coef`, else the config's own."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        return False, 0.0
    enabled = bool(getattr(config, "output_router_logits", False))
    if coef is None:
        coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    return enabled, float(coef)
