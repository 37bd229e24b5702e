"""One round of an online method: prompt rows -> completions (one sampled turn, or GRPO's agent rollouts) -> rewards
scored and gathered over all processes -> scored micro-batches (prompt + completion, completion tokens as targets)
with the log-probs the loss reads -> the method's own loss inputs (`attach_loss_inputs`) and item counts
(`loss_items`).

The builder is given its own settings (`RoundSettings`, trainers/settings.py) and what it calls, chosen once when the
trainer is built: the method's hooks (`MethodHooks`: its loss inputs and item count, the prompt each completion is
scored after, what the generation-time policy gives a micro-batch), the scoring (`RoundScoring`: the policy, the
reference, the batch's placement, with a ring only under context parallelism), how targets are read (`TargetReading`:
from labels, or the shared-prompt rows' own) and the gathering over processes. It never holds the trainer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from ...data.collators import MODEL_INPUTS, CausalLMCollator, SharedPromptCollator, prompt_completion_row
from ...data.prompt_preparation import PROMPT_IDS
from ...data.streaming import STREAM_BUFFER_ROWS, is_stream
from ...generation import Completions
from ...losses.token_logprobs import Targets
from ...rewards import RewardScores
from ..parts.batches import count_labelled_targets, labelled_sequences, labelled_targets
from ..parts.context_parallel import ORDINAL_KEY
from ..parts.step_guards import EXAMPLES, KeptExamples

logger = logging.getLogger("leantune.online")


@dataclass(frozen=True)
class TargetReading:
    """How a micro-batch's targets, their sequences and their count are read: from its labels, or with
    `shared_prompt` from a shared row's own target columns (data/collators.py's `SharedPromptCollator`). Chosen once
    with the collator: every micro-batch of the run has that layout (under context parallelism too, where a shared
    row keeps its target columns: parts/shared_prompt_ring.py)."""

    targets: Callable[[dict], Targets]
    sequences: Callable[[dict, Targets], torch.Tensor]
    count: Callable[[dict], int]


def shared_row_targets(batch: dict) -> Targets:
    """A shared-prompt row's targets: the positions that predict them and their tokens."""
    return Targets(batch["target_index"], batch["target_tokens"], batch["input_ids"].shape)


def shared_row_sequences(batch: dict, targets: Targets) -> torch.Tensor:
    """Which example of the shared-prompt row each target belongs to."""
    return batch["target_sequence"].to(targets.index.device)


def count_shared_row_targets(batch: dict) -> int:
    return int(batch["target_index"].numel())


LABELLED_TARGETS = TargetReading(labelled_targets, labelled_sequences, count_labelled_targets)
SHARED_PROMPT_TARGETS = TargetReading(shared_row_targets, shared_row_sequences, count_shared_row_targets)


@dataclass(frozen=True)
class MethodHooks:
    """What the round calls of its method (trainers/online_trainer.py's `OnlineMethod`), and whether the
    generation-time policy scores an on-policy round too."""

    attach_loss_inputs: Callable
    loss_items: Callable
    scored_prompts: Callable
    attach_policy_scores: Callable
    scores_policy_on_policy: bool


@dataclass(frozen=True)
class RoundScoring:
    """How the round's micro-batches are scored before training: `policy()` the wrapped model now; `lay_out(model,
    batch)` -> (the ring's context, what places the batch on the training device, called inside it); `reference()` the reference's scope (None: the
    method reads no reference); the log-prob engine's `target_logprobs` at `temperature`; `ring` the
    context-parallel group (None without one)."""

    policy: Callable
    lay_out: Callable
    reference: Callable | None
    target_logprobs: Callable
    temperature: float
    ring: object | None = None


class OneProcess:
    """A round's completions in one process: all of them are its own, in round order (`ProcessShare`: several)."""

    def own(self, values):
        return values

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        return values.cpu()


@dataclass(frozen=True)
class ProcessShare:
    """A round's completions over several processes: data-parallel process `rank` of `size` keeps a contiguous slice
    of them (the processes of a context-parallel group share one); `gather_all(values)`: every process's values in
    round order (each context-parallel group's once), gathered from `device`."""

    rank: int
    size: int
    gather_all: Callable
    device: object

    def own(self, values):
        """This process's share of a round's values (in round order, all processes)."""
        share = len(values) // self.size
        return values[self.rank * share:(self.rank + 1) * share]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """A round's per-completion values of every process, in round order, on CPU."""
        return self.gather_all(values.to(self.device)).cpu()


