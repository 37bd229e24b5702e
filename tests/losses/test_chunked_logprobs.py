"""The chunked head (log-probs from hidden states, chunk by chunk) equals the plain full-logits computation.

Tolerance: relative difference <= 1e-5 in fp32 (max abs difference over max magnitude), forward and gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leantune.losses.token_logprobs import (
    chunked_logprobs,
    logprobs_from_logits,
    select_targets,
    token_stats_from_logits,
)
from leantune.metrics.memory_breakdown import StepMemoryMeter
from leantune.models.output_head import DDPOutputHead, OutputHead

from ..fixtures.comparisons import rel_diff
from ..fixtures.models import tiny_model

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

RTOL = 1e-5
VOCAB = 1000


def small_config_model(kind: str):
    """Architectures whose heads differ: tied embeddings, soft-capping, a logit scale."""
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "gemma2_softcap":
        model = Gemma2ForCausalLM(Gemma2Config(**common, head_dim=8, final_logit_softcapping=3.0,
                                               attn_implementation="eager"))
    elif kind == "cohere_scale":
        model = CohereForCausalLM(CohereConfig(**common, logit_scale=0.37))
    elif kind == "qwen2_tied":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
        assert model.lm_head.weight is model.model.embed_tokens.weight
    elif kind == "llama":
        model = tiny_model("llama", vocab_size=VOCAB)
    else:
        raise ValueError(kind)
    return model.float()


def batch(seed: int = 0, rows: int = 3, length: int = 37):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    labels = input_ids.clone()
    labels[0, :11] = -100  # a prompt
    labels[-1, length - 9:] = -100  # padding at the end
    return input_ids, labels


def full_path(model, input_ids, labels, temperature=1.0):
    model.zero_grad()
    targets = select_targets(labels)
    logps = logprobs_from_logits(model(input_ids=input_ids).logits, targets, temperature)
    (logps * torch.linspace(0.5, 1.5, len(targets))).sum().backward()  # non-uniform weights, like DPO/GRPO
    return logps.detach(), grads(model)


def chunked_path(model, input_ids, labels, temperature=1.0, chunk_size=7):
    model.zero_grad()
    targets = select_targets(labels)
    head = OutputHead.of(model, temperature)
    with head.capture_hidden_states() as captured:
        outputs = model(input_ids=input_ids)
    assert outputs.logits.shape[-1] == 0  # the model computed no logits
    logps = chunked_logprobs(captured["hidden"], head, targets, chunk_size=chunk_size)
    (logps * torch.linspace(0.5, 1.5, len(targets))).sum().backward()
    return logps.detach(), grads(model)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(full, chunked):
    (logps_full, grads_full), (logps_chunked, grads_chunked) = full, chunked
    # per-token log-probs ~ -ln(1000) ~ -7: the head's matmul and logsumexp over 1000 logits in fp32 round to a few
    # ulps (~1e-7 relative) in either order; a wrong target, temperature or soft-cap moves them by >= 1e-2
    assert rel_diff(logps_chunked, logps_full) <= RTOL
    assert grads_full.keys() == grads_chunked.keys()
    for name in grads_full:  # relative to the largest entry of each gradient (sums over 91 targets); measured <= 1.1e-6
        assert rel_diff(grads_chunked[name], grads_full[name]) <= RTOL, name


@pytest.mark.parametrize("kind", ["llama", "qwen2_tied", "gemma2_softcap", "cohere_scale"])
def test_chunked_equals_full_forward_and_gradients(kind):
    model = small_config_model(kind)
    input_ids, labels = batch()
    assert_same(full_path(model, input_ids, labels), chunked_path(model, input_ids, labels))


def test_temperature_and_chunk_sizes():
    model = small_config_model("llama")
    input_ids, labels = batch(seed=1)
    full = full_path(model, input_ids, labels, temperature=0.7)
    for chunk_size in (1, 16, 10_000):
        assert_same(full, chunked_path(model, input_ids, labels, temperature=0.7, chunk_size=chunk_size))


def test_peft_wrapped_head_gets_the_same_gradients():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        small_config_model("llama"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0,
                   init_lora_weights=False),
    )
    head = OutputHead.of(model)
    assert type(head.module) is not torch.nn.Linear and head.trainable_parameters  # LoRA on the head itself
    input_ids, labels = batch(seed=2)
    full, chunked = full_path(model, input_ids, labels), chunked_path(model, input_ids, labels)
    assert any("lm_head" in name for name in chunked[1])
    assert_same(full, chunked)


def test_entropy_matches_full_logits():
    model = small_config_model("gemma2_softcap")
    input_ids, labels = batch(seed=3)
    targets = select_targets(labels)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.reshape(-1, VOCAB).index_select(0, targets.index).float()
        expected = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        head = OutputHead.of(model)
        with head.capture_hidden_states() as captured:
            model(input_ids=input_ids)
        # every other target made the argmax, so that the top-1 flags have both values
        hits = torch.arange(len(targets.tokens)) % 2 == 0
        targets = dataclasses.replace(targets, tokens=torch.where(hits, logits.argmax(-1), targets.tokens))
        _, entropy, top1, log_sum_sq = chunked_logprobs(captured["hidden"], head, targets, chunk_size=5,
                                                        with_entropy=True, stats=("top1", "log_sum_sq_probs"))
    assert rel_diff(entropy, expected) <= RTOL  # entropies ~ln(1000) ~ 7, fp32 sums over 1000 probabilities
    # the per-target statistics: argmax hits, and log sum p^2 (~ -ln 1000, the same fp32 sums), as from full logits
    full_top1, full_log_sum_sq = token_stats_from_logits(logits, targets.tokens, ("top1", "log_sum_sq_probs"))
    assert top1.dtype == torch.bool and torch.equal(top1, full_top1)
    assert top1[hits].all() and top1.sum() < len(top1)
    expected_sq = torch.log((torch.softmax(logits, -1) ** 2).sum(-1))
    assert rel_diff(log_sum_sq, expected_sq) <= RTOL and rel_diff(full_log_sum_sq, expected_sq) <= RTOL


@pytest.mark.parametrize("kind", ["llama", "gemma2_softcap", "cohere_scale"])
def test_entropy_gradient_matches_full_logits(kind):
    """An entropy bonus needs d(entropy)/d(weights): the chunked backward's -p (log p + H) term, through the head's
    scale, soft-cap and temperature, against autograd on the full logits, with log-prob weights beside it."""
    model = small_config_model(kind)
    input_ids, labels = batch(seed=4)
    targets = select_targets(labels)
    weights = torch.linspace(0.5, 1.5, len(targets))
    results = []
    for chunked in (False, True):
        model.zero_grad()
        if chunked:
            head = OutputHead.of(model, 0.7)
            with head.capture_hidden_states() as captured:
                model(input_ids=input_ids)
            logps, entropy = chunked_logprobs(captured["hidden"], head, targets, chunk_size=7, with_entropy=True,
                                              entropy_grad=True)
        else:
            logits = model(input_ids=input_ids).logits
            flat = logits.reshape(-1, VOCAB).index_select(0, targets.index).float() / 0.7
            logps = logprobs_from_logits(logits, targets, 0.7)
            entropy = -(torch.softmax(flat, -1) * torch.log_softmax(flat, -1)).sum(-1)
        ((logps * weights).sum() - 0.3 * (entropy * weights.flip(0)).sum()).backward()
        results.append((torch.cat([logps.detach(), entropy.detach()]), grads(model)))
    assert_same(*results)  # the same tolerance as the log-probs alone: entropies ~7, fp32 sums over 1000 terms
    # the entropy term is there: without it the gradients differ
    plain = chunked_path(model, input_ids, labels, temperature=0.7)[1]
    assert max(rel_diff(plain[name], results[1][1][name]) for name in plain) > 1e-3


def test_no_targets_gives_zero_loss_and_gradients():
    model = small_config_model("llama")
    input_ids, _ = batch()
    labels = torch.full_like(input_ids, -100)
    logps, grads_chunked = chunked_path(model, input_ids, labels)
    assert logps.numel() == 0
    assert all(float(g.abs().max()) == 0.0 for g in grads_chunked.values())


def test_ignored_positions_never_reach_the_head(monkeypatch):
    model = small_config_model("llama")
    input_ids, labels = batch()
    rows = []
    project = OutputHead.project

    def counting_project(self, hidden):
        rows.append(hidden.shape[0])
        return project(self, hidden)

    monkeypatch.setattr(OutputHead, "project", counting_project)
    chunked_path(model, input_ids, labels, chunk_size=10_000)
    targets = len(select_targets(labels))
    assert targets == int((labels[:, 1:] != -100).sum()) < input_ids.numel()
    assert rows == [targets, targets]  # forward, then the backward's recomputation: target rows only


@pytest.mark.parametrize("length", [512, 2048])
def test_logits_memory_is_one_chunk_whatever_the_length(length):
    """Peak activations + temporaries of the head and loss stay at a chunk's worth; the full path grows with T."""
    vocab, hidden_size, chunk = 32000, 64, 128
    torch.manual_seed(0)
    head_module = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, length, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, length))
    targets = select_targets(labels)
    head = OutputHead(head_module)

    def measure(fn):
        meter = StepMemoryMeter("cpu")
        meter.start(head_module)
        fn().sum().backward()
        breakdown = meter.stop(0)
        hidden.grad, head_module.weight.grad = None, None
        return breakdown.parts.get("activations", 0) + breakdown.parts.get("temporaries", 0)

    chunked = measure(lambda: chunked_logprobs(hidden, head, targets, chunk_size=chunk))
    full = measure(lambda: logprobs_from_logits(head_module(hidden), targets))
    chunk_logits = chunk * vocab * 4
    logits = length * vocab * 4
    non_logit = 4 * length * hidden_size * 4  # hidden states, their gradient, selections
    assert full >= logits  # the plain path holds at least the full fp32 logits
    assert chunked <= 3 * chunk_logits + non_logit  # logits, softmax and gradient of one chunk


