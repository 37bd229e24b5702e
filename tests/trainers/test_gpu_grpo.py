"""GRPO/RLOO on a GPU: the trainer with CUDA, bf16, Liger requested, vLLM colocated with sleep mode, and DeepSpeed
ZeRO-3 with and without gathering for generation. Skipped without CUDA (and without the extra each needs).

Backend-level vLLM and ZeRO-3 checks live in tests/generation/test_gpu_online.py; these run the whole trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from datasets import Dataset

from leantune import GRPOConfig, GRPOTrainer
from leantune.trainers.parts.logprob_engine import LogProbPath
from leantune.utils.imports import is_available

from ..fixtures.data import count_a
from ..fixtures.models import tiny_model
from ..fixtures.paths import SCRIPTS

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.gpu


def prompts(n=32):
    return Dataset.from_dict({"prompt": [f"Write the letter a {i} times:" for i in range(n)]})


def gpu_config(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), report_to=[], save_strategy="no", disable_tqdm=True, max_steps=2,
                    per_device_train_batch_size=8, num_generations=4, max_completion_length=16, logging_steps=1,
                    learning_rate=1e-4, bf16=False, seed=0)
    settings.update(overrides)
    return GRPOConfig(**settings)


@cuda
def test_chunked_equals_full_on_cuda(tokenizer, tmp_path):
    from ..fixtures.online_rounds import loss_and_grads, one_round

    trainer = GRPOTrainer(tiny_model().cuda(), count_a, args=gpu_config(tmp_path, beta=0.1), train_dataset=prompts(),
                          processing_class=tokenizer)
    batch = one_round(trainer)[0]
    chunked_loss, chunked = loss_and_grads(trainer, batch)
    trainer.logprob_path = LogProbPath.FULL
    full_loss, full = loss_and_grads(trainer, batch)
    torch.testing.assert_close(chunked_loss, full_loss, rtol=1e-4, atol=1e-6)  # TF32/cuBLAS reduction order
    for name, grad in full.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-3, atol=1e-5)


@cuda
def test_bf16_training_with_liger_requested_and_offloading(tokenizer, tmp_path):
    args = gpu_config(tmp_path, bf16=True, use_liger_loss=True, activation_offloading=True, beta=0.04)
    trainer = GRPOTrainer(tiny_model(), count_a, args=args, train_dataset=prompts(), processing_class=tokenizer)
    metrics = trainer.train().metrics
    assert metrics["peak_memory_kind"] == "cuda_max_allocated"
    assert all("reward" in e for e in trainer.state.log_history if "loss" in e)


def _saved_model(tokenizer, tmp_path) -> str:
    path = tmp_path / "policy"
    tiny_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@cuda
@pytest.mark.skipif(not is_available("vllm"), reason="needs leantune[vllm]")
def test_vllm_colocate_with_sleep_mode_trains_and_never_generates_from_stale_weights(tokenizer, tmp_path):
    args = gpu_config(tmp_path / "out", use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                      vllm_gpu_memory_utilization=0.2, max_steps=3, learning_rate=1e-2)
    trainer = GRPOTrainer(_saved_model(tokenizer, tmp_path), count_a, args=args, train_dataset=prompts(),
                          processing_class=tokenizer)
    syncs = []
    trainer.train()
    backend = trainer.generation.backend
    original = backend.sync_weights
    backend.sync_weights = lambda model: (syncs.append(1), original(model))
    # after training the engine sleeps; with no optimizer step since the last sync, the trainer would not sync by
    # itself: waking must still force a sync before generating
    ids = trainer.generation.generate([trainer.train_dataset[0]["prompt_ids"]] * 2, trainer.generation.sampling)
    assert syncs and all(len(c) <= 16 for c in ids)


@cuda
@pytest.mark.skipif(not is_available("deepspeed"), reason="needs leantune[deepspeed]")
def test_zero3_gather_on_and_off_give_the_same_completions(tmp_path):
    config = tmp_path / "zero3.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 1\n"
                      "deepspeed_config:\n  zero_stage: 3\n  zero3_init_flag: false\n  offload_optimizer_device: none\n"
                      "  offload_param_device: none\nmixed_precision: 'no'\n")
    script = SCRIPTS / "grpo_zero3.py"
    results = {}
    for mode in ("gather", "sharded"):
        run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                              str(script), str(tmp_path), mode], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        assert run.returncode == 0, run.stderr[-4000:]
        results[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    assert results["gather"]["zero3"] and results["sharded"]["zero3"]
    assert results["gather"]["completions"] == results["sharded"]["completions"]
    print(f"peak MiB, gathered: {results['gather']['peak_memory_mb']}, sharded: {results['sharded']['peak_memory_mb']}")
