"""Liger's path for real, on CPU under Triton's interpreter: SFT (`use_liger_kernel`), DPO, KTO, GRPO and RLOO
(`use_liger_loss`) take it (Liger's fused linear cross-entropy is called, not the chunked head) and give the loss
and gradients of the chunked and full-logits paths, padded and padding-free.

Tolerances (fp32). Losses and summed log-probs: relative 1e-5 (RTOL), as the chunked head's own tests: Liger's
kernel computes the same fp32 log-softmax in another order (an online max/sum over vocabulary blocks), so per-target
log-probs differ by ~1e-6 on values of ~10 (1e-7 relative), and a sum of <= ~200 same-sign terms stays within 1e-5
of itself. Gradients: max |difference| / max |gradient| (rel_diff) <= 5e-5 (GRAD_RTOL). Liger forms the logits'
gradient (softmax - onehot) in its own arithmetic, each entry a few ulps from torch's; backpropagated through the
model, that rounding compounds where the gradient's terms cancel (the largest entries of layer 1's MLP and of the
embeddings are sums of larger terms of both signs): measured up to 9.4e-6 (5e-7 between the chunked and full
paths; OMP_NUM_THREADS 1, 2 and 4 alike), so 5e-5 leaves a 5x margin for other orderings. A wrong target, shift, scale or per-target upstream
gradient moves the gradients by >= 1e-3.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from datasets import Dataset

from devkit.liger_cpu import (
    SET_BY_TESTS,
    VARIABLE,
    FusedKernelCalls,
    bridge_interpreter_gaps,
    forget_liger,
    keep_llama_unpatched,
    liger_kernels_interpreted,
)
from leantune import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)
from leantune.trainers.parts.logprob_engine import LogProbPath, choose_logprob_path

from ..fixtures.comparisons import GradientRecorder, loss_and_grads, rel_diff
from ..fixtures.data import count_a, gsm8k_prompt_completion
from ..fixtures.models import tiny_model
from ..fixtures.online_rounds import one_round

pytest.importorskip("liger_kernel", reason="needs leantune[liger]")
pytestmark = pytest.mark.liger_interpreter  # TRITON_INTERPRET=1 stays set for these tests (tests/conftest.py)

RTOL = 1e-5
HH_PAIRS_ROWS = 8
GRAD_RTOL = 5e-5
LAYOUTS = {"padded": {}, "padding_free": {"padding_free": True}}
# Each method's Liger run is checked in one layout, the layouts alternating between methods: the layouts themselves
# are shown equal per token elsewhere (tests/losses/test_sft_exactness.py, the trainers' padding-free tests), and the
# Triton interpreter makes each run here cost tens of seconds of CI.
SFT_LAYOUT, DPO_LAYOUT, KTO_LAYOUT = "padding_free", "padded", "padding_free"
ONLINE_CASES = [("grpo", "padded"), ("rloo", "padding_free")]
COMMON = dict(report_to=[], save_strategy="no", use_cpu=True, max_grad_norm=0.0, seed=0, logging_steps=1,
              learning_rate=1e-3, memory_breakdown=False, disable_tqdm=True)


@pytest.fixture(scope="module", autouse=True)
def liger_on_cpu():
    with pytest.MonkeyPatch.context() as patch:
        if os.environ.get(SET_BY_TESTS) == "1":  # the suite turned the interpreter on: these tests keep it on
            patch.setenv(VARIABLE, "1")
        reason = liger_kernels_interpreted()
        if reason is not None:
            pytest.skip(f"Liger's kernels do not run on CPU here: {reason}")
        yield


@pytest.fixture
def kernel_calls(monkeypatch):
    return FusedKernelCalls(monkeypatch)


def train_steps(trainer):
    """(first step's gradients, logged losses) of a real training run."""
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.grads, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_same_step(got, expected, what, loss_atol: float = 0.0, grad_rtol: float = GRAD_RTOL):
    """Logged losses within RTOL (+ `loss_atol` for losses made of differences of sums), first-step gradients."""
    (grads, losses), (reference_grads, reference_losses) = got, expected
    assert len(losses) == len(reference_losses) >= 1
    for loss, reference in zip(losses, reference_losses):
        assert loss == pytest.approx(reference, rel=RTOL, abs=loss_atol + 1e-6), what  # + the logs' 6 decimals
    assert grads.keys() == reference_grads.keys() and grads
    for name, reference in reference_grads.items():
        assert rel_diff(grads[name], reference) <= grad_rtol, (what, name)


def assert_paths_agree(trainer, batch, kernel_calls):
    """Liger's loss and gradients on `batch` equal the chunked head's and the full logits'."""
    liger_loss, liger_grads = loss_and_grads(trainer, batch, LogProbPath.LIGER)
    assert kernel_calls.take() > 0
    for path in (LogProbPath.CHUNKED, LogProbPath.FULL):
        loss, grads = loss_and_grads(trainer, batch, path)
        assert kernel_calls.take() == 0
        torch.testing.assert_close(liger_loss, loss, rtol=RTOL, atol=RTOL * float(loss.abs()) + 1e-7)
        for name, reference in grads.items():
            assert rel_diff(liger_grads[name], reference) <= GRAD_RTOL, (path, name)


# --- SFT --------------------------------------------------------------------------------------------------------


def sft_trainer(tokenizer, dataset, tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), max_length=64, per_device_train_batch_size=2, max_steps=2, **COMMON)
    settings.update(overrides)
    return SFTTrainer(model=tiny_model(), args=SFTConfig(**settings), train_dataset=dataset,
                      processing_class=tokenizer)


