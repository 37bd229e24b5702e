"""GPU-only paths: skipped without CUDA (and without the extra they need). Run them where a GPU is lent."""

from __future__ import annotations

import pytest
import torch

from leantune import SFTConfig, SFTTrainer
from leantune.utils.imports import is_available

from .conftest import gsm8k_prompt_completion, tiny_model
from .test_sft_exactness import rel_diff, sequence_losses, whole_dataset_batch

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
    assert trainer.train().metrics["train_loss"] > 0
