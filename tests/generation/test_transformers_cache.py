"""transformers generation kept warm: each sampling's GenerationConfig built once, and the KV cache resolved once
(TRL's `cache_implementation`; unset: the static cache on a CUDA device, where transformers compiles the decode step).

A static cache must sample what the dynamic one samples: checked here on CPU, greedily, on two real architectures
with left-padded prompts of different lengths (transformers compiles nothing on CPU: the same cache, run eagerly)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from leantune import GRPOConfig
from leantune.generation.backend import backend_factory
from leantune.generation.sampling import SamplingSettings
from leantune.generation.transformers_backend import CACHE_BUCKET, TransformersBackend, resolve_cache_implementation
from leantune.trainers.settings import generation_of

from ..fixtures.models import tiny_model

PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 50, 51], [1, 60, 61, 62, 63], [1, 70]]  # left-padded: 9, 3, 5, 2


def greedy(max_new_tokens: int = 12, **extra) -> SamplingSettings:
    # no EOS: every row runs the whole length, so each decode step reads the cache of every row
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0, pad_token_id=0, logprobs=False,
                            extra=extra)


@pytest.mark.quick
def test_the_cache_is_static_on_cuda_for_a_plain_module_else_the_models_own():
    assert resolve_cache_implementation(None, "cuda", plain_module=True) == "static"
    assert resolve_cache_implementation(None, torch.device("cuda", 1), plain_module=True) == "static"
    assert resolve_cache_implementation(None, "cpu", plain_module=True) is None  # no compile on CPU: dynamic stays
    assert resolve_cache_implementation(None, "cuda", plain_module=False) is None  # ZeRO-3, FSDP, a ring
    assert resolve_cache_implementation("dynamic", "cuda", plain_module=True) == "dynamic"  # as the user set it
    assert resolve_cache_implementation("static", "cpu", plain_module=True) == "static"
    # the run's backend gets the resolved cache once, from the config (a CPU accelerator: the model's own)
    configs = {requested: GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], cache_implementation=requested)
               for requested in (None, "static")}  # before the Accelerator: a TrainingArguments resets its state
    accelerator = Accelerator(cpu=True)
    for requested, expected in ((None, None), ("static", "static")):
        generation = generation_of(configs[requested])  # the resolver reads the field (trainers/settings.py)
        backend = backend_factory(generation.engine, configs[requested], None, accelerator,
                                  generation.cache_implementation)(tiny_model())
        assert backend.cache_implementation == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_static_cache_generates_the_dynamic_caches_tokens(arch):
    model = tiny_model(arch).eval()
    accelerator = Accelerator(cpu=True)
    dynamic = TransformersBackend(model, accelerator).generate(PROMPTS, greedy())
    static_backend = TransformersBackend(model, accelerator, cache_implementation="static")
    static = static_backend.generate(PROMPTS, greedy())
    assert [len(ids) for ids in dynamic] == [12] * len(PROMPTS)
    assert list(static) == list(dynamic)  # token for token (integers: exact)
    # the cache's length: the longest prompt + new tokens rounded up to the bucket, kept by transformers for later
    # calls (a shorter round reuses the shape, so a compiled decode step is not compiled again)
    assert model._previous_max_cache_length == CACHE_BUCKET
    assert list(static_backend.generate(PROMPTS[1:], greedy())) == list(dynamic)[1:]
    assert model._previous_max_cache_length == CACHE_BUCKET
    # in pieces (`max_completions_per_generate`): the same tokens too
    pieces = TransformersBackend(model, accelerator, max_batch_size=2, cache_implementation="static")
    assert list(pieces.generate(PROMPTS, greedy())) == list(dynamic)


def test_a_samplings_generation_config_is_built_once_and_samples_as_generate_does():
    """The backend's reused GenerationConfig draws what `generate` draws from the same keywords, seed for seed."""
    model = tiny_model().eval()
    backend = TransformersBackend(model, Accelerator(cpu=True))
    sampling = SamplingSettings(max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1,
                                pad_token_id=0, eos_token_ids=(2,), logprobs=False,
                                extra={"min_new_tokens": 8, "suppress_tokens": [3, 4]})
    built = []
    for seed in (5, 6):
        drawn = backend.generate(PROMPTS, SamplingSettings(**{**sampling.__dict__, "seed": seed}))
        built.append(next(iter(backend.configs.values()))[0])
        torch.manual_seed(seed)
        width = max(map(len, PROMPTS))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
        with torch.no_grad():
            expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                                      temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1, pad_token_id=0,
                                      eos_token_id=[2], use_cache=True, min_new_tokens=8, suppress_tokens=[3, 4])
        assert list(drawn) == expected[:, width:].tolist()
    assert len(backend.configs) == 1 and built[0] is built[1]  # two rounds (two seeds), one config
    backend.generate(PROMPTS, greedy(4))
    assert len(backend.configs) == 2  # another sampling (an agent's turn, an eval round): its own


def test_cache_implementation_is_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match="cache_implementation"):
        GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], cache_implementation="statik")
    with pytest.raises(ValueError, match="cache_implementation.*vLLM"):
        GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], cache_implementation="static", use_vllm=True)
