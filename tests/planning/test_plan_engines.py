"""Per-rank plans (planning/sharded.py): rank 0 of an N-process DDP or FSDP2 launch traced in this process.

The launched check (`assert_rank_zero_planned`, tests/fixtures/launched_plans.py) runs inside tests/launch/test_scale_out.py, on the 2-process DDP and FSDP2
launches that test already makes: their `sft` case measures its step 2 (memory_breakdown=True) on every rank, and the
plan of rank 0 must give the same numbers. The in-process test here needs no launch."""

from __future__ import annotations

import os

import pytest

from leantune.planning import plan_memory

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.launched_plans import ENGINE_RUN_SFT
from ..fixtures.models import tiny_model


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
