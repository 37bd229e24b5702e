"""The memory engine inside a real trainer: chunked loss, activation offloading and the memory breakdown.

Tolerance: relative difference <= 1e-5 in fp32 for losses and first-step gradients.
"""

from __future__ import annotations

import logging

import pytest
import torch

from leantune import SFTConfig
from leantune.trainers.parts.logprob_engine import LogProbPath

from ..fixtures.comparisons import GradientRecorder, rel_diff
from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

RTOL = 1e-5
LAYOUTS = {
    "padded": {},
    "padding_free": {"padding_free": True},
    "packed": {"packing": True},
    "lora": {"peft_config": "lora"},
}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def first_steps(tokenizer, dataset, tmp_path, steps=2, **overrides):
    """Train `steps` real optimizer steps; return the first step's gradients and every logged loss."""
    from leantune import SFTTrainer

    peft_config = lora_config() if overrides.pop("peft_config", None) == "lora" else None
    model = tiny_model("llama")
    settings = dict(output_dir=str(tmp_path), max_length=256, report_to=[], save_strategy="no", use_cpu=True,
                    per_device_train_batch_size=4, max_steps=steps, max_grad_norm=0.0, seed=0, logging_steps=1,
                    learning_rate=1e-3)
    settings.update(overrides)
    torch.manual_seed(0)
    trainer = SFTTrainer(model=model, args=SFTConfig(**settings), train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config)
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    output = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return recorder.grads, losses, trainer, output


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_loss_equals_full_loss_in_training(layout, tokenizer, gsm8k_rows, tmp_path, caplog):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    extra = LAYOUTS[layout]
    grads_full, losses_full, trainer_full, _ = first_steps(tokenizer, dataset, tmp_path / "full", chunked_loss=False,
                                                           **dict(extra))
    with caplog.at_level(logging.WARNING, logger="leantune"):
        grads_chunked, losses_chunked, trainer_chunked, _ = first_steps(
            tokenizer, dataset, tmp_path / "chunked", use_liger_kernel=True, loss_chunk_size=64, **dict(extra)
        )
    assert trainer_full.logprob_path is LogProbPath.FULL
    assert trainer_chunked.logprob_path is LogProbPath.CHUNKED  # no CUDA/liger here: the built-in path
    assert "chunked loss" in caplog.text and "use_liger_kernel=True" in caplog.text
    assert len(losses_full) == len(losses_chunked) == 2
    # token-mean NLLs ~10.4 of same-sign terms: relative to themselves = relative to the summands. Step 2 follows
    # an AdamW step from gradients that agree to ~1e-7, so it agrees to rounding too; a real path error is >= 1e-3.
    for full, chunked in zip(losses_full, losses_chunked):
        assert chunked == pytest.approx(full, rel=RTOL)
    assert grads_full.keys() == grads_chunked.keys()
    for name, reference in grads_full.items():  # max abs difference over max |gradient| (see test_sft_exactness)
        assert rel_diff(grads_chunked[name], reference) <= RTOL, name


def test_chunked_path_evaluates_without_logits(tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 12)
    _, _, full, _ = first_steps(tokenizer, dataset, tmp_path / "full", steps=1, learning_rate=0.0, chunked_loss=False)
    _, _, chunked, _ = first_steps(tokenizer, dataset, tmp_path / "chunked", steps=1, learning_rate=0.0,
                                   use_liger_kernel=True)
    full_eval = full.evaluate(full.train_dataset)["eval_loss"]
    assert chunked.evaluate(chunked.train_dataset)["eval_loss"] == pytest.approx(full_eval, rel=RTOL)  # as above


def test_activation_offloading_gives_the_same_training(tokenizer, gsm8k_rows, tmp_path, monkeypatch):
    """On CPU the offloader is pointed at a CPU target so that real copies happen (the injectable target)."""
    from leantune.memory import offloading

    made = []
    real_context = offloading.offloading_context

    def copying_context(enabled, model=None, **kwargs):
        context = real_context(enabled, model, **{**kwargs, "offload_device": "cpu", "min_offload_bytes": 1024})
        made.append(context)
        return context

    monkeypatch.setattr(offloading, "offloading_context", copying_context)
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    grads_plain, losses_plain, _, _ = first_steps(tokenizer, dataset, tmp_path / "plain", chunked_loss=False)
    made.clear()
    grads_off, losses_off, _, _ = first_steps(tokenizer, dataset, tmp_path / "offload", activation_offloading=True,
                                              use_liger_kernel=True)
    offloaded = sum(getattr(c, "stats", {}).get("tensors_offloaded", 0) for c in made)
    assert offloaded > 0, "nothing was offloaded: the test would prove nothing"
    for plain, off in zip(losses_plain, losses_off):  # offloading moves bytes; chunked vs full head: as above
        assert off == pytest.approx(plain, rel=RTOL)
    for name, reference in grads_plain.items():
        assert rel_diff(grads_off[name], reference) <= RTOL, name


