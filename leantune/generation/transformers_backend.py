"""Generation with transformers' `generate`, from the training model itself (the default; runs on CPU).

The policy generates in eval mode (no dropout, no activation checkpointing) with the KV cache on, on left-padded
prompts, and goes back to training mode after. Nothing needs syncing: it is the training model.

Sampling log-probs (`sampling.logprobs`) come from generate's `scores`: the logits after every processor and
warper (repetition penalty, temperature, top-k/top-p/min-p), i.e. the distribution each token was drawn from, log-
softmaxed at the drawn token. `scores` holds [new tokens, rows, vocabulary] fp32 until the call ends.

Rows are generated `max_batch_size` at a time (the online trainers' `max_completions_per_generate`), which bounds the
KV cache and `scores` by the piece instead of the round. One seed per call: the pieces draw one after another from
the stream it starts, so a call is deterministic for its seed and piece size; a piece's rows are not the tokens that
one unsplit call would draw (each decode step's draws depend on the rows sampled together and on how long the
slowest row runs), only tokens from the same distribution.

Kept warm across rounds: each sampling's `GenerationConfig` is built once (the run's own when the trainer is built:
`prepare`), and the KV cache is TRL's `cache_implementation`, resolved once (`resolve_cache_implementation`): unset,
transformers' static cache where the policy is one plain module on a CUDA device. There transformers compiles the decode step (its shapes no longer grow
token by token), and the cache's length is rounded up to `CACHE_BUCKET` tokens and never shrinks (transformers keeps
the longest so far), so later rounds meet shapes already compiled instead of a new prompt width each round. On CPU
the model's own dynamic cache stays: transformers compiles nothing there, and a static cache alone attends over its
whole length each step. A static cache samples the same tokens as the dynamic one (tests/generation/).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging

import torch

from .sampling import Completions, SamplingSettings, cut_completion

logger = logging.getLogger("leantune.generation")

STATIC = "static"
STATIC_CACHES = (STATIC, "offloaded_static")  # transformers' fixed-length caches (their length set per call here)
CACHE_BUCKET = 256  # a static cache's length, rounded up to a multiple of this: few shapes over a run's rounds


def resolve_cache_implementation(requested: str | None, device, plain_module: bool) -> str | None:
    """The KV cache transformers' generate runs with: TRL's `cache_implementation` when set; unset, the static cache
    (its decode step compiled by transformers) on a CUDA device for a `plain_module` policy (not sharded by ZeRO-3 or
    FSDP, no context-parallel ring: their weights or hooks change between calls), else None (the model's own)."""
    if requested is not None:
        return requested
    return STATIC if torch.device(device).type == "cuda" and plain_module else None


class TransformersBackend:
    name = "transformers"

    def __init__(self, model, accelerator, max_batch_size: int | None = None, generation_scope=contextlib.nullcontext,
                 cache_implementation: str | None = None):
        """`generation_scope(model)`: what the calls run inside (under ZeRO-3 the weights gathered once per call:
        zero3.py, chosen by backend.py's `backend_factory`; otherwise nothing). `cache_implementation`: the KV cache
        (`resolve_cache_implementation`'s; None: the model's own)."""
        self.accelerator = accelerator
        self.generation_scope = generation_scope
        self.max_batch_size = max_batch_size
        self.model = model
        self.cache_implementation = cache_implementation
        self.configs: dict[str, object] = {}  # each sampling's GenerationConfig, built at its first call
        logger.info("transformers generation: %s KV cache%s.", cache_implementation or "the model's default",
                    ", the decode step compiled by transformers on CUDA" if cache_implementation in STATIC_CACHES else "")

    def prepare(self, sampling: SamplingSettings) -> None:
        """Build `sampling`'s GenerationConfig now: the generation session calls it when the trainer is built."""
        self.generation_config(self.accelerator.unwrap_model(self.model), sampling)

    def sync_weights(self, model) -> None:
        self.model = model

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> Completions:
        model = self.model
        was_training = model.training
        model.eval()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.random.fork_rng(devices=devices, enabled=sampling.seed is not None), \
                    self.generation_scope(model):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)  # the round's own stream; each row samples its own tokens
                generator = self.accelerator.unwrap_model(model)  # a PEFT model stays one (its generate)
                step = self.max_batch_size or len(prompt_ids)
                ids, logprobs = [], []
                for start in range(0, len(prompt_ids), step):
                    for tokens, token_logprobs in self._generate_batch(generator, prompt_ids[start:start + step],
                                                                       sampling):
                        ids.append(tokens)
                        logprobs.append(token_logprobs)
                return Completions(ids, logprobs if sampling.logprobs else None)
        finally:
            model.train(was_training)

    def _generate_batch(self, model, prompt_ids: list[list[int]], sampling: SamplingSettings):
        """(tokens, their sampling log-probs or None) per prompt."""
        device = next(model.parameters()).device
        width = max(len(ids) for ids in prompt_ids)
        pad = sampling.pad_token_id if sampling.pad_token_id is not None else 0
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        per_call = {}
        if self.cache_implementation in STATIC_CACHES:
            per_call["max_cache_len"] = -(-(width + sampling.max_new_tokens) // CACHE_BUCKET) * CACHE_BUCKET
        config, model_kwargs = self.generation_config(model, sampling)
        output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                generation_config=config, **model_kwargs, **per_call)
        sequences = output.sequences if sampling.logprobs else output
        new_tokens = sequences[:, width:]
        logprobs = [None] * len(prompt_ids)
        if sampling.logprobs:
            logprobs = sampled_logprobs(output.scores, new_tokens).tolist()
        return [cut_completion(tokens, token_logprobs, sampling)
                for tokens, token_logprobs in zip(new_tokens.tolist(), logprobs)]


    def generation_config(self, model, sampling: SamplingSettings):
        """`sampling`'s GenerationConfig (the model's own, updated) and model keywords, built at its first call and
        reused (the seed is the round's RNG stream, not part of it)."""
        key = repr(dataclasses.replace(sampling, seed=None))
        config = self.configs.get(key)
        if config is None:
            config = self.configs[key] = generation_config_for(model, sampling, self.cache_implementation)
        return config


