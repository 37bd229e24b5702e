"""A generation round: what it asks of any backend (`SamplingSettings`: how many new tokens and how to sample them,
TRL's field names), what it gets back (`Completions`), and the session that runs the run's one backend round after
round (`GenerationSession`).

The session: one backend for the run (transformers, vLLM colocated or a vLLM server, chosen once from the config),
the policy's weights synced to it once per optimizer step, sleep mode around each call, and a seed per round and
data-parallel process, so no two rounds or data-parallel processes draw the same samples. Under context parallelism
the processes of a group generate one round together (`in_group`): the same prompts, the same seed, the masks of
their left-padded prompts kept (the ring's hooks suspended), and its first process's completions taken by all."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("leantune.online")

TRANSFORMERS, VLLM_COLOCATE, VLLM_SERVER = "transformers", "vllm_colocate", "vllm_server"  # the engines (backend.py)


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None or 0: no top-k filter
    min_p: float | None = None
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # generation_kwargs, passed through to the backend as they are
    # Set by the trainer per round and process: completion i of the round samples with seed + i, so processes (and
    # the repeats of one prompt on one process) never draw the same sample stream; None: the backend's own RNG.
    seed: int | None = None
    # Return each sampled token's log-probability under the distribution it was drawn from (`Completions.logprobs`):
    # the logits after temperature, top-k/top-p/min-p filtering and repetition penalty (vLLM's "processed" log-probs).
    logprobs: bool = True

    @classmethod
    def from_config(cls, args, tokenizer, model=None) -> SamplingSettings:
        """The tokenizer's EOS and the model's generation-config EOS ids (chat models end turns with their own)."""
        eos_ids = eos_token_ids(tokenizer, model)
        return cls(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or None,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            eos_token_ids=eos_ids,
            pad_token_id=tokenizer.pad_token_id,
            extra=dict(args.generation_kwargs or {}),
            logprobs=bool(getattr(args, "needs_sampling_logprobs", False)),  # read only by GRPO's vLLM correction
        )


def eos_token_ids(tokenizer, model=None) -> tuple[int, ...]:
    """The tokenizer's EOS and the model's generation-config EOS ids (chat models end turns with their own)."""
    eos_ids = _ids(tokenizer.eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        eos_ids += tuple(i for i in _ids(generation_config.eos_token_id) if i not in eos_ids)
    return eos_ids


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


class Completions(list):
    """What `generate` returns: the completions' token ids (a list of lists, compared and sliced as one) and, in
    `logprobs`, one list per completion of its tokens' sampling log-probs (float('nan') where the engine reported
    none), or None when the sampling settings did not ask for them."""

    def __init__(self, ids=(), logprobs: list[list[float]] | None = None):
        super().__init__(ids)
        if logprobs is not None and [len(lp) for lp in logprobs] != [len(t) for t in self]:
            raise ValueError(f"sampling log-probs do not match the completions' lengths: "
                             f"{[len(lp) for lp in logprobs]} vs {[len(t) for t in self]}")
        self.logprobs = logprobs


def cut_completion(tokens: list[int], logprobs: list[float] | None, sampling: SamplingSettings):
    """A completion and its log-probs cut at max_new_tokens and after the first EOS (the same tokens kept)."""
    kept = cut_at_eos(list(tokens)[: sampling.max_new_tokens], sampling.eos_token_ids)
    return kept, None if logprobs is None else [float(v) for v in logprobs[: len(kept)]]


def cut_at_eos(tokens: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """A completion ends at (and keeps) its first EOS token; what a backend produced after it is dropped."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


class GenerationSession:
    """Generates for the trainer from its own settings (`GenerationSettings`, trainers/settings.py) and `sampling`;
    `new_backend(model)` makes the run's backend (backend.py's `backend_factory`, chosen once); `policy` and `step`
    read the trainer's wrapped model and optimizer step now; `rank`: this process's data-parallel rank; `in_group`:
    under context parallelism, how its group generates one round together (trainers/parts/context_parallel.py's
    `generate_in_group`)."""

    def __init__(self, settings, sampling: SamplingSettings, new_backend, accelerator, policy, step, method: str,
                 rank: int = 0, in_group: Callable | None = None):
        self.settings, self.sampling, self.new_backend = settings, sampling, new_backend
        self.engine = settings.engine
        self.accelerator, self.policy, self.step, self.method = accelerator, policy, step, method
        # each round's seed: the run's, the round's count and this data-parallel process's rank (fixed for the run)
        self.own_seed = settings.seed + 65_537 * rank
        self.in_group = in_group  # context parallelism: (model, generate) -> the group's one round; None without
        self.backend = None  # a vLLM engine: made at the first round (the Trainer wraps the model first)
        self.synced_step = -1
        self.rounds_generated = 0
        if not self.samples_with_vllm:
            # transformers generates from the training model itself (synced to its wrapped form at each step's
            # first round): made now with the run's GenerationConfig, so a generation setting transformers refuses
            # fails when the trainer is built, and no round builds what every round shares
            self.open_backend().prepare(sampling)

    @property
    def samples_with_vllm(self) -> bool:
        """vLLM samples (its log-probs differ from the trainer's); transformers samples from the trained model."""
        return self.engine != TRANSFORMERS

    def context_limit(self, model_limit: int | None) -> int | None:
        """The longest prompt + completion the engine takes: the model's, or vLLM's own `vllm_max_model_length`."""
        engine_limit = self.settings.vllm_max_model_length if self.samples_with_vllm else None
        if engine_limit:
            return min(model_limit or engine_limit, engine_limit)
        return model_limit

    def open_backend(self):
        if self.backend is None:
            self.backend = self.new_backend(self.policy())
            logger.info("%s generation backend: %s.", self.method.upper(), self.backend.name)
        return self.backend

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings, seed: int | None = None) -> Completions:
        backend = self.open_backend()
        backend.wake_up()
        step = self.step()
        if self.synced_step != step or getattr(backend, "needs_sync", False):
            backend.sync_weights(self.policy())
            self.synced_step = step
        self.rounds_generated += 1
        own = self.own_seed + 1_000_003 * self.rounds_generated
        sampling = dataclasses.replace(sampling, seed=own if seed is None else seed)  # the round's, or GKD's own
        if self.in_group is not None:  # one round per context-parallel group
            completions = self.in_group(self.policy(), lambda: backend.generate(prompt_ids, sampling))
        else:
            completions = backend.generate(prompt_ids, sampling)
        backend.sleep()
        return completions

    def generate_turn(self, prompt_ids: list[list[int]], max_new_tokens: int) -> Completions:
        """One turn of the agent's rollouts, through the same backend as single turns."""
        sampling = dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens)
        if prompt_ids:
            return self.generate(prompt_ids, sampling)
        # Nothing left here while other processes go on: generate in step with them (a backend call may gather
        # weights across processes), one token for a dummy prompt, and keep nothing.
        self.generate([[self.sampling.eos_token_ids[0] if self.sampling.eos_token_ids else 0]],
                      dataclasses.replace(sampling, max_new_tokens=1))
        return Completions([], [] if sampling.logprobs else None)

    def step_together(self, wants_more: bool) -> bool:
        """Whether any process's rollouts want another turn (one process: its own answer)."""
        if self.accelerator.num_processes == 1:
            return wants_more
        flag = torch.tensor([int(wants_more)], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).any())