@pytest.mark.parametrize("layout", [SFT_LAYOUT])
def test_sft_liger_training_equals_chunked_and_full(layout, tokenizer, gsm8k_rows, tmp_path, kernel_calls, caplog):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 4)
    with caplog.at_level(logging.INFO, logger="leantune"):
        liger = sft_trainer(tokenizer, dataset, tmp_path / "l", use_liger_kernel=True, **LAYOUTS[layout])
    assert liger.logprob_path is LogProbPath.LIGER
    assert "model patches" in caplog.text  # on CPU Liger computes the loss; the model is not patched
    assert "no entropies" in caplog.text
    got = train_steps(liger)
    assert kernel_calls.take() == 4  # per step: the fused forward and its recomputation in backward
    assert liger.state.log_history[0]["mean_token_accuracy"] >= 0.0  # Liger's own accuracy, logged
    assert "entropy" not in liger.state.log_history[0]  # Liger computes none (announced: "no entropies")
    for path, flags in (("chunked", {}), ("full", {"chunked_loss": False})):
        expected = train_steps(sft_trainer(tokenizer, dataset, tmp_path / path, **flags, **LAYOUTS[layout]))
        assert_same_step(got, expected, path)
    assert kernel_calls.take() == 0


def test_summed_nll_kernel_equals_the_chunked_head(monkeypatch):
    """SFT's summed kernel (CUDA's path for the plain NLL; on CPU the per-target one is used, see fused_nll_runs):
    its NLL, accuracy and gradients against the chunked head, with a bias and soft-capping (the softcap float and
    libdevice's tanh need the interpreter bridges; dispatch keeps soft-capped heads off Liger on CPU). Vocabulary
    1000: the kernel's backward runs one interpreted program per vocabulary row."""
    bridge_interpreter_gaps(monkeypatch)
    from leantune.losses.liger import liger_nll_sum
    from leantune.losses.token_logprobs import chunked_logprobs, select_targets
    from leantune.models.output_head import OutputHead

    torch.manual_seed(0)
    labels = torch.randint(0, 1000, (2, 40))
    labels[0, :7] = -100
    hidden = torch.randn(2, 40, 64, requires_grad=True)
    results = []
    for softcap in (None, 30.0):
        for fused in (True, False):
            head = OutputHead(torch.nn.Linear(64, 1000), softcap=softcap)
            torch.manual_seed(1)
            head.module.reset_parameters()
            targets = select_targets(labels)
            if fused:
                nll, accuracy = liger_nll_sum(hidden, head, targets)
            else:
                logps, top1 = chunked_logprobs(hidden, head, targets, 16, stats=("top1",))
                nll, accuracy = -logps.sum(), top1.float().mean()
            (nll / 3).backward()  # a normaliser, as the trainers divide: Liger's backward scales its gradients
            grads = [hidden.grad.clone(), head.module.weight.grad.clone(), head.module.bias.grad.clone()]
            hidden.grad = None
            results.append((nll.detach(), accuracy, grads))
        (nll_l, acc_l, grads_l), (nll_c, acc_c, grads_c) = results[-2:]
        assert float(nll_l) == pytest.approx(float(nll_c), rel=RTOL) and float(acc_l) == pytest.approx(float(acc_c))
        for got, reference in zip(grads_l, grads_c):
            assert rel_diff(got, reference) <= GRAD_RTOL, softcap  # measured 1.4e-6