def generation_config_for(model, sampling: SamplingSettings, cache_implementation: str | None):
    """The model's generation config with `sampling`'s settings (its `extra`: generation_kwargs, last, as given), and
    what of them is no generation setting (passed to `generate` as model keywords, as generate does)."""
    kwargs = {
        "max_new_tokens": sampling.max_new_tokens,
        "do_sample": sampling.temperature > 0,  # temperature 0: greedy, as in vLLM
        "temperature": sampling.temperature or None,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k or 0,
        "repetition_penalty": sampling.repetition_penalty,
        "pad_token_id": sampling.pad_token_id if sampling.pad_token_id is not None else 0,
        "eos_token_id": list(sampling.eos_token_ids) or None,
        "use_cache": True,
    }
    if sampling.min_p is not None:
        kwargs["min_p"] = sampling.min_p
    if cache_implementation is not None:
        kwargs["cache_implementation"] = cache_implementation
    kwargs.update(sampling.extra)
    if sampling.logprobs:
        kwargs.update(output_scores=True, return_dict_in_generate=True)
    config = copy.deepcopy(model.generation_config)
    model_kwargs = config.update(**kwargs)
    return config, model_kwargs


def sampled_logprobs(scores: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
    """[rows, steps] log-probs of the drawn tokens under generate's processed scores (one [rows, vocab] per step)."""
    if not scores:
        return tokens.new_zeros(tokens.shape, dtype=torch.float32)
    columns = [torch.log_softmax(step.float(), dim=-1).gather(-1, tokens[:, i:i + 1].to(step.device)).squeeze(-1)
               for i, step in enumerate(scores)]
    return torch.stack(columns, dim=1).cpu()
