"""An online method's generation round in the plan (planning/generation_round.py): transformers' KV cache figure
against a real `generate` measured at the CPU allocator, and the plan's peak the larger of round and update step."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from devkit.allocator_meter import block_peak
from leantune.planning.generation_round import GenerationRound, decode_logits_bytes, generation_round, kv_cache_bytes
from leantune.planning.planner import MemoryPlan, TracedStep


def test_kv_cache_figure_matches_a_measured_generate():
    # 4 layers, 4 KV heads of 32: a 16 x 128-token cache of 4.5 MiB, which the round's other tensors (one step's
    # hidden states and logits of a 1k vocabulary) barely add to, so the figure is checked nearly alone
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    batch, prompt, completion = 16, 8, 120
    ids = torch.randint(3, config.vocab_size, (batch, prompt))
    measured = {}
    with torch.no_grad(), block_peak(measured):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=completion,
                       min_new_tokens=completion, do_sample=False, eos_token_id=None, pad_token_id=0)
    planned = kv_cache_bytes(config, batch, prompt + completion, torch.float32) + decode_logits_bytes(
        config, batch, torch.float32)
    # measured 0.6% below (the cache holds prompt + completion - 1 positions: the last token is never run)
    assert abs(planned / measured["peak_bytes"] - 1) < 0.03, (planned, measured["peak_bytes"])


def test_plan_peak_is_the_larger_of_round_and_update_step():
    config = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    shape = {"batch": 32, "prompt_length": 1024, "max_completion_length": 1024, "use_vllm": False,
             "sleep_mode": False}
    held = 10 * 2**20
    round_ = generation_round(config, shape, torch.bfloat16, held, 1_000_000)
    # per layer keys and values: 2 x 32 x 2 heads x 2048 tokens x 16 dims x 2 bytes; one layer's keys once more
    assert round_.kv_cache_bytes == 2 * 2 * 32 * 2 * 2048 * 16 * 2 + 32 * 2 * 2048 * 16 * 2
    assert round_.decode_logits_bytes == 32 * 32000 * (2 + 4)
    assert round_.peak_bytes == held + round_.kv_cache_bytes + round_.decode_logits_bytes
    step = TracedStep(held + 2**20, {"parameters": held}, "a batch")
    plan = MemoryPlan("GRPO", "tiny", 1, 1, 1, "ddp", step, None, generation=round_)
    assert plan.peak_bytes == round_.peak_bytes > step.peak_bytes
    assert any(line.startswith("generation round (transformers, 32 sequences") for line in plan.lines())
    plan.generation = GenerationRound("transformers", 1, 2, 0, 0, held)
    assert plan.peak_bytes == step.peak_bytes  # a round smaller than the step leaves the step's peak
    sleeping = generation_round(config, {**shape, "use_vllm": True, "sleep_mode": True}, torch.bfloat16, held, 10**6)
    assert sleeping.kv_cache_bytes == 0 and sleeping.host_copy_bytes == 2 * 10**6  # vLLM's pool: a device term


def test_largest_completion_length_within_a_budget():
    """The bisection over the round's real figure (a length's device total grows with it): the answer fits and one
    token more does not, in about log2(limit) plans."""
    from leantune.planning.completion_length import solve_max_completion_length

    config = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    shape = {"batch": 16, "prompt_length": 100, "use_vllm": False, "sleep_mode": False}

    def total(length):
        return generation_round(config, {**shape, "max_completion_length": length}, torch.float32, 2**20, 1).peak_bytes

    budget = total(700) + 1
    solved = solve_max_completion_length(total, budget, limit=2048 - 100, start=512, start_total=total(512))
    assert solved.length == 700 and solved.fitting_total <= budget < solved.next_total == total(701)
    assert solved.plans <= 13 and "largest max_completion_length" in solved.lines()[0]
    assert solve_max_completion_length(total, total(1) - 1, limit=1948).length is None
    assert solve_max_completion_length(total, total(1948), limit=1948).length == 1948
