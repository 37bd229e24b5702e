"""The memory breakdown's parts where MemTracker's own filing misleads: the optimizer step's temporaries (filed as
optimizer states) and the tensors a sharding engine holds outside the module and the optimizer's state (DeepSpeed)."""

from __future__ import annotations

import types

import pytest
import torch

from leantune.metrics.memory_breakdown import StepMemoryMeter, _engine_tensors

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

MIB = 2 ** 20


def test_optimizer_step_temporaries_are_not_counted_as_optimizer_states():
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of fp32 weights
    size = model.weight.numel() * 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step():
        model(torch.randn(2, 1024)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the moments exist from here on
    meter = StepMemoryMeter("cpu")
    meter.start(model, optimizer)
    step()
    breakdown = meter.stop(1)
    # the peak is inside AdamW's update (weights, gradient, 2 moments and the update's temporaries): MemTracker files
    # those temporaries as optimizer states; only the moments are held once the step is over
    assert breakdown.parts["parameters"] == size
    assert breakdown.parts["optimizer_states"] == 2 * size + 4  # the moments and AdamW's 0-d fp32 step count
    assert breakdown.parts["temporaries"] >= size
    assert breakdown.peak_bytes == sum(breakdown.parts.values())


def test_deepspeed_partitions_and_master_copy_are_filed_by_part():
    from torch.distributed._tools.mem_tracker import _MemRefType

    model = torch.nn.Linear(8, 8)
    for param in model.parameters():  # ZeRO-3: an empty placeholder, the partition in ds_tensor
        param.ds_tensor = torch.zeros(param.numel() // 2)
    zero = types.new_class("DeepSpeedZeroOptimizer_Stage3")()
    type(zero).__module__ = "deepspeed.runtime.zero.stage3"
    zero.fp32_partitioned_groups_flat = [torch.zeros(36)]
    zero.grad_partitions_flat_buffer = torch.zeros(36)
    zero.ipg_buckets = {torch.float32: types.SimpleNamespace(buffer=torch.zeros(100))}
    wrapper = types.SimpleNamespace(optimizer=zero)  # accelerate's optimizer wrapper around DeepSpeed's
    found = _engine_tensors(model, wrapper)
    assert [t.numel() for t in found[_MemRefType.PARAM]] == [32, 4]
    assert [t.numel() for t in found[_MemRefType.OPT]] == [36]
    assert sorted(t.numel() for t in found[_MemRefType.GRAD]) == [36, 100]
    assert _engine_tensors(torch.nn.Linear(8, 8), torch.optim.SGD(model.parameters(), lr=0.1)) == {}


def test_an_ops_internal_buffer_is_counted_as_the_allocator_sees_it():
    # aten::logsumexp forms `input - max` inside the op (as large as its input) and frees it before returning: the
    # breakdown counts it (metrics/op_scratch.py) and must then equal the CPU allocator's own peak, from
    # torch.profiler's memory events (nothing shared with MemTracker), to the byte
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 4096)
    inputs = torch.randn(256, 64)

    def step():
        torch.logsumexp(model(inputs), dim=-1)

    meter = StepMemoryMeter("cpu")
    meter.start(model)
    step()
    breakdown = meter.stop(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]":
            live += event.nbytes()
            peak = max(peak, live)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak > 2 * 256 * 4096 * 4  # the logits and the op's buffer at once
    assert breakdown.peak_bytes == weights + peak
