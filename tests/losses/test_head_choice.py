"""The head under Liger (losses/head_choice.py): Liger's fused kernel given the chunked head's rows per chunk, the choice
between the two (timed on a GPU, or `liger_head`), logged once, and both heads giving the same per-token log-probs and
gradients.

Tolerances (fp32), as tests/losses/test_liger_cpu.py's: per-target log-probs of magnitude ~7 (log 1000) differ by a
few ulps between Liger's online log-sum-exp and torch's (1e-5 relative: RTOL); gradients by max |difference| / max
|gradient| <= 5e-5 (GRAD_RTOL: Liger forms softmax - onehot in its own arithmetic, each entry a few ulps from torch's;
measured <= 2e-6 here). A wrong chunk's rows, target or per-target upstream gradient moves them by >= 1e-3.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from devkit.liger_cpu import SET_BY_TESTS, VARIABLE, FusedKernelCalls, liger_kernels_interpreted
from leantune import SFTConfig, SFTTrainer
from leantune.losses.head_choice import (
    CHUNKED,
    LIGER,
    HeadTimes,
    LigerHeadChoice,
    choice_from_times,
    choose_liger_head,
    time_head_paths,
)
from leantune.losses.token_logprobs import Targets, chunked_logprobs
from leantune.models.output_head import OutputHead

from ..fixtures.comparisons import rel_diff
from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

RTOL = 1e-5
GRAD_RTOL = 5e-5
ROWS, HIDDEN, VOCAB, CHUNK_ROWS = 96, 32, 1000, 16  # Liger's own rule: chunks of next_pow2(96 / ceil(1000/32)) = 4


@pytest.mark.quick
def test_the_faster_head_is_chosen_per_loss_and_the_setting_overrides_it():
    def times(chunked, per_target, summed):
        return HeadTimes(8192, 2048, chunked, per_target, summed)

    assert (choice_from_times(times(2.0, 1.0, 0.5)).per_target, choice_from_times(times(2.0, 1.0, 0.5)).summed) == (
        LIGER, LIGER)
    slow_recompute = choice_from_times(times(1.0, 1.5, 0.8))  # Liger's summed kernel wins, its per-target one loses
    assert (slow_recompute.per_target, slow_recompute.summed) == (CHUNKED, LIGER)
    assert "per-target log-probs: chunked, summed NLL (SFT): liger" in slow_recompute.describe()
    assert "Liger per-target 1500.00 ms" in slow_recompute.describe() and "chunked head 1000.00 ms" in (
        slow_recompute.describe())
    noise = choice_from_times(times(1.0, 0.9, 1.1))  # summed slower but per-target faster: noise, both chunked
    assert (noise.per_target, noise.summed) == (CHUNKED, CHUNKED)
    tie = choice_from_times(times(1.0, 1.0, 1.0))
    assert (tie.per_target, tie.summed) == (LIGER, LIGER)  # a tie: what the user asked for
    head = OutputHead(torch.nn.Linear(HIDDEN, VOCAB))
    for setting in (LIGER, CHUNKED):
        chosen = choose_liger_head(setting, head, "cuda", CHUNK_ROWS)  # set: no probe, even on CUDA
        assert (chosen.per_target, chosen.summed) == (setting, setting) and f"liger_head='{setting}'" in chosen.why
    on_cpu = choose_liger_head("auto", head, "cpu", CHUNK_ROWS)
    assert on_cpu == LigerHeadChoice(why=on_cpu.why) and "not timed on cpu" in on_cpu.why
    with pytest.raises(ValueError, match="`liger_head` must be one of"):
        choose_liger_head("fastest", head, "cpu", CHUNK_ROWS)


def test_liger_head_needs_a_liger_flag_and_a_known_value(tmp_path):
    with pytest.raises(ValueError, match="has no effect without `use_liger_kernel=True`"):
        SFTConfig(output_dir=str(tmp_path), report_to=[], liger_head="chunked")
    with pytest.raises(ValueError, match="`liger_head` must be one of auto, liger, chunked"):
        SFTConfig(output_dir=str(tmp_path), report_to=[], use_liger_kernel=True, liger_head="fast")
    assert SFTConfig(output_dir=str(tmp_path), report_to=[], use_liger_kernel=True, liger_head="chunked")


# --- Liger's kernel for real (Triton's interpreter) -------------------------------------------------------------


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("liger_kernel", reason="needs leantune[liger]")
    if os.environ.get(SET_BY_TESTS) == "1":
        monkeypatch.setenv(VARIABLE, "1")
    reason = liger_kernels_interpreted()
    if reason is not None:
        pytest.skip(f"Liger's kernels do not run on CPU here: {reason}")


class ChunkRows:
    """The rows of each chunk Liger's fused linear cross-entropy runs (its cross-entropy kernel's grid)."""

    def __init__(self, monkeypatch):
        from liger_kernel.ops import fused_linear_cross_entropy as module

        self.rows, kernel = [], module.liger_cross_entropy_kernel
        rows = self.rows

        class Counted:
            def __getitem__(self, grid):
                rows.append(grid[0])
                return kernel[grid]

        monkeypatch.setattr(module, "liger_cross_entropy_kernel", Counted())


def problem(seed: int = 0):
    torch.manual_seed(seed)
    head = OutputHead(torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    hidden = torch.randn(ROWS, HIDDEN, requires_grad=True)
    tokens = torch.randint(VOCAB, (ROWS,))
    targets = Targets(torch.arange(ROWS), tokens, torch.Size((ROWS,)))
    upstream = torch.rand(ROWS)  # a different gradient per target, as DPO's and GRPO's losses give
    return head, hidden, targets, upstream


def logps_and_grads(logps, hidden, head, upstream):
    grads = torch.autograd.grad(logps, [hidden, head.module.weight], upstream)
    return logps.detach(), grads


@pytest.mark.liger_interpreter
def test_liger_runs_the_chunked_heads_rows_and_both_heads_agree_per_token(interpreted, monkeypatch):
    from leantune.losses.liger import liger_target_logprobs

    head, hidden, targets, upstream = problem()
    chunks = ChunkRows(monkeypatch)
    liger = logps_and_grads(liger_target_logprobs(hidden, head, targets, chunk_rows=CHUNK_ROWS), hidden, head,
                            upstream)
    # forward and the backward's recomputation, each in chunks of the chunked head's rows (Liger's own rule: 4 rows)
    assert chunks.rows == [CHUNK_ROWS] * (2 * ROWS // CHUNK_ROWS)
    chunks.rows.clear()
    own_rule = logps_and_grads(liger_target_logprobs(hidden, head, targets), hidden, head, upstream)
    assert set(chunks.rows) == {4}
    chunked = logps_and_grads(chunked_logprobs(hidden, head, targets, CHUNK_ROWS), hidden, head, upstream)
    for other in (own_rule, chunked):
        torch.testing.assert_close(liger[0], other[0], rtol=RTOL, atol=RTOL * float(other[0].abs().max()))
        for got, reference in zip(liger[1], other[1]):
            assert rel_diff(got, reference) <= GRAD_RTOL


@pytest.mark.liger_interpreter
def test_the_probe_times_both_heads_for_real_without_touching_the_models_gradients(interpreted):
    head, *_ = problem()
    times = time_head_paths(head, 2 * CHUNK_ROWS, CHUNK_ROWS, repeats=1)
    assert head.module.weight.grad is None  # gradients returned, never accumulated
    assert (times.rows, times.chunk_rows) == (2 * CHUNK_ROWS, CHUNK_ROWS)
    assert min(times.chunked, times.liger_per_target, times.liger_summed) > 0
    # interpreted Triton is far slower than torch on CPU: the probe says so (which is why it never runs on CPU)
    assert choice_from_times(times).per_target == CHUNKED


@pytest.mark.liger_interpreter
def test_liger_head_chunked_trains_sft_on_the_chunked_head_and_says_so(interpreted, monkeypatch, tokenizer,
                                                                       gsm8k_rows, tmp_path, caplog):
    kernel_calls = FusedKernelCalls(monkeypatch)
    dataset = gsm8k_prompt_completion(gsm8k_rows, 2)
    common = dict(report_to=[], save_strategy="no", use_cpu=True, max_steps=1, per_device_train_batch_size=2,
                  max_length=64, memory_breakdown=False, disable_tqdm=True, seed=0, use_liger_kernel=True)
    losses = {}
    for setting in ("chunked", "auto"):
        with caplog.at_level(logging.INFO, logger="leantune"):
            trainer = SFTTrainer(model=tiny_model(), processing_class=tokenizer, train_dataset=dataset,
                                 args=SFTConfig(output_dir=str(tmp_path / setting), liger_head=setting, **common))
        losses[setting] = trainer.train().training_loss
        calls = kernel_calls.take()
        if setting == "chunked":
            assert calls == 0 and "Liger head choice: the chunked head for every loss (liger_head='chunked')" in (
                caplog.text)
        else:
            assert calls == 2 and "Liger head choice: Liger for every loss (liger_head='auto', not timed on cpu" in (
                caplog.text)
        caplog.clear()
    assert losses["chunked"] == pytest.approx(losses["auto"], rel=RTOL)
