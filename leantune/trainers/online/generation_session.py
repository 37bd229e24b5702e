"""The generation side of the online rounds: one backend for the run (transformers, vLLM colocated or a vLLM server,
chosen once from the config), the policy's weights synced to it once per optimizer step, sleep mode around each
call, and a seed per round and data-parallel process, so no two rounds or data-parallel processes draw the same
samples. Under context parallelism the processes of a group generate one round together: the same prompts, the
same seed, the masks of their left-padded prompts kept (the ring's hooks suspended), and its first process's
completions taken by all."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ...generation import Completions, SamplingSettings
from ...generation.backend import TRANSFORMERS
from ..parts.context_parallel import cp_size_of, data_parallel_place, generate_in_group

logger = logging.getLogger("leantune.online")


class GenerationSession:
    """Generates for the trainer from its own settings (`GenerationSettings`, trainers/settings.py) and `sampling`;
    `new_backend(model)` makes the run's backend (generation/backend.py's `backend_factory`, chosen once); `policy`
    and `step` read the trainer's wrapped model and optimizer step now."""

    def __init__(self, settings, sampling: SamplingSettings, new_backend, accelerator, policy, step, method: str):
        self.settings, self.sampling, self.new_backend = settings, sampling, new_backend
        self.engine = settings.engine
        self.accelerator, self.policy, self.step, self.method = accelerator, policy, step, method
        # each round's seed: the run's, the round's count and this data-parallel process's rank (fixed for the run)
        self.own_seed = settings.seed + 65_537 * data_parallel_place(accelerator)[0]
        self.in_group = cp_size_of(accelerator) > 1  # context parallelism: a group generates one round together
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
        if self.in_group:  # one round per context-parallel group
            completions = generate_in_group(self.accelerator, self.policy(), lambda: backend.generate(prompt_ids,
                                                                                                        sampling))
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
