"""The planner counts the optimizer's state memory as the run keeps it: with the step inside the backward
(`optimizer_in_backward`) the traced step's gradients are at most the largest parameter's at once (each gradient is
freed by its parameter's hook), and the optimizer states stay AdamW's two fp32 moments per parameter.

Both plans trace the trainer's own step with fake weights (planning/fake_step.py), so the accounting is the run's
own code: the planner needs no term of its own for it."""

from __future__ import annotations

import pytest

from leantune.planning import plan_memory

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model


@pytest.mark.quick
def test_a_plan_with_the_step_inside_the_backward_holds_one_parameters_gradient(tokenizer, gsm8k_rows):
    model = tiny_model()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    dataset = gsm8k_prompt_completion(gsm8k_rows, 8)
    # short rows and small loss chunks: the step peaks after the forward, where the gradients are
    fields = dict(per_device_train_batch_size=1, max_length=32, loss_chunk_size=8, max_grad_norm=0.0)
    ordinary = plan_memory(model.config, dataset, "sft", processing_class=tokenizer, **fields)
    inside = plan_memory(model.config, dataset, "sft", processing_class=tokenizer, optimizer_in_backward=True,
                         **fields)
    # ordinary: its peak in the backward holds the head's gradient and more; inside: never more than one parameter's
    assert inside.measured_step.parts.get("gradients", 0) <= max(sizes) < ordinary.measured_step.parts["gradients"]
    # AdamW's two fp32 moments per parameter either way (plus its step counts, a few bytes per parameter tensor)
    for plan in (ordinary, inside):
        assert 2 * sum(sizes) <= plan.measured_step.parts["optimizer_states"] <= 2 * sum(sizes) + 64 * len(sizes)
    assert inside.measured_step.peak_bytes < ordinary.measured_step.peak_bytes