def test_sft_dft_per_token_loss_goes_through_liger(tokenizer, gsm8k_rows, tmp_path, kernel_calls):
    """DFT weighs each token's NLL by its probability: the per-target route (reduction="none") on Liger."""
    dataset = gsm8k_prompt_completion(gsm8k_rows, 2)
    trainer = sft_trainer(tokenizer, dataset, tmp_path, use_liger_kernel=True, loss_type="dft", padding_free=True)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert_paths_agree(trainer, batch, kernel_calls)


# --- dispatch -------------------------------------------------------------------------------------------------------


def test_without_the_interpreter_cpu_takes_the_chunked_head_with_a_notice(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET")
    with caplog.at_level(logging.WARNING, logger="leantune"):
        assert choose_logprob_path(True, "cpu", "use_liger_loss") is LogProbPath.CHUNKED
    assert "use_liger_loss=True" in caplog.text and "TRITON_INTERPRET=1" in caplog.text
    assert "chunked loss" in caplog.text
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_logprob_path(True, "cpu", "use_liger_loss") is LogProbPath.LIGER
    assert choose_logprob_path(False, "cpu", "-") is LogProbPath.CHUNKED  # not asked for: never Liger


def test_liger_imported_before_the_interpreter_is_refused_on_cpu(monkeypatch, caplog):
    """Kernels defined without the interpreter are compiled ones, which cannot take CPU tensors."""
    monkeypatch.delenv("TRITON_INTERPRET")
    forget_liger()
    import liger_kernel.ops.cross_entropy  # noqa: F401  (compiled kernels)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.WARNING, logger="leantune"):
        assert choose_logprob_path(True, "cpu", "use_liger_kernel") is LogProbPath.CHUNKED
    assert "imported before TRITON_INTERPRET was set" in caplog.text
    forget_liger()
    import liger_kernel.ops.cross_entropy  # noqa: F401, F811  (interpreted again, for the tests after this one)


# --- DPO and KTO: the policy's and the reference's per-target log-probs through Liger --------------------------------


def preference_trainer(cls, config_cls, tokenizer, dataset, tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), max_length=64, per_device_train_batch_size=2, max_steps=2, **COMMON)
    settings.update(overrides)
    return cls(model=tiny_model(), args=config_cls(**settings), train_dataset=dataset, processing_class=tokenizer)


def summed_logp_tolerance(trainer, beta_terms: int) -> float:
    """Absolute tolerance of a loss made of `beta_terms` differences of summed log-probs, each sum within RTOL of
    itself (same-sign terms): beta x terms x RTOL x the largest |sum| of the run, read from its logged logps."""
    sums = [abs(entry[key]) for entry in trainer.state.log_history for key in ("logps/chosen", "logps/rejected")
            if key in entry]
    return trainer.args.beta * beta_terms * RTOL * max(sums)