class RoundBuilder:
    """`share`: this process's part of each round (`OneProcess` or `ProcessShare`, chosen once when the trainer is
    built), and the gathering of every process's values; `trainer_state()`: what reward functions receive as
    `trainer_state`; `rollout(rows)`: GRPO's agent rollouts (None: one sampled turn), `tools`: they call tools;
    `logs_examples`: this process logs a few completions (`log_completions`, the main process)."""

    def __init__(self, settings, session, metrics, rewards, tokenizer, hooks: MethodHooks, scoring: RoundScoring,
                 target_reading: TargetReading, share: OneProcess | ProcessShare, trainer_state,
                 rollout=None, tools: bool = False, logs_examples: bool = False):
        self.settings, self.session, self.metrics, self.rewards, self.tokenizer = settings, session, metrics, rewards, \
            tokenizer
        self.hooks, self.scoring, self.targets = hooks, scoring, target_reading
        self.share, self.trainer_state = share, trainer_state
        self.rollout, self.tools, self.logs_examples = rollout, tools, logs_examples
        self.collate = SharedPromptCollator(tokenizer.pad_token_id, settings.pad_to_multiple_of) \
            if settings.shared_prompt else CausalLMCollator(tokenizer.pad_token_id, ("completion_mask",),
                                                            settings.padding_free, settings.pad_to_multiple_of)
        self.environments = None  # the environment instance of each rollout of the last round (TRL's attribute)

    def own_rows(self, prompt_rows: list[dict], group: int) -> list[dict]:
        """Each prompt repeated `group` times; this process keeps its slice."""
        return self.share.own([row for row in prompt_rows for _ in range(group)])

    def training_round(self, prompt_rows: list[dict], steps_per_generation: int) -> list[dict]:
        """Generate, reward and prepare one round; its micro-batches, repeated num_iterations times."""
        settings = self.settings
        group = settings.num_generations
        rows = self.own_rows(prompt_rows, group)
        completion_ids, rollout = self.completions(rows)
        scored = self.score(rows, completion_ids, training=True, rollout=rollout)
        batches = self.scored_batches(rows, completion_ids, scored, len(rows) // steps_per_generation, group,
                                      settings.off_policy or self.hooks.scores_policy_on_policy, rollout=rollout)
        return [dict(batch) for _ in range(settings.num_iterations) for batch in batches]

    def eval_round(self, prompt_rows: list[dict], group: int) -> list[dict]:
        """One batch of held-out prompts, on-policy: scored as one micro-batch per process."""
        rows = self.own_rows(prompt_rows, group)
        completion_ids, rollout = self.completions(rows)
        scored = self.score(rows, completion_ids, training=False, rollout=rollout)
        return self.scored_batches(rows, completion_ids, scored, len(rows), group,
                                   self.hooks.scores_policy_on_policy, rollout=rollout)

    def completions(self, rows: list[dict]):
        """The completions of this process's rows: one sampled turn each, or with GRPO's tools / environments /
        rollout function, the agent's rollouts (rollouts/: prompts may change, tool tokens are not trained)."""
        if self.rollout is None:
            return self.session.generate([row[PROMPT_IDS] for row in rows], self.session.sampling), None
        rollout = self.rollout(rows)
        self.environments = rollout.environments
        return Completions(rollout.completion_ids), rollout

    # --- rewards ---------------------------------------------------------------------------------------------------

    def score(self, rows: list[dict], completion_ids, training: bool, rollout=None) -> dict:
        """Decode, reward (all processes' rewards gathered, in round order) and record the round's metrics. Agent
        rollouts give the reward functions their messages (tool calls and results included), their `environments`
        and a rollout function's extra columns."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = isinstance(rows[0]["prompt"], list)
        completions = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
        columns = {name: [row[name] for row in rows] for name in rows[0] if name not in ("prompt", PROMPT_IDS)}
        if rollout is not None:
            completions = self.rollout_columns(rollout, completions, columns)
        scores = self.rewards.score([row["prompt"] for row in rows], completions, completion_ids, columns,
                                    trainer_state=self.trainer_state(), **self.metrics.reward_logging[training])
        if not scores.complete:
            self.metrics.count_reward_gaps(scores, rows, texts)
        eos = set(self.session.sampling.eos_token_ids)
        terminated = [bool(ids) and ids[-1] in eos for ids in completion_ids]
        per_function = self.share.gather(scores.per_function).float()
        own = [len(ids) for ids in completion_ids] if rollout is None or rollout.policy_mask is None \
            else [sum(mask) for mask in rollout.policy_mask]  # lengths count the policy's tokens, as in TRL
        lengths = self.share.gather(torch.tensor(own))
        if rollout is not None and self.tools:
            self.metrics.record_tools(rollout, len(rows), training)
        ended = self.share.gather(torch.tensor(terminated))
        rewards = RewardScores(per_function, scores.names, scores.missing, scores.nan).combined(self.rewards.weights)
        self.metrics.record_round(self.rewards.names, per_function, rewards, lengths, ended, training)
        if self.logs_examples:
            self.metrics.log_examples(rows, texts, self.share.own(rewards))
        return {"rewards": rewards, "terminated": terminated, "ended": ended, "per_function": per_function,
                "store": self.metrics.store(training)}

    @staticmethod
    def rollout_columns(rollout, completions: list, columns: dict) -> list:
        """What agent rollouts give the reward functions: their messages as the completions (tool calls and results
        included), their `environments` and a rollout function's extra columns (into `columns`)."""
        if rollout.environments is not None:
            columns["environments"] = rollout.environments
        columns.update(rollout.extra_columns)
        return completions if rollout.completions is None else rollout.completions

    # --- scored micro-batches --------------------------------------------------------------------------------------

    def scored_batches(self, rows, completion_ids, scored: dict, micro_size: int, group: int,
                       policy_logps: bool, rollout=None) -> list[dict]:
        """The micro-batches of scored completions, with what the loss reads: log-probs, the method's inputs, item
        counts."""
        prompt_ids = rollout.prompt_ids if rollout is not None else None
        mask = rollout.policy_mask if rollout is not None else None
        examples = self.scoring_examples(rows, completion_ids, scored["terminated"], prompt_ids, mask)
        parts = [examples[i:i + micro_size] for i in range(0, len(rows), micro_size)]
        batches = [{**self.collate(part), EXAMPLES: KeptExamples(part)} for part in parts]  # for oom_retry's parts
        for batch in batches:
            batch["num_sequences"] = torch.tensor(micro_size)
        if self.session.sampling.logprobs:
            logprobs = rollout.logprobs if rollout is not None else getattr(completion_ids, "logprobs", None)
            if logprobs is not None and mask is not None:  # only the policy's own tokens are targets
                logprobs = [[v for v, m in zip(lp, row_mask) if m] for lp, row_mask in zip(logprobs, mask)]
            self.attach_sampling_logps(batches, examples, logprobs, micro_size)
        if policy_logps or self.scoring.reference is not None:
            self.attach_logps(batches, policy_logps)
        self.hooks.attach_loss_inputs(batches, scored, group)
        for batch in batches:
            batch["loss_items"] = self.hooks.loss_items(batch)
        return batches

    def spread(self, batches: list[dict], key: str, values: torch.Tensor) -> None:
        """Round-wide per-completion values (all processes) into each micro-batch's own completions, as `key`."""
        local = self.share.own(values)
        for i, batch in enumerate(batches):
            size = int(batch["num_sequences"])
            batch[key] = local[i * size:(i + 1) * size]

    def scoring_examples(self, rows, completion_ids, terminated, prompt_ids=None, policy_mask=None) -> list[dict]:
        """Prompt + completion rows whose targets are the completion's tokens; with `policy_mask` (agent rollouts)
        only the tokens the policy sampled, not tool results."""
        prompts = [row[PROMPT_IDS] for row in rows] if prompt_ids is None else prompt_ids
        prompts = self.hooks.scored_prompts(prompts, completion_ids)
        examples, masked = [], 0
        for prompt, completion, done, i in zip(prompts, completion_ids, terminated, range(len(rows))):
            keep = done or not self.settings.mask_truncated_completions
            masked += not keep
            own = [1] * len(completion) if policy_mask is None else policy_mask[i]
            examples.append(prompt_completion_row(list(prompt), completion, [int(keep) * m for m in own]))
            examples[-1]["prompt_length"] = len(prompt)  # where the shared-prompt layout (SharedPromptCollator) cuts it
        if masked:
            self.metrics.counts["truncated_completions_masked"] += masked
        return examples

    def attach_sampling_logps(self, batches: list[dict], examples: list[dict], logprobs, micro_size: int) -> None:
        """Per-target log-probs of the engine that sampled the completions ("sampling_logps"), in the flat target
        order of each micro-batch: every kept completion's tokens, completion after completion."""
        name = self.session.open_backend().name
        if logprobs is None:
            raise RuntimeError(f"The {name} generation backend returned no sampling log-probs.")
        for i, batch in enumerate(batches):
            part = range(i * micro_size, (i + 1) * micro_size)
            values = [v for j in part if any(examples[j]["completion_mask"]) for v in logprobs[j]]
            batch["sampling_logps"] = torch.tensor(values, dtype=torch.float32)
            if len(values) != self.targets.count(batch):
                raise RuntimeError(f"{len(values)} sampling log-probs for {self.targets.count(batch)} "
                                   f"completion tokens from the {name} generation backend.")

    @torch.no_grad()
    def attach_logps(self, batches: list[dict], policy_too: bool) -> None:
        """Per-target log-probs of the generation-time policy ("old_logps") and of the reference ("ref_logps")."""
        scoring = self.scoring
        model = scoring.policy()
        was_training = model.training
        model.eval()  # no dropout while scoring: the same log-probs the loss would see without it
        try:
            for batch in batches:
                # under context parallelism each process scores its part of every sequence, inside the ring
                ring, placed = scoring.lay_out(model, batch)
                with ring():
                    on_device = placed()  # inside the ring: its split is what the model reads
                    if policy_too:
                        self.hooks.attach_policy_scores(batch, model, on_device)
                    if scoring.reference is not None:
                        with scoring.reference() as reference_model:
                            batch["ref_logps"] = self.scored_logps(reference_model, on_device)
        finally:
            model.train(was_training)

    def scored_logps(self, model, batch: dict) -> torch.Tensor:
        """Per-target log-probs of the micro-batch, in its flat target order (a batch laid out for context
        parallelism: this process's targets scored, the whole batch's put together over the group)."""
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        scoring, split = self.scoring, ORDINAL_KEY in batch
        if split:
            scoring.ring.check_layout(inputs)
        scores = scoring.target_logprobs(model, inputs, self.targets.targets(batch), scoring.temperature)
        if not split:
            return scores.logps.detach()
        ring = scoring.ring
        return ring.whole_order(scores.logps, ring.target_ordinals(batch, scores.targets), int(ring.batch_targets))