def test_memory_breakdown_is_logged_and_adds_up(tokenizer, gsm8k_rows, tmp_path, caplog):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    with caplog.at_level(logging.INFO, logger="leantune"):
        _, _, trainer, output = first_steps(tokenizer, dataset, tmp_path, steps=3)
    metrics = output.metrics
    model = trainer.model
    param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    # memory figures are logged in MiB to 1 decimal (+-0.05 each): the bounds allow that rounding, not more
    assert metrics["memory_parameters_mb"] == pytest.approx(param_mib, abs=0.1)
    # AdamW keeps two fp32 moments per trainable parameter (and a scalar step each).
    assert metrics["memory_optimizer_states_mb"] == pytest.approx(2 * param_mib, abs=0.2)
    parts = sum(metrics[f"memory_{name}_mb"] for name in ("parameters", "buffers", "gradients", "optimizer_states",
                                                          "activations", "temporaries", "other"))
    assert metrics["memory_step_peak_mb"] == pytest.approx(parts, abs=0.5)  # 8 rounded figures: 8 x 0.05 = 0.4
    assert metrics["memory_activations_mb"] + metrics["memory_temporaries_mb"] > 0
    assert "Memory of training step 2" in caplog.text


def test_chunked_loss_lowers_the_measured_peak(tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    _, _, _, full = first_steps(tokenizer, dataset, tmp_path / "full", chunked_loss=False)
    _, _, _, chunked = first_steps(tokenizer, dataset, tmp_path / "chunked", loss_chunk_size=64)  # the default
    logits_mib = 4 * 256 * 32000 * 4 / 2**20  # at most a batch of 4 x 256 tokens of fp32 logits
    saved = full.metrics["memory_step_peak_mb"] - chunked.metrics["memory_step_peak_mb"]
    assert saved > 0.5 * full.metrics["memory_temporaries_mb"]
    assert chunked.metrics["memory_temporaries_mb"] < logits_mib / 2


@pytest.mark.quick
def test_bad_memory_options():
    with pytest.raises(ValueError, match="loss_chunk_size"):
        SFTConfig(output_dir="x", loss_chunk_size=0, use_cpu=True)
    with pytest.raises(ValueError, match="activation_offloading_min_bytes"):
        SFTConfig(output_dir="x", activation_offloading_min_bytes=-1, use_cpu=True)


@pytest.mark.parametrize("flag", ["use_liger_kernel", "use_liger_loss"])
def test_either_trl_flag_asks_for_the_fused_loss(flag, tokenizer, gsm8k_rows, tmp_path, caplog):
    from leantune import SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **{flag: True})
    with caplog.at_level(logging.WARNING, logger="leantune"):
        trainer = SFTTrainer(model=tiny_model(), processing_class=tokenizer,
                             train_dataset=gsm8k_prompt_completion(gsm8k_rows, 4), args=config)
    assert trainer.logprob_path is LogProbPath.CHUNKED
    assert f"{flag}=True" in caplog.text
    assert trainer.args.use_liger_kernel is False  # transformers must not try to patch the model with liger
    assert getattr(config, flag) is True  # resolved on the trainer's copy: the user's config is left as given


@pytest.mark.quick
def test_chunked_path_is_the_default_and_can_be_turned_off(tokenizer, gsm8k_rows, tmp_path):
    from leantune import SFTTrainer

    data = gsm8k_prompt_completion(gsm8k_rows, 4)
    for chunked, path in ((True, LogProbPath.CHUNKED), (False, LogProbPath.FULL)):
        args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], chunked_loss=chunked)
        trainer = SFTTrainer(model=tiny_model(), args=args, train_dataset=data, processing_class=tokenizer)
        assert trainer.logprob_path is path
