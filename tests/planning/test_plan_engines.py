"""Per-rank plans (planning/sharded.py): rank 0 of an N-process DDP or FSDP2 launch traced in this process.

The launched check (`assert_rank_zero_planned`) runs inside tests/test_scale_out.py, on the 2-process DDP and FSDP2
launches that test already makes: their `sft` case measures its step 2 (memory_breakdown=True) on every rank, and the
plan of rank 0 must give the same numbers. The in-process test here needs no launch."""

from __future__ import annotations

import json
import os

import pytest

from leantune.planning import plan_memory

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

# tests/scripts/engine_run.py's `sft` case: what each of its 2 processes trains
ENGINE_RUN_SFT = dict(per_device_train_batch_size=2, max_length=64, max_steps=2, learning_rate=1e-2, optim="sgd",
                      optim_args="momentum=0.9", max_grad_norm=0.0, seed=0, data_seed=0)


def assert_rank_zero_planned(assets, out, engine: str) -> None:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    with open(out / "sft" / "rank0.json", encoding="utf-8") as handle:
        measured = json.load(handle)["memory"]
    data = load_dataset("json", data_files=str(assets.root / "sft.jsonl"))["train"]
    plan = plan_memory(str(assets.model), data, "sft", processing_class=AutoTokenizer.from_pretrained(str(assets.model)),
                       num_processes=2, engine=engine, **ENGINE_RUN_SFT)
    predicted, parts = plan.measured_step, measured["parts"]
    # Both sides are MemTracker's sums of the same tensors' sizes on rank 0 (real there, fake here), independent of
    # timing: equal to the byte in bench/plan_accuracy.py --engines (docs/benchmarks.md). What a rank holds across the
    # step (its parameters, gradients and momentum buffers: under FSDP2 its shards, half of every parameter's rows)
    # has sizes without any freedom, so they must be exact.
    for part in ("parameters", "gradients", "optimizer_states", "activations"):
        assert predicted.parts.get(part, 0) == parts.get(part, 0), (part, predicted, measured)
    # 2% of the peak: the bound the plan promises (measured: equal to the byte). Under FSDP2 this run peaks at the
    # output head's reduce-scatter, where gloo's staged copy of its input (7.8 MiB, 16% of the peak) is the last
    # piece: a plan without it fails here.
    assert abs(predicted.peak_bytes - measured["peak"]) <= 0.02 * measured["peak"], (predicted, measured)
    assert abs(predicted.parts.get("temporaries", 0) - parts.get("temporaries", 0)) <= 0.02 * measured["peak"]


def test_sharded_plans_are_rank_zero_and_leave_nothing_behind(tokenizer, gsm8k_rows):
    import torch.distributed as dist
    from accelerate.state import PartialState

    config = tiny_model().config
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    plans = {(engine, n): plan_memory(config, dataset, "sft", processing_class=tokenizer, num_processes=n,
                                      engine=engine, **ENGINE_RUN_SFT)
             for engine, n in [("fsdp2", 2), ("ddp", 2)]}
    # the fake process group, accelerate's shared state (rebuilt by the next trainer: one process) and the launch's
    # environment are gone after each plan
    assert not dist.is_initialized() and not PartialState._shared_state
    assert "WORLD_SIZE" not in os.environ and "ACCELERATE_USE_FSDP" not in os.environ
    fsdp2, ddp = plans["fsdp2", 2].measured_step, plans["ddp", 2].measured_step
    trained = sum(p.numel() for p in tiny_model().parameters()) * 4  # fp32 bytes of every parameter (P)
    # SGD's momentum: P under DDP (as in one process); FSDP2 keeps rank 0's dim-0 shard of each parameter, exactly
    # P/2 here (every first dimension of this model is even, so FSDP2 pads nothing)
    assert ddp.parts["optimizer_states"] == trained and ddp.parts["parameters"] == trained
    assert fsdp2.parts["optimizer_states"] * 2 == trained
    # DDP rebuilds its gradient buckets (a flat copy of every gradient, P) in step 2: held as activations from then on
    assert ddp.parts["activations"] >= trained
    assert plans["fsdp2", 2].worst.peak_bytes >= fsdp2.peak_bytes
    with pytest.raises(ValueError, match="cp"):  # context parallelism: not planned, refused with the engine named
        plan_memory(config, dataset, "sft", processing_class=tokenizer, num_processes=2, engine="cp")