def eos_penalised(scored: dict, penalty: float | None) -> torch.Tensor:
    """The round's rewards minus `penalty` (missing_eos_penalty) for a completion that did not end in EOS."""
    return scored["rewards"] - penalty * (~scored["ended"]).float() if penalty else scored["rewards"]

# --- the rounds' prompts: the train loader of rounds --------------------------------------------------------


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


def as_rows(rows: list[dict]) -> list[dict]:
    """The collate function of rounds: a round is its prompt rows as they are."""
    return rows


def row_batches(dataset, size: int):
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


def round_loader(dataset, prompts_per_round: int, repeats: int, args) -> RoundLoader:
    """The train loader of rounds: `prompts_per_round` prompts, each round yielded `repeats` times (a stream's:
    `stream_round_loader`, chosen when the trainer is built by data/streaming.py's `is_stream`)."""
    if len(dataset) < prompts_per_round:
        raise ValueError(f"The train dataset has {len(dataset)} prompts, fewer than one generation "
                         f"round needs ({prompts_per_round}).")
    left_out = len(dataset) % prompts_per_round
    if left_out:
        logger.info("%d of %d prompts per epoch fall in an incomplete last round and are left out of that epoch.",
                    left_out, len(dataset))
    sampler = RoundSampler(len(dataset), prompts_per_round, repeats, args.shuffle_dataset, args.seed)
    return RoundLoader(dataset, batch_sampler=sampler, collate_fn=as_rows, num_workers=args.dataloader_num_workers)


def stream_round_loader(stream, prompts_per_round: int, repeats: int, args) -> RoundLoader:
    """`round_loader` for a stream of prompts (`StreamRounds`), read by the main process."""
    if args.dataloader_num_workers:
        logger.info("A streamed train set is read in rounds by the main process (worker processes would split "
                    "its generation groups): dataloader_num_workers=%d is not used.", args.dataloader_num_workers)
    rounds = StreamRounds(stream, prompts_per_round, repeats, args.shuffle_dataset, args.seed)
    return RoundLoader(rounds, batch_size=None, collate_fn=as_rows)
