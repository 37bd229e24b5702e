"""The interface every generation backend implements, and the choice of backend from the config.

The online trainer calls, once per generation round:

    backend.wake_up()            # vLLM colocate with sleep mode: weights and KV cache back on the GPU
    backend.sync_weights(model)  # when the policy changed since the last round (no-op for transformers)
    completions = backend.generate(prompt_ids, sampling)
    backend.sleep()              # before the optimisation steps (no-op unless vllm_enable_sleep_mode)

`generate` takes token ids (one list per completion to produce: a prompt appears once per generation of it) and
returns `Completions`: the completion ids of each (a list of lists), cut after the first EOS token
(`sampling.cut_at_eos`), at most `sampling.max_new_tokens` long, and, with `sampling.logprobs`, in `.logprobs` each
token's log-prob under the distribution it was sampled from (GRPO's vLLM importance-sampling correction reads them).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Protocol

from accelerate.utils import DistributedType

from .sampling import TRANSFORMERS, VLLM_COLOCATE, Completions, SamplingSettings
from .transformers_backend import TransformersBackend, resolve_cache_implementation
from .vllm_client import VLLMServerBackend
from .vllm_colocate import VLLMColocateBackend, require_colocated_vllm
from .zero3 import gathered_for_generation, is_zero3


class GenerationBackend(Protocol):
    name: str

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> Completions: ...

    def sync_weights(self, model) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...



def check_backend_requirements(engine: str, sleep_mode: bool) -> None:
    """Fail when the trainer is built, not at the first generation round, if the chosen backend (`engine`, one of
    sampling.py's engine names: trainers/settings.py's `generation_engine`) cannot run here."""
    if engine == VLLM_COLOCATE:
        require_colocated_vllm(sleep_mode=sleep_mode)


def backend_factory(engine: str, args, tokenizer, accelerator, cache_implementation: str | None = None):
    """What makes the run's backend from the policy (`factory(model)`), chosen once from the config when the trainer
    is built (the backend itself is made at the first round: the Trainer wraps the model first). transformers
    `generate` by default, its weights gathered once per call under ZeRO-3 (`ds3_gather_for_generation`, zero3.py;
    elsewhere no gathering scope at all); vLLM in this process (`vllm_mode="colocate"`) or a `leantune vllm-serve`
    server (`vllm_mode="server"`) with `use_vllm=True`: `engine`, one of sampling.py's engine names.
    `cache_implementation`: TRL's setting of transformers' KV cache, from the generation settings
    (trainers/settings.py), resolved here once."""
    if engine == TRANSFORMERS:
        gathers = args.ds3_gather_for_generation and is_zero3(accelerator)
        scope = functools.partial(gathered_for_generation, accelerator=accelerator) if gathers \
            else contextlib.nullcontext
        cache = resolve_cache_implementation(cache_implementation, accelerator.device, plain_module(accelerator))
        return functools.partial(TransformersBackend, accelerator=accelerator,
                                 max_batch_size=args.max_completions_per_generate, generation_scope=scope,
                                 cache_implementation=cache)
    backend = VLLMColocateBackend if engine == VLLM_COLOCATE else VLLMServerBackend
    return functools.partial(backend, args, tokenizer=tokenizer, accelerator=accelerator)


def plain_module(accelerator) -> bool:
    """The policy is one whole module between generate calls: not sharded (ZeRO-3, FSDP), no context-parallel ring
    (whose hooks are suspended for generation)."""
    config = getattr(accelerator, "parallelism_config", None)
    ring = config is not None and config.cp_enabled
    return not (is_zero3(accelerator) or accelerator.distributed_type == DistributedType.FSDP or ring)


def make_backend(engine: str, args, model, tokenizer, accelerator,
                 cache_implementation: str | None = None) -> GenerationBackend:
    """The run's backend for `model` (see `backend_factory`)."""
    return backend_factory(engine, args, tokenizer, accelerator, cache_implementation)(model)
