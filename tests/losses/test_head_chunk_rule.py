"""The chunked head on the device: its chunk-size rule (losses/token_logprobs.py's `chunk_rows_for`, read through the
log-prob engine's HeadSettings) and its matmuls in the compute dtype.

The head projects in the weight's dtype (a bf16 model's logits matmul is a bf16 matmul: tensor cores on a GPU, fp32
accumulation), then takes the log-softmax in fp32; its gradient matmuls are bf16 too. The tolerance tests hold the
bf16 path to a bound derived from the magnitudes against the fp32 path over the very same (bf16-representable)
weights and hidden states, so the only difference is where the matmuls round.
"""

from __future__ import annotations

import math

import pytest
import torch

from leantune.losses.token_logprobs import (
    CHUNK_BYTES,
    GPU_CHUNK_ROWS,
    Targets,
    chunk_rows_for,
    chunk_tokens_for,
    chunked_logprobs,
)
from leantune.models.output_head import OutputHead
from leantune.trainers.parts.logprob_engine import LogProbEngine, LogProbPath
from leantune.trainers.settings import HeadSettings, Offloading, free_memory_of

from ..fixtures.models import tiny_model

QWEN_VOCAB = 151936
GIB = 2**30
# bf16 stores 7 mantissa bits (8 with the implicit one): rounding to nearest errs by at most 2^-8 = 0.0039 relative.
BF16_UNIT = 2.0**-8
FP32_RTOL = 1e-5  # the fp32 paths' tolerance (tests/losses/test_chunked_logprobs.py)
VOCAB, HIDDEN, ROWS, CHUNK = 1000, 64, 300, 64


def head_settings(chunk=None, device_type="cpu", free=None) -> HeadSettings:
    return HeadSettings(device_type, chunk, Offloading(False, 0, False), free)


@pytest.mark.quick
def test_chunk_rule_keeps_the_cpu_figure_and_grows_on_a_gpu_within_its_free_memory():
    cpu = chunk_tokens_for(QWEN_VOCAB)
    assert cpu == CHUNK_BYTES // (4 * QWEN_VOCAB) == 110  # the figure the H100 diagnosis measured
    assert chunk_rows_for(QWEN_VOCAB) == cpu
    assert chunk_rows_for(QWEN_VOCAB, "cpu", 100 * GIB) == cpu  # CPU: today's chunk whatever its memory
    assert chunk_rows_for(QWEN_VOCAB, "cuda", None) == cpu  # free memory unknown: today's chunk
    assert chunk_rows_for(QWEN_VOCAB, "cuda", 60 * GIB) == GPU_CHUNK_ROWS  # room: the matmuls' rows
    tight = chunk_rows_for(QWEN_VOCAB, "cuda", 4 * GIB)
    assert cpu < tight < GPU_CHUNK_ROWS
    assert 3 * 4 * tight * QWEN_VOCAB <= 4 * GIB / 8  # three fp32 [rows, vocabulary] buffers in an eighth
    assert chunk_rows_for(QWEN_VOCAB, "cuda", GIB // 100) == cpu  # never below the CPU's figure
    # The engine's settings: the rule from the device facts, and a user's loss_chunk_size always wins.
    assert head_settings(device_type="cuda", free=60 * GIB).chunk_rows(QWEN_VOCAB) == GPU_CHUNK_ROWS
    assert head_settings(37, "cuda", 60 * GIB).chunk_rows(QWEN_VOCAB) == 37
    assert head_settings().chunk_rows(QWEN_VOCAB) == cpu
    assert free_memory_of(torch.device("cpu")) is None  # read on CUDA only


def test_the_engine_resolves_each_heads_chunk_once_when_it_finds_the_head():
    """The rule runs when the engine first finds a head (the trainer does so when it is built), not in each step."""
    model = tiny_model("llama")
    vocab = OutputHead.of(model).vocab_size
    for settings, rows in ((head_settings(), chunk_tokens_for(vocab)), (head_settings(24), 24),
                           (head_settings(None, "cuda", 60 * GIB), GPU_CHUNK_ROWS)):
        engine = LogProbEngine(settings, LogProbPath.CHUNKED, lambda: False, lambda model, outputs: None)
        engine.head_of(model)
        assert engine.chunk_rows == {vocab: rows}


def head_run(dtype, weight, hidden, tokens, upstream):
    """(log-probs, d/dhidden, d/dweight) of sum(upstream * logp) through the chunked head in `dtype`."""
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    hidden = hidden.to(dtype, copy=True).requires_grad_()
    targets = Targets(torch.arange(ROWS), tokens, torch.Size([ROWS]))
    logps = chunked_logprobs(hidden, OutputHead(head), targets, chunk_size=CHUNK)
    (logps * upstream).sum().backward()
    return logps.detach(), hidden.grad.float(), head.weight.grad.float()


def bf16_and_fp32_runs():
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5).bfloat16().float()  # logits up to ~25
    hidden = torch.randn(ROWS, HIDDEN, generator=generator).bfloat16().float()
    tokens = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    upstream = torch.randn(ROWS, generator=generator)
    exact = head_run(torch.float32, weight, hidden, tokens, upstream)
    bf16 = head_run(torch.bfloat16, weight, hidden, tokens, upstream)
    logits = hidden @ weight.t()
    return exact, bf16, (weight, hidden, tokens, upstream, logits)