@pytest.mark.parametrize("layout", [DPO_LAYOUT])
def test_dpo_liger_training_equals_chunked_and_full(layout, tokenizer, hh_pairs, tmp_path, kernel_calls):
    liger = preference_trainer(DPOTrainer, DPOConfig, tokenizer, hh_pairs, tmp_path / "l", use_liger_loss=True,
                               **LAYOUTS[layout])
    assert liger.logprob_path is LogProbPath.LIGER
    got = train_steps(liger)
    # per step: the reference's forward (no gradient), the policy's forward and its recomputation in backward
    assert kernel_calls.take() == 6
    # step 1 is log 2 on every path (the reference is the policy's copy); step 2 is beta x (4 summed log-probs)
    # apart: each sum is within RTOL of itself
    loss_atol = summed_logp_tolerance(liger, 4)
    for path, flags in (("chunked", {}), ("full", {"chunked_loss": False})):
        expected_trainer = preference_trainer(DPOTrainer, DPOConfig, tokenizer, hh_pairs, tmp_path / path, **flags,
                                              **LAYOUTS[layout])
        expected = train_steps(expected_trainer)
        assert_same_step(got, expected, path, loss_atol)
        for key in ("logps/chosen", "logps/rejected"):  # means of same-sign sums: relative to themselves
            assert liger.state.log_history[1][key] == pytest.approx(expected_trainer.state.log_history[1][key],
                                                                    rel=RTOL)
    assert kernel_calls.take() == 0


@pytest.mark.parametrize("layout", [KTO_LAYOUT])
def test_kto_liger_training_equals_chunked_and_full(layout, tokenizer, hh_pairs, tmp_path, kernel_calls):
    liger = preference_trainer(KTOTrainer, KTOConfig, tokenizer, hh_pairs, tmp_path / "l", use_liger_loss=True,
                               **LAYOUTS[layout])
    assert liger.logprob_path is LogProbPath.LIGER
    got = train_steps(liger)
    # per step: reference completions and KL completions, the policy's KL completions (no gradient), the policy's
    # completions and their recomputation in backward
    assert kernel_calls.take() == 10
    # the loss is 1 - sigmoid(beta (r - z0)) over differences of summed log-probs (r: 2 sums, z0: 2 more)
    loss_atol = summed_logp_tolerance(liger, 4)
    for path, flags in (("chunked", {}), ("full", {"chunked_loss": False})):
        expected = train_steps(preference_trainer(KTOTrainer, KTOConfig, tokenizer, hh_pairs, tmp_path / path,
                                                  **flags, **LAYOUTS[layout]))
        assert_same_step(got, expected, path, loss_atol)
    assert kernel_calls.take() == 0


# --- GRPO and RLOO: completions scored through Liger (policy, generation-time and reference log-probs) -------------


def online_prompts(n: int = 8) -> Dataset:
    words = ["cat", "dog", "bird", "fish", "tree", "lake", "road", "moon"]
    return Dataset.from_dict({"prompt": [f"Reverse the word {words[i % 8]}:" for i in range(n)]})


def online_trainer(cls, config_cls, tokenizer, tmp_path, **overrides):
    # temperature 0.7: the log-probs are of logits / 0.7, folded into Liger's inputs (losses/liger.py)
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, max_steps=1, beta=0.1, temperature=0.7, **COMMON)
    settings.update(overrides)
    return cls(model=tiny_model(), reward_funcs=count_a, args=config_cls(**settings), train_dataset=online_prompts(),
               processing_class=tokenizer)


ONLINE = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}


@pytest.mark.parametrize(("method", "layout"), ONLINE_CASES)
def test_online_liger_loss_equals_chunked_and_full(method, layout, tokenizer, tmp_path, kernel_calls, caplog):
    """On one round's micro-batch: the loss (on-policy ratios of 1, the k3 KL against the frozen reference) and its
    gradients on the three paths; and a real optimizer step through Liger gives the chunked run's step."""
    cls, config_cls = ONLINE[method]
    with caplog.at_level(logging.INFO, logger="leantune"):
        trainer = online_trainer(cls, config_cls, tokenizer, tmp_path / "l", use_liger_loss=True, **LAYOUTS[layout])
    assert trainer.logprob_path is LogProbPath.LIGER and "scored by Liger's fused linear cross-entropy" in caplog.text
    batch = one_round(trainer)[0]
    assert kernel_calls.take() >= 1  # the reference's log-probs (beta > 0) through Liger
    assert_paths_agree(trainer, batch, kernel_calls)
    assert "entropy" not in trainer.run_metrics.values["train"] or all(
        value != value for value in trainer.run_metrics.values["train"]["entropy"][:1])  # Liger computes no entropies

    liger = online_trainer(cls, config_cls, tokenizer, tmp_path / "l2", use_liger_loss=True, **LAYOUTS[layout])
    got = train_steps(liger)
    assert kernel_calls.take() >= 3  # reference forward, policy forward and its recomputation
    expected = train_steps(online_trainer(cls, config_cls, tokenizer, tmp_path / "c", **LAYOUTS[layout]))
    assert_same_step(got, expected, "chunked")