def leaves_reached(tensor: torch.Tensor) -> set[int]:
    """ids of the parameters the autograd graph of `tensor` reaches (what DDP's unused-parameter search walks)."""
    seen, found, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.add(id(node.variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_trainers_forward_keeps_the_head_in_its_graph_exactly():
    """`DDPOutputHead.capture_hidden_states(head_follows=True)` (the trainers' forward under DDP, `head_kind`): the
    empty logits reach the head's weight, so DDP with find_unused_parameters=True (no gradient checkpointing) counts it
    used and waits for the chunked loss's gradient instead of failing (the 2-process run: tests/launch/test_launch.py).
    Values and gradients stay the full path's, and a micro-batch without targets gives the head a zero gradient, not
    none, which DDP would wait for forever. One process (`OutputHead`) leaves the head out: nothing waits for it."""
    model = small_config_model("llama")
    input_ids, labels = batch()
    full = full_path(model, input_ids, labels)
    with OutputHead.of(model).capture_hidden_states(head_follows=True) as captured:  # one process: nothing waits
        assert id(model.lm_head.weight) not in leaves_reached(model(input_ids=input_ids).logits)
    head = DDPOutputHead.of(model)
    with head.capture_hidden_states() as captured:  # a caller that never projects (a value model): left out
        assert id(model.lm_head.weight) not in leaves_reached(model(input_ids=input_ids).logits)
    model.zero_grad()
    targets = select_targets(labels)
    with head.capture_hidden_states(head_follows=True) as captured:
        outputs = model(input_ids=input_ids)
    assert outputs.logits.shape[-1] == 0 and id(model.lm_head.weight) in leaves_reached(outputs.logits)
    logps = chunked_logprobs(captured["hidden"], head, targets, chunk_size=7)
    (logps * torch.linspace(0.5, 1.5, len(targets))).sum().backward()
    assert_same(full, (logps.detach(), grads(model)))

    model.zero_grad()
    with head.capture_hidden_states(head_follows=True) as captured:
        model(input_ids=input_ids)
    nothing = select_targets(torch.full_like(labels, -100))
    chunked_logprobs(captured["hidden"], head, nothing, chunk_size=7).sum().backward()
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()
