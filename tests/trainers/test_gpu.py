"""GPU-only paths: skipped without CUDA (and without the extra they need). Run them where a GPU is lent."""

from __future__ import annotations

import pytest
import torch

from leantune import SFTConfig, SFTTrainer
from leantune.utils.imports import is_available

from ..fixtures.comparisons import rel_diff
from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model
from ..fixtures.sft_layouts import sequence_losses, whole_dataset_batch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_trainer(model, tokenizer, dataset, tmp_path, **overrides):
    args = SFTConfig(output_dir=str(tmp_path), max_length=256, report_to=[], save_strategy="no", max_steps=2,
                     per_device_train_batch_size=4, bf16=False, **overrides)
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


@cuda
@pytest.mark.skipif(not is_available("flash_attn"), reason="needs leantune[flash-attn]")
def test_flash_attention_varlen_packed_equals_padded(tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    model = tiny_model(attn_implementation="flash_attention_2").to("cuda", torch.bfloat16)
    padded = sequence_losses(model, {k: v.cuda() if torch.is_tensor(v) else v
                                     for k, v in whole_dataset_batch(gpu_trainer(model, tokenizer, dataset, tmp_path / "a")).items()})
    packed_trainer = gpu_trainer(model, tokenizer, dataset, tmp_path / "b", packing=True)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in whole_dataset_batch(packed_trainer).items()}
    packed = sequence_losses(model, batch)
    for key, reference in padded.items():
        assert rel_diff(packed[key], reference) <= 2e-2  # bf16 kernels: different reduction orders


@cuda
def test_peak_memory_is_cuda_max_allocated(tokenizer, gsm8k_rows, tmp_path):
    model = tiny_model().cuda()
    metrics = gpu_trainer(model, tokenizer, gsm8k_prompt_completion(gsm8k_rows, 8), tmp_path).train().metrics
    assert metrics["peak_memory_kind"] == "cuda_max_allocated" and metrics["peak_memory_mb"] > 0


@cuda
@pytest.mark.skipif(not is_available("bitsandbytes"), reason="needs leantune[bitsandbytes]")
def test_4bit_lora_trains(tokenizer, gsm8k_rows, tmp_path):
    """The CUDA path of 4-bit LoRA: the model loads on the current GPU. Gradients, every trainer, the CPU repacking
    guard and the CLI are tested on CPU in tests/models/test_quantization.py."""
    from peft import LoraConfig

    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    trainer = SFTTrainer(
        model=str(model_dir),
        args=SFTConfig(output_dir=str(tmp_path / "out"), max_steps=3, report_to=[], save_strategy="no",
                       max_length=128, model_init_kwargs={"quantization_config": {"load_in_4bit": True}}),
        train_dataset=gsm8k_prompt_completion(gsm8k_rows, 8),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    assert next(p for n, p in trainer.model.named_parameters() if "lora" in n).device.type == "cuda"
    assert trainer.train().metrics["train_loss"] > 0


def first_step_gradients(trainer):
    from ..fixtures.comparisons import GradientRecorder

    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    losses = [trainer.train().metrics["train_loss"]]
    return recorder.grads, losses


@cuda
@pytest.mark.skipif(not is_available("liger_kernel"), reason="needs leantune[liger]")
def test_liger_loss_matches_the_chunked_path_in_bf16(tokenizer, gsm8k_rows, tmp_path, monkeypatch):
    """use_liger_kernel=True on CUDA runs Liger's fused kernel; the built-in chunked path is the reference."""
    from leantune.trainers.parts import logprob_engine as dispatch
    from leantune.trainers.parts.logprob_engine import LogProbPath

    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    results = {}
    for path in ("liger", "chunked"):
        if path == "chunked":
            monkeypatch.setattr(dispatch, "liger_unavailable_reason", lambda device_type: "forced for the test")
        model = tiny_model().to("cuda", torch.bfloat16)
        trainer = gpu_trainer(model, tokenizer, dataset, tmp_path / path, use_liger_kernel=True, max_steps=1,
                              max_grad_norm=0.0)
        assert trainer.logprob_path is (LogProbPath.LIGER if path == "liger" else LogProbPath.CHUNKED)
        results[path] = first_step_gradients(trainer)
    (liger_grads, liger_loss), (chunked_grads, chunked_loss) = results["liger"], results["chunked"]
    assert liger_loss[0] == pytest.approx(chunked_loss[0], rel=1e-2)
    for name, reference in chunked_grads.items():
        assert rel_diff(liger_grads[name].float(), reference.float()) <= 5e-2, name  # bf16 kernels


@cuda
def test_chunked_loss_lowers_cuda_peak(tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    peaks = {}
    for fused in (False, True):
        model = tiny_model(vocab_size=128_256).cuda()
        metrics = gpu_trainer(model, tokenizer, dataset, tmp_path / str(fused), use_liger_kernel=fused).train().metrics
        peaks[fused] = metrics["memory_allocator_peak_mb"]
    logits_mib = 4 * 256 * 128_256 * 4 / 2**20
    assert peaks[False] - peaks[True] > 0.5 * logits_mib
