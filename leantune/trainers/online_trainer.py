"""What GRPO and RLOO share: rounds of generation, rewards, and scoring completions through the memory engine.

A training step's micro-batches come from a buffer of generated completions, not from the dataset directly:

1. The data loader yields each round's prompts (the same prompts on every process) once per micro-batch of the
   round, so the Trainer's epoch and step counting stay right.
2. When the buffer is empty, `generation_round` takes the round's prompts, repeats each `num_generations` times,
   keeps this process's slice, generates with the backend (transformers, vLLM colocated or a vLLM server), decodes,
   scores with the reward functions, gathers the rewards of all processes (groups may span them), and turns them
   into advantages (the method's recipe: `round_advantages`).
3. The round's completions are split into `steps_per_generation` micro-batches (padded or padding-free rows of
   prompt + completion, completion tokens as targets), repeated `num_iterations` times. Log-probs of the policy at
   generation time (when a micro-batch is trained after the policy has moved) and of the reference (beta > 0) are
   computed here, without gradient, through the memory engine.
4. `compute_loss` scores the micro-batch with the policy (chunked log-probs by default: never the full logits) and
   hands per-token log-probs to the method's loss (`policy_loss`), normalised over the whole optimizer step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict, deque

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from ..data.collators import MODEL_INPUTS, CausalLMCollator, prompt_completion_row, sequence_starts
from ..data.prompt_preparation import PROMPT_IDS, context_limit_of, prepare_prompt_dataset
from ..data.streaming import STREAM_BUFFER_ROWS, is_stream
from ..generation import Completions, SamplingSettings, make_backend
from ..generation.backend import check_backend_requirements
from ..losses.causal_lm import count_targets
from ..losses.dispatch import LogProbPath
from ..losses.entropy_bonus import EntropyBonus
from ..losses.token_logprobs import target_sequences
from ..rewards import RewardFunctions, RewardScores
from ..rollouts import AgentRollouts, Rollout
from .base import LeantuneTrainer
from .frozen_models import prepare_frozen_model
from .reference import ReferenceModelMixin

logger = logging.getLogger("leantune.online")


class RoundSampler(Sampler):
    """Each round's prompt indices (one list), yielded `repeats` times: once per micro-batch trained on the round.

    Every process draws the same rounds (same seed); each keeps its own slice of the round's completions. The
    last incomplete round of an epoch is left out (its prompts come back in other epochs' shuffles).
    """

    def __init__(self, num_prompts: int, prompts_per_round: int, repeats: int, shuffle: bool, seed: int):
        self.num_prompts, self.prompts_per_round, self.repeats = num_prompts, prompts_per_round, repeats
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.num_prompts // self.prompts_per_round) * self.repeats

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_prompts, generator=generator).tolist()
        else:
            order = list(range(self.num_prompts))
        for start in range(0, len(order) - self.prompts_per_round + 1, self.prompts_per_round):
            indices = order[start:start + self.prompts_per_round]
            for _ in range(self.repeats):
                yield indices


class RoundLoader(DataLoader):
    """A DataLoader whose epoch reaches its round sampler (the Trainer calls `set_epoch` on the loader)."""

    def set_epoch(self, epoch: int) -> None:
        (self.batch_sampler or self.dataset).set_epoch(epoch)


class StreamRounds(IterableDataset):
    """`RoundSampler`'s rounds for a stream of prompts (datasets.IterableDataset, no length, no indices).

    Rounds are consecutive rows of the stream, each yielded `repeats` times; an incomplete last round is left out.
    With `shuffle` (GRPO/RLOO's `shuffle_dataset`, on by default, as in TRL) the stream first goes through datasets'
    seeded buffered shuffle (`STREAM_BUFFER_ROWS` rows, reseeded each epoch): a full permutation needs the whole
    dataset, a buffer is what a stream allows. Every process reads the whole stream and draws the same rounds, as
    with the sampler; each keeps its own slice of the round's completions.
    """

    def __init__(self, stream, prompts_per_round: int, repeats: int, shuffle: bool, seed: int):
        self.stream, self.prompts_per_round, self.repeats = stream, prompts_per_round, repeats
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        stream = self.stream
        if self.shuffle:
            stream = stream.shuffle(seed=self.seed, buffer_size=STREAM_BUFFER_ROWS)
            stream.set_epoch(self.epoch)
        prompts = []
        for row in stream:
            prompts.append(row)
            if len(prompts) == self.prompts_per_round:
                for _ in range(self.repeats):
                    yield prompts
                prompts = []


def _rows(rows: list[dict]) -> list[dict]:
    return rows


def _row_batches(dataset, size: int):
    """Consecutive lists of `size` rows (the last one shorter) of a dataset or a stream, in order."""
    if not is_stream(dataset):
        for start in range(0, len(dataset), size):
            yield [dataset[i] for i in range(start, min(start + size, len(dataset)))]
        return
    rows = []
    for row in dataset:
        rows.append(row)
        if len(rows) == size:
            yield rows
            rows = []
    if rows:
        yield rows


class OnlineTrainer(ReferenceModelMixin, LeantuneTrainer):
    """Shared machinery of the online methods; a subclass supplies `round_advantages` and `policy_loss`."""

    keeps_eval_dataset_as_given = True  # as TRL's online trainers: prompts are prepared aside, for evaluate()
    scores_at_temperature = True  # log-probs of the logits divided by args.temperature, as sampled
    entropy_bonus: EntropyBonus | None = None  # GRPO's entropy_coef (losses/entropy_bonus.py)
    reads_hidden_states = False  # the loss reads the policy's last hidden states at the targets (PPO's value head)

    prepared_columns = (PROMPT_IDS,)

    def __init__(
        self,
        model,
        reward_funcs,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        agent: AgentRollouts | None = None,
        ref_model=None,
    ):
        args = self.default_args(model, args)
        # GRPO's tools / environments / rollout function (rollouts/): None for single-turn sampling
        self.agent = agent
        self.environments = None  # TRL's attribute: the environment instance of each rollout of the last round
        if train_dataset is None and agent is not None:
            train_dataset = agent.placeholder_dataset(args)  # environments that own the data (or TRL's errors)
        check_backend_requirements(args)
        self._reward_sources = (reward_funcs, reward_processing_classes)
        # policy, tokenizer, reference (none when beta = 0; the adapter disabled with PEFT) and the rewards; prompts
        # tokenised once (the rest of each row goes to the reward functions); batches are the rows themselves
        self.construct(model, args, train_dataset, eval_dataset, processing_class, _rows, peft_config=peft_config,
                       quantization_config=quantization_config, callbacks=callbacks, optimizers=optimizers,
                       ref_model=ref_model)
        tokenizer = self.processing_class
        self.data_reports = {split: report.as_dict() for split, report in self.data_reports.items()}
        self.rewards.to(self.accelerator.device).prepare_models(
            lambda reward_model: prepare_frozen_model(self.accelerator, reward_model, args))
        self.round_size, self.steps_per_generation = args.generation_plan(self.accelerator.num_processes)
        if self.round_size % args.num_generations:
            raise ValueError(f"Completions per generation round ({self.round_size} = per_device_train_batch_size x "
                             f"processes x steps_per_generation) must be a multiple of num_generations "
                             f"({args.num_generations}).")
        if self.logprob_path is LogProbPath.LIGER:
            logger.info(self._liger_notice(args))
        self.sampling = SamplingSettings.from_config(args, tokenizer, self.model)
        if self.agent is not None:
            self.agent.bind(tokenizer, args, self.sampling.eos_token_ids, self._context_limit)
        self.scoring_collator = CausalLMCollator(tokenizer.pad_token_id, ("completion_mask",), args.padding_free,
                                                 args.pad_to_multiple_of)
        self.backend = None
        self._buffer: list[dict] = []
        self._synced_step = -1
        self._rounds_generated = 0
        self.round_counts: dict[str, int] = defaultdict(int)  # counted decisions over the run (logged)
        # What reward functions hand to `log_extra`, per column, for the last round_size completions (TRL's `_logs`)
        self._logs = {"extra": defaultdict(lambda: deque(maxlen=self.round_size))}

    def reference_wanted(self, args) -> bool:
        return args.beta != 0.0

    @property
    def scoring_temperature(self) -> float:
        """The temperature the completions are scored at: the sampling one (GRPO, RLOO), or 1 for methods whose loss
        reads the model's own probabilities (Online DPO, as TRL's)."""
        return self.args.temperature if self.scores_at_temperature else 1.0

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

    def prepare_datasets(self, train_dataset, eval_dataset, tokenizer, args):
        train_dataset, eval_dataset, reports = super().prepare_datasets(train_dataset, eval_dataset, tokenizer, args)
        if is_stream(train_dataset) and args.dataloader_num_workers:
            logger.info("A streamed train set is read in rounds by the main process (worker processes would split "
                        "its generation groups): dataloader_num_workers=%d set to 0.", args.dataloader_num_workers)
            args.dataloader_num_workers = 0
        return train_dataset, eval_dataset, reports

    def frozen_models(self) -> list[torch.nn.Module]:
        """The reference and every reward function that is a model (as prepared for the engine when it was)."""
        runners = getattr(getattr(self, "rewards", None), "runners", {})
        return [*super().frozen_models(), *(model for model in runners.values() if model is not None)]

    def attach_reference(self, loaded, args) -> None:
        super().attach_reference(loaded, args)
        self._reference_ready = True  # online methods score the reference as they go

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

    # --- data: rounds of prompts ---------------------------------------------------------------------------------

    def get_train_dataloader(self):
        prompts_per_round = self.round_size // self.args.num_generations
        repeats = self.steps_per_generation * self.args.num_iterations
        if is_stream(self.train_dataset):
            rounds = StreamRounds(self.train_dataset, prompts_per_round, repeats, self.args.shuffle_dataset,
                                  self.args.seed)
            return RoundLoader(rounds, batch_size=None, collate_fn=_rows)
        if len(self.train_dataset) < prompts_per_round:
            raise ValueError(f"The train dataset has {len(self.train_dataset)} prompts, fewer than one generation "
                             f"round needs ({prompts_per_round}).")
        left_out = len(self.train_dataset) % prompts_per_round
        if left_out:
            logger.info("%d of %d prompts per epoch fall in an incomplete last round and are left out of that epoch.",
                        left_out, len(self.train_dataset))
        sampler = RoundSampler(len(self.train_dataset), prompts_per_round,
                               self.steps_per_generation * self.args.num_iterations, self.args.shuffle_dataset,
                               self.args.seed)
        return RoundLoader(self.train_dataset, batch_sampler=sampler, collate_fn=_rows,
                           num_workers=self.args.dataloader_num_workers)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The step's micro-batches, from the buffer; a new round is generated when it runs out."""
        batches = []
        for _ in range(num_batches):
            try:
                prompts = next(epoch_iterator)
            except StopIteration:
                break
            if not self._buffer:
                self._buffer = self.generation_round(prompts)
            batches.append(self._buffer.pop(0))
        return batches, self._get_num_items_in_batch(batches, device)

    def items_in(self, batch: dict) -> torch.Tensor:
        return torch.as_tensor(batch["loss_items"])

    # --- a generation round ---------------------------------------------------------------------------------------

    def _backend(self):
        if self.backend is None:
            self.backend = make_backend(self.args, self.model_wrapped, self.processing_class, self.accelerator)
            logger.info("%s generation backend: %s.", self.method.upper(), self.backend.name)
        return self.backend

    def generate_completions(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> Completions:
        backend = self._backend()
        backend.wake_up()
        if self._synced_step != self.state.global_step or getattr(backend, "needs_sync", False):
            backend.sync_weights(self.model_wrapped)
            self._synced_step = self.state.global_step
        self._rounds_generated += 1
        seed = self.args.seed + 1_000_003 * self._rounds_generated + 65_537 * self.accelerator.process_index
        completions = backend.generate(prompt_ids, dataclasses.replace(sampling, seed=seed))
        backend.sleep()
        return completions

    def _local_slice(self, total: int) -> slice:
        share = total // self.accelerator.num_processes
        start = self.accelerator.process_index * share
        return slice(start, start + share)

    def generation_round(self, prompt_rows: list[dict]) -> list[dict]:
        """Generate, reward and prepare one round; returns its micro-batches (repeated num_iterations times)."""
        args = self.args
        group = args.num_generations
        rows = [row for row in prompt_rows for _ in range(group)][self._local_slice(len(prompt_rows) * group)]
        completion_ids, rollout = self.rollout_completions(rows)
        scored = self.score_completions(rows, completion_ids, training=True, rollout=rollout)
        off_policy = self.steps_per_generation > args.gradient_accumulation_steps or args.num_iterations > 1
        batches = self.scored_batches(rows, completion_ids, scored, len(rows) // self.steps_per_generation, group,
                                      off_policy or self.kl_in_reward or self.needs_old_logps, rollout=rollout)
        return [dict(batch) for _ in range(args.num_iterations) for batch in batches]

    def rollout_completions(self, rows: list[dict]) -> tuple[Completions, Rollout | None]:
        """The completions of this process's rows: one sampled turn each, or with GRPO's tools / environments /
        rollout function, the agent's rollouts (rollouts/: prompts may change, tool tokens are not trained)."""
        if self.agent is None:
            return self.generate_completions([row[PROMPT_IDS] for row in rows], self.sampling), None
        rollout = self.agent.rollout(rows, self._generate_turn, self, self._step_together)
        self.environments = rollout.environments
        return Completions(rollout.completion_ids), rollout

    def _generate_turn(self, prompt_ids: list[list[int]], max_new_tokens: int) -> Completions:
        """One turn of the agent's rollouts, through the same backend (transformers or vLLM) as single turns."""
        sampling = dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens)
        if prompt_ids:
            return self.generate_completions(prompt_ids, sampling)
        # Nothing left here while other processes go on: generate in step with them (a backend call may gather
        # weights across processes), one token for a dummy prompt, and keep nothing.
        self.generate_completions([[self.sampling.eos_token_ids[0] if self.sampling.eos_token_ids else 0]],
                                  dataclasses.replace(sampling, max_new_tokens=1))
        return Completions([], [] if sampling.logprobs else None)

    def _step_together(self, wants_more: bool) -> bool:
        """Whether any process's rollouts want another turn (one process: its own answer)."""
        if self.accelerator.num_processes == 1:
            return wants_more
        flag = torch.tensor([int(wants_more)], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).any())

    def scored_batches(self, rows, completion_ids, scored: dict, micro_size: int, group: int,
                       policy_logps: bool, rollout: Rollout | None = None) -> list[dict]:
        """The micro-batches of scored completions, with what the loss reads: log-probs, advantages, item counts."""
        prompt_ids = rollout.prompt_ids if rollout is not None else None
        mask = rollout.policy_mask if rollout is not None else None
        examples = self._scoring_examples(rows, completion_ids, scored["terminated"], prompt_ids, mask)
        batches = [self.scoring_collator(examples[i:i + micro_size]) for i in range(0, len(rows), micro_size)]
        for batch in batches:
            batch["num_sequences"] = torch.tensor(micro_size)
        if self.sampling.logprobs:
            logprobs = rollout.logprobs if rollout is not None else getattr(completion_ids, "logprobs", None)
            if logprobs is not None and mask is not None:  # only the policy's own tokens are targets
                logprobs = [[v for v, m in zip(lp, row_mask) if m] for lp, row_mask in zip(logprobs, mask)]
            self._attach_sampling_logps(batches, examples, logprobs, micro_size)
        self._attach_logps(batches, policy_logps)
        advantages = self.round_advantages(scored["rewards"], batches, group, scored["per_function"])
        local = advantages[self._local_slice(len(advantages))]
        for i, batch in enumerate(batches):
            batch["advantages"] = local[i * micro_size:(i + 1) * micro_size]
            batch["loss_items"] = self.loss_items(batch)
        return batches

    def _scoring_examples(self, rows, completion_ids, terminated, prompt_ids=None, policy_mask=None) -> list[dict]:
        """Prompt + completion rows whose targets are the completion's tokens; with `policy_mask` (agent rollouts)
        only the tokens the policy sampled, not tool results."""
        examples, masked = [], 0
        for i, (row, completion, done) in enumerate(zip(rows, completion_ids, terminated)):
            keep = done or not self.args.mask_truncated_completions
            masked += not keep
            prompt = list(row[PROMPT_IDS] if prompt_ids is None else prompt_ids[i])
            own = [1] * len(completion) if policy_mask is None else policy_mask[i]
            examples.append(prompt_completion_row(prompt, completion, [int(keep) * m for m in own]))
        if masked:
            self.round_counts["truncated_completions_masked"] += masked
        return examples

    def _attach_sampling_logps(self, batches: list[dict], examples: list[dict], logprobs, micro_size: int) -> None:
        """Per-target log-probs of the engine that sampled the completions ("sampling_logps"), in the flat target
        order of each micro-batch: every kept completion's tokens, completion after completion."""
        if logprobs is None:
            raise RuntimeError(f"The {self._backend().name} generation backend returned no sampling log-probs.")
        for i, batch in enumerate(batches):
            part = range(i * micro_size, (i + 1) * micro_size)
            values = [v for j in part if any(examples[j]["completion_mask"]) for v in logprobs[j]]
            batch["sampling_logps"] = torch.tensor(values, dtype=torch.float32)
            if len(values) != int(count_targets(batch["labels"])):
                raise RuntimeError(f"{len(values)} sampling log-probs for {int(count_targets(batch['labels']))} "
                                   f"completion tokens from the {self._backend().name} generation backend.")

    @torch.no_grad()
    def _attach_logps(self, batches: list[dict], policy_too: bool) -> None:
        """Per-target log-probs of the generation-time policy ("old_logps") and of the reference ("ref_logps")."""
        reference = self.reference_wanted(self.args)
        if not policy_too and not reference:
            return
        model = self.model_wrapped
        was_training = model.training
        model.eval()  # no dropout while scoring: the same log-probs the loss would see without it
        try:
            for batch in batches:
                on_device = self._prepare_inputs(batch)
                if policy_too:
                    self.attach_policy_scores(batch, model, on_device)
                if reference:
                    with self.reference_model() as reference:
                        batch["ref_logps"] = self._scored_logps(reference, on_device)
        finally:
            model.train(was_training)

    def attach_policy_scores(self, batch: dict, model, on_device: dict) -> None:
        """What the generation-time policy gives each micro-batch: its log-probs (PPO adds its values)."""
        batch["old_logps"] = self._scored_logps(model, on_device)

    def entropies_in_loss(self, args=None) -> bool:
        """Whether the loss reads per-token entropies: GRPO's entropy bonus or its high-entropy token mask."""
        args = args or self.args
        bonus = getattr(args, "entropy_coef", 0.0) != 0.0 or getattr(args, "use_adaptive_entropy", False)
        return bonus or getattr(args, "top_entropy_quantile", 1.0) < 1.0

    def _liger_notice(self, args) -> str:
        if self.entropies_in_loss(args):
            return ("use_liger_loss=True: the loss reads per-token entropies (entropy_coef / use_adaptive_entropy / "
                    "top_entropy_quantile), which Liger's fused kernel does not compute, so the training forward "
                    "passes score through leantune's chunked head (exact, never the full logits); generation-time "
                    "and reference log-probs go through Liger's fused linear cross-entropy.")
        return ("use_liger_loss=True: completions are scored by Liger's fused linear cross-entropy (per-token "
                "log-probs, the method's loss written over them); it computes no entropies, so the `entropy` metric "
                "is not logged.")

    def _scored_logps(self, model, batch: dict) -> torch.Tensor:
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        return self.target_logprobs(model, inputs, batch["labels"], self.scoring_temperature).logps.detach()

    def score_completions(self, rows: list[dict], completion_ids: list[list[int]], training: bool,
                          rollout: Rollout | None = None) -> dict:
        """Decode, reward (all processes' rewards gathered, in round order), and record the round's metrics. Agent
        rollouts (`rollout`) give the reward functions their messages (tool calls and results included), their
        `environments` and a rollout function's extra columns."""
        tokenizer = self.processing_class
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = isinstance(rows[0]["prompt"], list)
        completions = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
        columns = {name: [row[name] for row in rows] for name in rows[0] if name not in ("prompt", PROMPT_IDS)}
        if rollout is not None:
            if rollout.completions is not None:
                completions = rollout.completions
            if rollout.environments is not None:
                columns["environments"] = rollout.environments
            columns.update(rollout.extra_columns)
        mode = "train" if training else "eval"
        extra = self._logs["extra"]

        def log_extra(column: str, values: list) -> None:
            extra[column].extend(values)

        def log_metric(name: str, value: float) -> None:
            self.metric_values[mode][name].append(float(value))

        scores = self.rewards.score([row["prompt"] for row in rows], completions, completion_ids, columns,
                                    trainer_state=self.state, log_extra=log_extra, log_metric=log_metric)
        self._count_reward_gaps(scores, rows, texts)
        eos = set(self.sampling.eos_token_ids)
        terminated = [bool(ids) and ids[-1] in eos for ids in completion_ids]
        device = self.accelerator.device
        per_function = self.accelerator.gather(scores.per_function.to(device)).float().cpu()
        own = [len(ids) for ids in completion_ids] if rollout is None or rollout.policy_mask is None \
            else [sum(mask) for mask in rollout.policy_mask]  # lengths count the policy's tokens, as in TRL
        lengths = self.accelerator.gather(torch.tensor(own, device=device)).cpu()
        if rollout is not None and self.agent.tools:
            self._record_tool_metrics(rollout, len(rows), training)
        done = self.accelerator.gather(torch.tensor(terminated, device=device)).cpu()
        rewards = RewardScores(per_function, scores.names, scores.missing, scores.nan).combined(self.rewards.weights)
        self._record_round_metrics(per_function, rewards, lengths, done, training)
        if self.args.log_completions and self.is_world_process_zero():
            self._log_examples(rows, texts, rewards[self._local_slice(len(rewards))])
        return {"rewards": rewards, "terminated": terminated, "per_function": per_function}

    def _record_tool_metrics(self, rollout: Rollout, count: int, training: bool) -> None:
        """TRL's `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed calls per call),
        over all processes; leantune adds `tools/malformed_frequency` (call blocks that did not parse, per
        completion: those completions were read as plain text) and counts both over the run."""
        totals = torch.tensor([rollout.tool_calls, rollout.tool_failures, rollout.malformed_tool_calls,
                               rollout.over_budget, count], device=self.accelerator.device, dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        calls, failures, malformed, over_budget, completions = totals.cpu().tolist()
        store = self.metric_values["train" if training else "eval"]
        store["tools/call_frequency"].append(calls / completions)
        store["tools/failure_frequency"].append(failures / calls if calls else 0.0)
        store["tools/malformed_frequency"].append(malformed / completions)
        if rollout.malformed_tool_calls:
            self.round_counts["malformed_tool_calls"] += rollout.malformed_tool_calls
            logger.warning("%d tool call(s) of this round could not be parsed (bad JSON, no name, or never closed); "
                           "their completions were read as plain text.", rollout.malformed_tool_calls)
        if rollout.tool_failures:
            self.round_counts["failed_tool_calls"] += rollout.tool_failures
        if rollout.over_budget:
            self.round_counts["tool_results_over_budget"] += rollout.over_budget
            logger.info("%d rollout(s) ended at a tool call whose results would not fit in max_completion_length=%d "
                        "(or the model's context).", rollout.over_budget, self.args.max_completion_length)

    def _count_reward_gaps(self, scores, rows: list[dict], texts: list[str]) -> None:
        for name, missing, nan in zip(scores.names, scores.missing, scores.nan):
            if missing:
                self.round_counts[f"no_reward/{name}"] += missing
            if nan:
                self.round_counts[f"nan_reward/{name}"] += nan
                logger.warning("Reward function %r returned NaN for %d completion(s): treated as no reward from it "
                               "(a completion no function scores gets advantage 0).", name, nan)
        unscored = scores.unscored()
        if unscored.any():
            self.round_counts["unscored_completions"] += int(unscored.sum())
            first = int(unscored.nonzero()[0])
            example = {name: value for name, value in rows[first].items() if name != PROMPT_IDS}
            logger.warning("All reward functions returned None for the following kwargs: %s (completion %r); %d "
                           "completion(s) of this round have no reward and get advantage 0.",
                           example, texts[first], int(unscored.sum()))

    def _record_round_metrics(self, per_function, rewards, lengths, terminated, training: bool) -> None:
        store = self.metric_values["train" if training else "eval"]
        for i, name in enumerate(self.rewards.names):
            column = per_function[:, i]
            column = column[~torch.isnan(column)]
            if column.numel():
                store[f"rewards/{name}/mean"].append(column.mean().item())
                store[f"rewards/{name}/std"].append(column.std().item() if column.numel() > 1 else 0.0)
        valid = rewards[~torch.isnan(rewards)]
        if valid.numel():
            store["reward"].append(valid.mean().item())
            store["reward_std"].append(valid.std().item() if valid.numel() > 1 else 0.0)
        groups = rewards.view(-1, self.args.num_generations if training else self.args.eval_num_generations)
        scored = [g[~torch.isnan(g)] for g in groups]
        zero_std = [float(g.numel() < 2 or g.std().item() == 0) for g in scored]  # fewer than two: no spread
        store["frac_reward_zero_std"].append(sum(zero_std) / len(zero_std))
        lengths = lengths.float()
        store["completions/mean_length"].append(lengths.mean().item())
        store["completions/min_length"].append(lengths.min().item())
        store["completions/max_length"].append(lengths.max().item())
        store["completions/clipped_ratio"].append(1.0 - terminated.float().mean().item())
        if terminated.any():
            store["completions/mean_terminated_length"].append(lengths[terminated].mean().item())
        if training:
            store["num_tokens"].append(float(lengths.sum().item()))

    def _log_examples(self, rows, texts, rewards) -> None:
        count = self.args.num_completions_to_print or 4
        for row, text, reward in list(zip(rows, texts, rewards.tolist()))[:count]:
            logger.info("prompt %r -> completion %r, reward %.3f", row["prompt"], text, reward)

    # --- the method's recipe -------------------------------------------------------------------------------------

    @property
    def kl_in_reward(self) -> bool:
        """Whether the method needs generation-time policy and reference log-probs before its advantages."""
        return False

    @property
    def needs_old_logps(self) -> bool:
        """Whether the method reads generation-time policy log-probs even on-policy (GRPO's vLLM correction)."""
        return False

    def round_advantages(self, rewards: torch.Tensor, batches: list[dict], group: int,
                         per_function: torch.Tensor | None = None) -> torch.Tensor:
        """[completions of the round, all processes] advantages from the gathered rewards (weighted sums; also
        each function's, [N, F]), in groups of `group` completions of one prompt."""
        raise NotImplementedError

    def loss_items(self, batch: dict) -> int:
        """What this micro-batch adds to the optimizer step's divisor."""
        raise NotImplementedError

    def policy_loss(self, logps: torch.Tensor, sequence: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
        """(summed loss of the micro-batch, per-micro-batch metrics) from per-target log-probs."""
        raise NotImplementedError

    # --- the loss ---------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = dict(inputs)
        self.count_tokens(model, batch)
        model_inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        bonus = self.entropy_bonus
        temperature = self.scoring_temperature
        # Entropies for the metric come with the chunked head at no extra pass; Liger's kernel computes none
        with_entropy = self.entropies_in_loss() or not self.liger_head_runs(model, temperature)
        scores = self.target_logprobs(model, model_inputs, batch["labels"], temperature, with_entropy=with_entropy,
                                      entropy_grad=with_entropy and bonus is not None,
                                      with_hidden=self.reads_hidden_states)
        if self.reads_hidden_states:
            batch["target_hidden"] = scores.hidden  # [targets, hidden], with its gradient (PPO's value head)
        logps, entropy = scores.logps, scores.entropy
        if entropy is None:
            entropy = torch.full_like(logps.detach(), float("nan"))  # NaN: left out of the logged mean
        sequence = target_sequences(scores.targets, sequence_starts(batch))
        batch["token_entropy"] = entropy.detach()  # per target (GRPO's top_entropy_quantile reads it)
        loss_sum, metrics = self.policy_loss(logps, sequence, batch)
        metrics["entropy"] = entropy.detach().mean()  # NaN when nothing is scored (left out of the logged mean)
        loss = self.normalise(loss_sum, batch["loss_items"], num_items_in_batch)
        if bonus is not None:
            loss = self._with_entropy_bonus(model, loss, entropy, batch, metrics)
        self.record_metrics(model, **{name: value.reshape(1) for name, value in metrics.items()})
        return (loss, {}) if return_outputs else loss

    def _with_entropy_bonus(self, model, loss, entropy, batch: dict, metrics: dict) -> torch.Tensor:
        """loss - coef x H (losses/entropy_bonus.py), over the tokens the policy term acts on (top_entropy_quantile's
        mask), divided by the accumulation steps only; the adaptive coefficient moves at each step's end."""
        bonus = self.entropy_bonus
        steps = getattr(self, "current_gradient_accumulation_steps", 1) if model.training else 1
        mask = batch.get("entropy_token_mask")
        acted = entropy if mask is None else entropy[mask]
        metrics["policy_loss"] = loss.detach() * steps  # the policy term alone, at the scale of the logged loss
        loss = loss + bonus.term(acted, steps)
        if model.training:
            if bonus.adaptive:
                bonus.observe(acted)
            if self.accelerator.sync_gradients:
                if bonus.adaptive:
                    device = self.accelerator.device
                    bonus.end_step(lambda totals: self.accelerator.reduce(totals.to(device), reduction="sum").cpu())
                metrics["entropy_coef"] = torch.tensor(bonus.coef, device=loss.device)
        return loss

    # --- evaluation: generate for the held-out prompts and report their rewards -----------------------------------

    def evaluate_prepared(self, dataset, ignore_keys, metric_key_prefix: str) -> dict:
        """One prepared eval split (the base `evaluate` prepares raw ones and runs each of a dict): the held-out
        prompts' completions are rewarded, and the method's loss on them is reported as `<prefix>_loss` (on-policy:
        ratios of 1, advantages from the eval groups), as TRL does."""
        group = self.args.eval_num_generations
        size = max(1, self.args.per_device_eval_batch_size // group) * self.accelerator.num_processes
        self.metric_values["eval"].clear()
        model = self.model_wrapped
        was_training = model.training
        model.eval()
        try:
            for prompt_rows in _row_batches(dataset, size):
                prompt_rows = prompt_rows[: len(prompt_rows) - len(prompt_rows) % self.accelerator.num_processes]
                if not prompt_rows:
                    continue
                rows = [row for row in prompt_rows for _ in range(group)][self._local_slice(len(prompt_rows) * group)]
                completion_ids, rollout = self.rollout_completions(rows)
                scored = self.score_completions(rows, completion_ids, training=False, rollout=rollout)
                self._record_eval_loss(model, self.scored_batches(rows, completion_ids, scored, len(rows), group,
                                                                  self.kl_in_reward or self.needs_old_logps,
                                                                  rollout=rollout))
        finally:
            model.train(was_training)
        metrics = {f"{metric_key_prefix}_{name}": value
                   for name, value in self.summarise_metrics(self.metric_values["eval"]).items()}
        self.metric_values["eval"].clear()
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    @torch.no_grad()
    def _record_eval_loss(self, model, batches: list[dict]) -> None:
        for batch in batches:
            loss = self.compute_loss(model, self._prepare_inputs(batch))
            self.metric_values["eval"]["loss"].append(self.accelerator.gather(loss.detach().reshape(1)).mean().item())

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

