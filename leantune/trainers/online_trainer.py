"""The online methods (GRPO, RLOO, Online DPO, PPO) as one trainer made of parts (trainers/online/):

- `GenerationSession` (generation/sampling.py): the backend, weight sync, sleep mode, each round's seeds;
- `RoundBuilder` (round_builder.py): prompt rows -> completions -> rewards -> scored micro-batches with the
  method's loss inputs; `RoundMetrics` (metrics/run_metrics.py): what a round reports;
- `round_loader` (round_builder.py): each round's prompts, once per micro-batch trained on it;
- `evaluate_rounds` (evaluation.py): held-out prompts' rewards and loss.

A training step takes its micro-batches from a buffer of scored completions, refilled by a new round when empty;
`compute_loss` scores a micro-batch with the policy (chunked log-probs by default: never the full logits) and hands
the scores to the method's `policy_loss`, normalised over the whole optimizer step, then adds the method's
`regularised` terms. A method file declares what its round and loss read and supplies its loss inputs, item count
and loss (`OnlineMethod`, with `ScoringNeeds`); shared code names no method.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from .. import methods
from ..data.collators import MODEL_INPUTS
from ..data.prompt_preparation import PROMPT_IDS, context_limit_of, prepare_prompt_dataset
from ..data.streaming import is_stream
from ..generation import GenerationSession, SamplingSettings
from ..generation.backend import TRANSFORMERS, backend_factory, check_backend_requirements
from ..losses.token_logprobs import TargetScores, per_sequence_sum
from ..metrics.run_metrics import RoundMetrics
from ..rewards import RewardFunctions
from ..rollouts import AgentRollouts
from .base import LeantuneTrainer
from .online.evaluation import evaluate_rounds
from .online.round_builder import (
    LABELLED_TARGETS,
    SHARED_PROMPT_TARGETS,
    MethodHooks,
    OneProcess,
    ProcessShare,
    RoundBuilder,
    RoundLoader,
    RoundSampler,
    RoundScoring,
    StreamRounds,
    as_rows,
    round_loader,
    stream_round_loader,
)
from .parts.batches import deepspeed_float_dtype, on_device
from .parts.context_parallel import ORDINAL_KEY, data_parallel_place, generation_group
from .parts.frozen_models import prepare_frozen_model
from .reference import ReferenceModelMixin
from .settings import generation_engine, generation_of, round_settings_of

logger = logging.getLogger("leantune.online")

__all__ = ["OnlineMethod", "OnlineTrainer", "RoundLoader", "RoundSampler", "ScoringNeeds", "StreamRounds"]

# The round's inputs of the loss given per target of a micro-batch (its flat target order)
PER_TARGET_INPUTS = ("old_logps", "ref_logps", "sampling_logps")
PLACED_TARGETS = "placed_targets"  # under context parallelism: this process's targets' sequences (`sequence_sums`)
# Why an online method's evaluation cannot run under context parallelism
EVALUATION_OUTSIDE_THE_RING = ("its rounds are scored outside the ring (every process would score whole sequences, "
                               "and the loss would be read as one process's part)")


@dataclass(frozen=True)
class ScoringNeeds:
    """What a method's loss reads of the policy's scoring beyond the targets' log-probs: per-token entropies (with
    their gradient where the loss differentiates them), the last hidden states at the targets."""

    entropies: bool = False
    entropy_grad: bool = False
    hidden_states: bool = False


def sequence_sums(values: torch.Tensor, sequence: torch.Tensor, count: int, batch: dict) -> torch.Tensor:
    """Per-target values summed per sequence of the micro-batch: whole sums, under context parallelism too (each
    process's partial sums summed over its group, with their gradient)."""
    placed = batch.get(PLACED_TARGETS)
    return per_sequence_sum(values, sequence, count) if placed is None else placed.sums(values, count)


class OnlineMethod:
    """What an online method declares and supplies to the recipe every online method shares (OnlineTrainer): what its
    loss reads of the policy's scoring, its loss inputs, the prompts its completions are scored after, its item
    count, its loss and the terms added after normalising it, and whether its micro-batches train in parts."""

    scores_at_temperature = True  # log-probs of the logits divided by args.temperature, as sampled (Online DPO: 1)
    scoring_needs = ScoringNeeds()  # what the loss reads of the policy's scoring beyond log-probs
    # The generation-time policy scores every round, on-policy too (its log-probs feed the method's inputs or
    # corrections); otherwise only a round trained after the policy moved
    scores_policy_on_policy = False

    def attach_loss_inputs(self, batches: list[dict], scored: dict, group: int) -> None:
        """The method's own inputs of its loss into each micro-batch (advantages, chosen completions, returns...),
        from the gathered round (`scored`: rewards, per function, which ended in EOS, the metric store; groups of
        `group` completions of one prompt)."""
        raise NotImplementedError

    def attach_policy_scores(self, batch: dict, model, on_device: dict) -> None:
        """What the generation-time policy gives each micro-batch: its log-probs (PPO adds its values)."""
        batch["old_logps"] = self.rounds.scored_logps(model, on_device)

    def scored_prompts(self, prompts: list, completion_ids: list) -> list:
        """The prompt each completion is scored after (Online DPO cuts long ones): the prompt it was sampled from."""
        return prompts

    def loss_items(self, batch: dict) -> int:
        """What this micro-batch adds to the optimizer step's divisor."""
        raise NotImplementedError

    def policy_loss(self, scores: TargetScores, sequence: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
        """(summed loss of the micro-batch, per-micro-batch metrics) from the policy's scores of its targets (what
        `scoring_needs` asks: per-target log-probs, entropies, hidden states)."""
        raise NotImplementedError

    def regularised(self, loss: torch.Tensor, scores: TargetScores, batch: dict, model) -> tuple[torch.Tensor, dict]:
        """(the normalised loss plus the method's terms not divided by the step's item count, their metrics)."""
        return loss, {}

    def split_problem(self) -> str | None:
        """Why the method's loss would change if a micro-batch trained in parts of whole prompt groups (the
        out-of-memory retry's, online/round_parts.py); None: it would not."""
        return None


def round_builder(trainer, args, tokenizer) -> RoundBuilder:
    """An online trainer's round builder, given its settings and what it calls, chosen once: the method's hooks,
    the scoring (a ring and the ring's placement only under context parallelism, the reference only when the method
    reads it), how targets are read (the shared-prompt rows' only with `shared_prompt`), this process's share of
    each round and the gathering over processes (in one process: the whole round, nothing gathered)."""
    settings = round_settings_of(args, trainer.steps_per_generation, trainer.layout)
    trainer.target_reading = SHARED_PROMPT_TARGETS if settings.shared_prompt else LABELLED_TARGETS
    hooks = MethodHooks(trainer.attach_loss_inputs, trainer.loss_items, trainer.scored_prompts,
                        trainer.attach_policy_scores, trainer.scores_policy_on_policy)
    accelerator, ring = trainer.accelerator, trainer.context_parallel
    device, float_dtype = args.device, deepspeed_float_dtype(accelerator)
    if ring.size > 1:  # each process scores its part of every sequence, inside the ring (placed once it is split)
        def lay_out(model, batch):
            context, laid = trainer._prepare_context_parallel_inputs(model, batch)
            return context, lambda: on_device(laid, device, float_dtype)
    else:
        def lay_out(model, batch):
            return contextlib.nullcontext, lambda: on_device(batch, device, float_dtype)
    reference = (lambda: trainer.reference.scope(trainer.model)) if trainer.reference_wanted(args) else None
    scoring = RoundScoring(lambda: trainer.model_wrapped, lay_out, reference, trainer.logprobs.target_logprobs,
                           trainer.scoring_temperature, ring if ring.size > 1 else None)
    generation, agent = trainer.generation, trainer.agent
    rollout = None if agent is None else (
        lambda rows: agent.rollout(rows, generation.generate_turn, trainer, generation.step_together))
    share = OneProcess() if accelerator.num_processes == 1 else ProcessShare(
        ring.data_parallel_rank, ring.data_parallel_size, ring.gather_once_per_group, accelerator.device)
    return RoundBuilder(settings, generation, trainer.round_metrics, trainer.rewards, tokenizer, hooks, scoring,
                        trainer.target_reading, share, lambda: trainer.state, rollout=rollout, tools=agent is not None and bool(agent.tools),
                        logs_examples=settings.log_completions and trainer.is_world_process_zero())


class OnlineTrainer(OnlineMethod, ReferenceModelMixin, LeantuneTrainer):
    """Config -> parts (generation session, round builder, round metrics) -> the method's loss."""

    keeps_eval_dataset_as_given = True  # as TRL's online trainers: prompts are prepared aside, for evaluate()
    prepared_columns = (PROMPT_IDS,)

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), quantization_config=None,
                 peft_config=None, agent: AgentRollouts | None = None, ref_model=None):
        args = self.default_args(model, args)
        self.agent = agent  # GRPO's tools / environments / rollout function (rollouts/): None for single turns
        if train_dataset is None and agent is not None:
            train_dataset = agent.placeholder_dataset(args)  # environments that own the data (or TRL's errors)
        check_backend_requirements(generation_engine(args), bool(args.vllm_enable_sleep_mode))  # before any model loads: a backend that cannot run here fails first
        self._reward_sources = (reward_funcs, reward_processing_classes)
        # policy, tokenizer, reference (none when the method needs none; the adapter disabled with PEFT) and the
        # rewards; prompts tokenised once (the rest of each row goes to the reward functions); batches are rows
        self.construct(model, args, train_dataset, eval_dataset, processing_class, as_rows, peft_config=peft_config,
                       quantization_config=quantization_config, callbacks=callbacks, optimizers=optimizers,
                       ref_model=ref_model)
        args, tokenizer = self.args, self.processing_class
        self.rewards.to(self.accelerator.device).prepare_models(
            lambda reward_model: prepare_frozen_model(self.accelerator, reward_model, args, in_ring=False))
        # the round's prompts over the data-parallel processes (a context-parallel group's share one micro-batch)
        self.streams_prompts = is_stream(self.train_dataset)  # the train rounds read a stream (round_builder.py)
        self.round_size, self.steps_per_generation = args.generation_plan(data_parallel_place(self.accelerator)[1])
        if self.round_size % args.num_generations:
            raise ValueError(f"Completions per generation round ({self.round_size} = per_device_train_batch_size x "
                             f"processes x steps_per_generation) must be a multiple of num_generations "
                             f"({args.num_generations}).")
        sampling = SamplingSettings.from_config(args, tokenizer, self.model)
        generation = generation_of(args)
        self.generation = GenerationSession(generation, sampling,
                                            backend_factory(generation.engine, args, tokenizer, self.accelerator,
                                                            generation.cache_implementation), self.accelerator,
                                            policy=lambda: self.model_wrapped, step=lambda: self.state.global_step,
                                            method=self.method, rank=data_parallel_place(self.accelerator)[0],
                                            in_group=generation_group(self.accelerator))
        if self.agent is not None:
            self.agent.bind(tokenizer, args, self.generation.sampling.eos_token_ids,
                            self.generation.context_limit(self._context_limit))
        self.round_metrics = RoundMetrics(self.settings.round_report, self.accelerator, self.run_metrics.values,
                                          self.round_size)
        self.round_counts = self.round_metrics.counts  # counted decisions over the run (logged at its end)
        self._logs = {"extra": self.round_metrics.extra}  # TRL's attribute: what reward functions log_extra
        self.rounds = round_builder(self, args, tokenizer)
        self._buffer: list[dict] = []  # the current round's micro-batches not trained yet

    def frozen_model_sources(self) -> dict:
        return {"reward_funcs": self._reward_sources[0]}

    def reference_wanted(self, args) -> bool:
        return args.beta != 0.0

    def load_models(self, model, ref_model, processing_class, peft_config, args, quantization_config):
        loaded = super().load_models(model, ref_model, processing_class, peft_config, args, quantization_config)
        reward_funcs, reward_processing_classes = self._reward_sources
        self.rewards = RewardFunctions(reward_funcs, args.reward_weights, reward_processing_classes,
                                       {"trust_remote_code": True} if args.trust_remote_code else None,
                                       extra_funcs=self.agent.reward_functions() if self.agent is not None else ())
        # TRL's attributes: the functions and their tokenizers by position (None for a callable)
        self.reward_funcs, self.reward_processing_classes = self.rewards.funcs, self.rewards.tokenizers
        self._context_limit = context_limit_of(loaded.model)
        return loaded

    def frozen_models(self) -> list[torch.nn.Module]:
        """The reference and every reward function that is a model (as prepared for the engine when it was)."""
        runners = getattr(getattr(self, "rewards", None), "runners", {})
        return [*super().frozen_models(), *(model for model in runners.values() if model is not None)]

    def prepare_split(self, dataset, split, tokenizer, args):
        if self.agent is None:
            return prepare_prompt_dataset(dataset, tokenizer, args, split, self._context_limit)
        prepared, report = prepare_prompt_dataset(self.agent.with_prompt_column(dataset), tokenizer, args, split,
                                                  self._context_limit, self.agent.prompt_template_kwargs())
        self.agent.check_dataset(prepared, report.conversational if report is not None else True)
        return prepared, report

    @property
    def reward_func_names(self) -> list[str]:
        """TRL's attribute: the reward functions' names, as their metrics are logged."""
        return list(self.rewards.names)

    @property
    def reward_weights(self) -> torch.Tensor:
        """TRL's attribute: one weight per reward function (environment-owned rewards: 1)."""
        return self.rewards.weights

    @property
    def environments(self) -> list | None:
        """TRL's attribute: the environment instance of each rollout of the last round."""
        return self.rounds.environments if hasattr(self, "rounds") else None

    # --- data: rounds of prompts -> micro-batches of scored completions ----------------------------------------------

    def get_train_dataloader(self):
        loader = stream_round_loader if self.streams_prompts else round_loader
        return loader(self.train_dataset, self.round_size // self.args.num_generations,
                      self.steps_per_generation * self.args.num_iterations, self.args)

    def trained_batches(self, prompt_rows: list) -> list:
        """One micro-batch of the round buffer per item of the loader (a round's prompts); a new round when empty."""
        batches = []
        for prompts in prompt_rows:
            if not self._buffer:
                self._buffer = self.generation_round(prompts)
            batches.append(self._buffer.pop(0))
        return batches

    def generation_round(self, prompt_rows: list[dict]) -> list[dict]:
        """Generate, reward and prepare one round; returns its micro-batches (repeated num_iterations times)."""
        return self.rounds.training_round(prompt_rows, self.steps_per_generation)

    def items_in(self, batch: dict) -> torch.Tensor:
        return torch.as_tensor(batch["loss_items"])

    # --- the loss ---------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The policy scores the micro-batch (as the method's `scoring_needs` ask) -> the method's `policy_loss` ->
        normalised over the optimizer step -> the method's `regularised` terms."""
        batch = dict(inputs)
        self.run_metrics.count_tokens(model, batch)
        model_inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        needs = self.scoring_needs
        split = ORDINAL_KEY in batch  # context parallelism: this process's part of every sequence
        if split:
            self.context_parallel.check_layout(model_inputs)
        # the entropy metric where the path gives it at no extra pass (not Liger's kernel, which computes none)
        scores = self.logprobs.target_logprobs(model, model_inputs, self.target_reading.targets(batch),
                                               self.scoring_temperature, with_entropy=needs.entropies,
                                               entropy_grad=needs.entropy_grad, with_hidden=needs.hidden_states,
                                               entropy_where_free=True)
        sequence = (self.own_part_of_batch if split else self.target_reading.sequences)(batch, scores.targets)
        loss_sum, metrics = self.policy_loss(scores, sequence, batch)
        entropy = scores.entropy if scores.entropy is not None else torch.full_like(scores.logps, float("nan"))
        metrics["entropy"] = entropy.detach().mean()  # NaN without entropies or targets (left out of the logged mean)
        loss = self.step_loss.normalise(self.model, loss_sum, batch["loss_items"], num_items_in_batch,
                                        whole_sequences=split and self.context_parallel_loss == methods.SEQUENCE_SUMS)
        loss, added = self.regularised(loss, scores, batch, model)
        metrics.update(added)
        if split:  # each process's means over its part of the sequences -> the whole sequences' (one process's)
            metrics = self.context_parallel.whole_means(metrics, len(scores.logps))
        self.run_metrics.record(model, **{name: value.reshape(1) for name, value in metrics.items()})
        return (loss, {}) if return_outputs else loss

    # --- context parallelism: each process scores its part of every sequence --------------------------------------

    def _prepare_context_parallel_inputs(self, model, inputs):
        """Every online batch carries its targets' sequences and ordinals through the split (the per-target inputs
        of the round are read at the ordinals, per-sequence sums made whole over the group)."""
        if self.context_parallel.size == 1:
            return contextlib.nullcontext, inputs
        return self.context_parallel.lay_out(inputs, self.processing_class.pad_token_id, per_sequence=True)

    def own_part_of_batch(self, batch: dict, targets) -> torch.Tensor:
        """Under context parallelism: the round's per-target inputs (whole batch, flat target order) cut to this
        process's targets, `placed` (sequence sums made whole over the group: `sequence_sums`) put in the batch;
        returns each target's sequence."""
        placed = self.context_parallel.placed_targets(batch, targets)
        ordinals = self.context_parallel.target_ordinals(batch, targets)
        for key in PER_TARGET_INPUTS:
            if key in batch:
                batch[key] = batch[key].to(ordinals.device).index_select(0, ordinals)
        batch[PLACED_TARGETS] = placed
        return placed.sequence

    def context_parallel_problem(self, args) -> str | None:
        """The options context parallelism cannot run exactly for an online method (None: it can): generation
        with vLLM or agents, evaluation rounds."""
        if generation_engine(args) != TRANSFORMERS:
            return "`use_vllm=True` (its engine generates apart from the ring's groups); generate with transformers"
        if self.agent is not None:
            return "tools, environments or a rollout function (each process of a group would run them)"
        strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
        if strategy != "no":
            return f"evaluation (`eval_strategy={strategy!r}`: {EVALUATION_OUTSIDE_THE_RING})"
        return None

    def liger_notes(self, args) -> list[tuple[int, str]]:
        return [(logging.INFO, "use_liger_loss=True: completions are scored by Liger's fused linear cross-entropy "
                               "(per-token log-probs, the method's loss written over them); it computes no entropies, "
                               "so the `entropy` metric is not logged.")]

    # --- evaluation and the run's summary ----------------------------------------------------------------------------

    def evaluate_prepared(self, dataset, ignore_keys, metric_key_prefix: str) -> dict:
        """Under context parallelism a direct `evaluate()` is refused, as `eval_strategy` is when the trainer is
        built: the same evaluation rounds would run, outside the ring."""
        if self.context_parallel.size > 1:
            raise ValueError(f"Context parallelism (`cp_size={self.context_parallel.size}`) cannot run "
                             f"{type(self).__name__}.evaluate(): {EVALUATION_OUTSIDE_THE_RING}. Evaluate the saved "
                             f"model in a run with `cp_size` 1.")
        return evaluate_rounds(self, dataset, metric_key_prefix)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.round_counts:
                logger.info("%s counted decisions over the run: %s", self.method.upper(), dict(self.round_counts))

    def training_summary(self) -> dict:
        summary = super().training_summary()
        summary.update({f"count/{name}": value for name, value in self.round_counts.items()})
        return summary