def test_grpo_entropy_bonus_scores_the_policy_through_the_chunked_head(tokenizer, tmp_path, kernel_calls, caplog):
    """The bonus needs per-token entropies with their gradient, which Liger does not compute: a logged decision."""
    with caplog.at_level(logging.INFO, logger="leantune"):
        trainer = online_trainer(GRPOTrainer, GRPOConfig, tokenizer, tmp_path, use_liger_loss=True, entropy_coef=0.01)
    assert "per-token entropies" in caplog.text and "chunked head" in caplog.text
    batch = one_round(trainer)[0]
    assert kernel_calls.take() >= 1  # the round's reference log-probs (no gradient) through Liger
    loss, grads = loss_and_grads(trainer, batch, LogProbPath.LIGER)
    assert kernel_calls.take() == 0  # the policy's went through the chunked head
    chunked_loss, chunked_grads = loss_and_grads(trainer, batch, LogProbPath.CHUNKED)
    torch.testing.assert_close(loss, chunked_loss, rtol=RTOL, atol=1e-7)
    for name, reference in chunked_grads.items():
        assert rel_diff(grads[name], reference) <= RTOL, name


# --- Liger's model patches: what CUDA runs with use_liger_kernel=True ------------------------------------------------


def test_liger_model_patches_with_the_fused_loss_train_as_the_plain_model(tokenizer, gsm8k_rows, tmp_path,
                                                                          monkeypatch, kernel_calls):
    """On CUDA, transformers patches the model when training starts (RMSNorm, RoPE, SwiGLU, and Liger's own
    LlamaForCausalLM.forward); leantune then captures the head's input from that forward. On CPU leantune does not
    patch (interpreted, a 2-layer model's step is ~1000x slower, docs/liger.md), so this test applies transformers'
    patching call itself, with the interpreter bridges, and checks the step against the plain model's.

    Tolerance: the loss within RTOL; gradients 1e-4 of their largest. The patched model is another fp32 computation
    of every layer (RMSNorm, SwiGLU, RoPE each round differently, ~1e-7 per op), and the backward compounds those
    through both layers: measured up to 1.03e-5 (mlp.down_proj of layer 0). A wrong kernel (a RoPE half swapped, a
    missing eps, a wrong activation) moves gradients by >= 1e-2."""
    from transformers.integrations.liger import apply_liger_kernel

    bridge_interpreter_gaps(monkeypatch)
    keep_llama_unpatched(monkeypatch)
    dataset = gsm8k_prompt_completion(gsm8k_rows, 2)
    patched = sft_trainer(tokenizer, dataset, tmp_path / "p", use_liger_kernel=True, padding_free=True,
                          max_length=40, max_steps=1)
    forward = type(patched.model).forward
    apply_liger_kernel(patched.model, None)
    assert patched.model.forward.__func__ is not forward  # Liger's forward replaced the model's
    got = train_steps(patched)
    assert kernel_calls.take() == 2
    expected = train_steps(sft_trainer(tokenizer, dataset, tmp_path / "c", padding_free=True, max_length=40,
                                       max_steps=1))
    assert_same_step(got, expected, "plain model, chunked head", grad_rtol=1e-4)


