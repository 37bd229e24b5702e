"""The plan's bound over every order: the longest rows together (planning/any_order.py), traced, equals what a real
run measures when that batch is the one it trains on, and no other seed's step exceeds it."""

from __future__ import annotations

import contextlib
import io

from leantune import SFTConfig, SFTTrainer
from leantune.planning import plan_memory

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

FIELDS = dict(per_device_train_batch_size=3, max_length=192, gradient_checkpointing=False)


def _measured(dataset, tokenizer, seed):
    args = SFTConfig(output_dir="/tmp/leantune-test-any-order", use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True, memory_breakdown=True, max_steps=2, seed=seed, **FIELDS)
    trainer = SFTTrainer(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return trainer


def test_the_longest_rows_together_bound_every_order(tokenizer, gsm8k_rows):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 24)
    # measured_step=False: the trainer's own step 2 is not what this test reads (the traced batches and the bound are)
    plan = plan_memory(tiny_model().config, dataset, "sft", processing_class=tokenizer, measured_step=False,
                       **FIELDS)
    bound = plan.any_order
    assert bound is not None and bound.step is None and bound.peak_bytes >= plan.worst.peak_bytes
    assert plan.peak_bytes == bound.peak_bytes  # what a budget or plan_check must fit

    # A run whose every batch is those rows: its measured step is the bound. Both are MemTracker's sums of the same
    # tensors' sizes (real there, fake in the plan): equal to the byte; 2% is the plan's promise, per part too.
    first = _measured(dataset, tokenizer, seed=42)
    prepared = first.train_dataset
    assert len(prepared) == len(dataset)  # nothing dropped: prepared row i is raw row i
    by_tokens = sorted(range(len(prepared)), key=lambda i: -len(prepared[i]["input_ids"]))[:3]
    by_targets = sorted(range(len(prepared)), key=lambda i: -sum(t != -100 for t in prepared[i]["labels"]))[:3]
    only_longest = max((_measured(dataset.select(rows), tokenizer, seed=0).memory_breakdown
                        for rows in (by_tokens, by_targets)), key=lambda measured: measured.peak_bytes)
    assert abs(bound.peak_bytes - only_longest.peak_bytes) <= 0.02 * only_longest.peak_bytes
    for part, size in only_longest.parts.items():
        assert abs(bound.parts.get(part, 0) - size) <= 0.02 * only_longest.peak_bytes, part

    # other seeds shuffle the rows into other batches: none of their measured steps exceeds the bound
    for seed in (42, 7):
        measured = first.memory_breakdown if seed == 42 else _measured(dataset, tokenizer, seed).memory_breakdown
        assert measured.peak_bytes <= bound.peak_bytes, seed