def bounds(inputs, exact):
    """Per-element bounds on |bf16 path - fp32 path|, from the magnitudes.

    Log-probs: each bf16 logit z carries at most u|z| of rounding (u = 2^-8; the matmul accumulates in fp32, whose
    error is ~1e5 times smaller); logp = z_y - logsumexp(z), and logsumexp moves by at most the largest logit error,
    so |dlogp| <= 2 u max|z| per row. Gradients: d logp / dz = onehot - p; p = exp(z - logsumexp) moves by a factor
    of at most exp(2 u max|z|), and the [chunk, vocabulary] gradient is rounded to bf16 (u more), so each of its
    elements errs by at most e = (exp(2 u max|z|) - 1 + u) |g| (p + onehot). The hidden states' gradient e @ |W| plus
    its own bf16 rounding u |grad|; the weight's e^T @ |h| plus one bf16 rounding of the running sum per chunk added
    (HeadGradients sums in the weight's dtype)."""
    weight, hidden, tokens, upstream, logits = inputs
    row_max = logits.abs().amax(-1)
    probs = torch.softmax(logits, -1)
    onehot = torch.nn.functional.one_hot(tokens, VOCAB).float()
    grad_logits = upstream[:, None] * (onehot - probs)
    per_logit = (torch.expm1(2 * BF16_UNIT * row_max) + BF16_UNIT)[:, None] * upstream.abs()[:, None] * (probs + onehot)
    chunks = math.ceil(ROWS / CHUNK)
    return (2 * BF16_UNIT * row_max,
            per_logit @ weight.abs() + BF16_UNIT * exact[1].abs(),
            per_logit.t() @ hidden.abs() + chunks * BF16_UNIT * (grad_logits.abs().t() @ hidden.abs()))


def test_bf16_head_matmuls_stay_within_the_bf16_tolerance_of_the_fp32_path():
    exact, bf16, inputs = bf16_and_fp32_runs()
    for name, want, got, bound in zip(("logps", "hidden grad", "weight grad"), exact, bf16, bounds(inputs, exact)):
        assert (got - want).abs().le(bound).all(), (name, ((got - want).abs() / bound).max().item())


def test_the_bf16_tolerance_is_not_fp32s():
    """Negative control: the bf16 path really rounds in bf16, beyond the fp32 paths' tolerance, so the bounds above
    are what the comparison rests on (with fp32's, the tolerance test would fail)."""
    exact, bf16, _ = bf16_and_fp32_runs()
    for want, got in zip(exact, bf16):
        assert not (got - want).abs().le(FP32_RTOL * want.abs().max()).all()