def test_bf16_model_liger_matches_the_chunked_head(tokenizer, gsm8k_rows, tmp_path, kernel_calls):
    """A bf16 model (the GPU test's case, here on CPU): Liger projects in bf16 and takes the softmax in fp32, the
    chunked head projects in fp32. Tolerance: loss 1e-2 relative, gradients 5e-2 of their largest, as the GPU test:
    bf16 logits carry ~4e-3 relative rounding (8 mantissa bits), which moves each log-prob by ~|logit| x 4e-3 and the
    bf16 gradients by a few of their own ulps; a wrong target or scale moves the loss by > 10%."""
    dataset = gsm8k_prompt_completion(gsm8k_rows, 2)
    trainer = sft_trainer(tokenizer, dataset, tmp_path, use_liger_kernel=True, padding_free=True)
    trainer.model.to(torch.bfloat16)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    liger_loss, liger_grads = loss_and_grads(trainer, batch, LogProbPath.LIGER)
    assert kernel_calls.take() == 2
    loss, grads = loss_and_grads(trainer, batch, LogProbPath.CHUNKED)
    assert float(liger_loss) == pytest.approx(float(loss), rel=1e-2)
    for name, reference in grads.items():
        assert rel_diff(liger_grads[name].float(), reference.float()) <= 5e-2, name


def test_a_liger_without_per_token_gradients_trains_per_token_losses_on_the_chunked_head(
        tokenizer, hh_pairs, tmp_path, kernel_calls, monkeypatch, caplog):
    """liger-kernel < 0.8.2 scales every token's gradient by the first token's with reduction="none": with such a
    version (its feature check answering no), DPO's policy pass takes the chunked head, announced; the reference's
    (no gradient) still goes through Liger."""
    from leantune.trainers.parts import logprob_engine

    monkeypatch.setattr(logprob_engine, "per_target_gradients_supported", lambda: False)
    with caplog.at_level(logging.WARNING, logger="leantune"):
        trainer = preference_trainer(DPOTrainer, DPOConfig, tokenizer, hh_pairs, tmp_path, use_liger_loss=True)
    assert "fixed in 0.8.2" in caplog.text
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    loss, grads = loss_and_grads(trainer, batch, LogProbPath.LIGER)
    assert kernel_calls.take() == 1  # the reference only
    chunked_loss, chunked_grads = loss_and_grads(trainer, batch, LogProbPath.CHUNKED)
    torch.testing.assert_close(loss, chunked_loss, rtol=RTOL, atol=1e-7)  # log 2 on both: policy == reference
    for name, reference in chunked_grads.items():
        assert rel_diff(grads[name], reference) <= GRAD_RTOL, name


def test_plan_of_a_liger_run_equals_its_measured_step(tokenizer, gsm8k_rows, kernel_calls):
    """The planner traces a Liger run with fake weights: Triton launches on fake tensors are skipped (a kernel writes
    only into tensors torch allocated around it, which are traced), so the plan equals the measured breakdown. Before,
    the trace failed ("Cannot copy out of meta tensor": the launch read the fake tensors' memory)."""
    from leantune.planning import plan_memory

    from ..fixtures.planning import measured_breakdown

    # One traced candidate batch (max_batches=1): the claim is on the plan's measured step (the trainer's own second
    # step), which every plan traces; each candidate is another traced run of Liger's loss, one chunk per token
    # (vocabulary 32k over hidden 64). At max_length 64 the peak moves to where the gradients tie: keep 128.
    dataset = gsm8k_prompt_completion(gsm8k_rows, 12)
    fields = dict(use_liger_kernel=True, per_device_train_batch_size=2, max_length=128)
    model = tiny_model()
    plan = plan_memory(model.config, dataset, "sft", processing_class=tokenizer, max_batches=1, **fields)
    assert kernel_calls.take() > 0  # the plan traced Liger's path (its launches skipped), not the chunked head
    measured = measured_breakdown(SFTTrainer, SFTConfig, model, dataset, tokenizer, fields)
    assert kernel_calls.take() > 0  # and so did the measured run, for real under Triton's interpreter
    predicted = plan.measured_step
    # The same bound as tests/planning/test_plan.py: both sides are MemTracker's sums of the same tensors' sizes (real, fake).
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes
    for part, size in measured.parts.items():
        assert abs(predicted.parts.get(part, 0) - size) <= 0.02 * measured.peak_bytes, part
