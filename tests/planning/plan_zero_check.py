"""The per-rank plan under DeepSpeed ZeRO-2/3 (leantune/planning/zero.py) against the measured breakdown of the real
2-process runs that tests/test_scale_out.py launches anyway (its "sft" case records MemTracker's second step on each
process, tests/scripts/engine_run.py): no launch of its own.

Bounds. The model states DeepSpeed holds per rank (partitions, master copy, momentum, gradient partitions and
bucket) are sizes from DeepSpeed's rules, so they must equal the measured parts to the byte; a wrong padding or a
missed partition moves them by at least one parameter's partition (kilobytes). The peak also holds the step's
activations, which the one-process trace of the rank's own batches gives; the rest is DeepSpeed's bookkeeping
tensors (measured: 1e-7 of the peak here, 6 KiB at most in bench/plan_accuracy.py --engines zero), so the peak is
asserted within 0.1%: the smallest term that could be missed, the gathered head (32000 x 64 fp32, 7.8 MiB), is
0.4% of this peak (DeepSpeed's default 5e8-element bucket, 1.9 GiB, is most of it).
"""

from __future__ import annotations

import json
from pathlib import Path

PEAK_RTOL = 1e-3
STATE_PARTS = ("parameters", "gradients", "optimizer_states")


def engine_run_fields(processes: int) -> dict:
    """tests/scripts/engine_run.py's "sft" case (`common` + `sft`), as the plan's config fields."""
    return dict(per_device_train_batch_size=4 // processes, max_steps=2, logging_steps=1, learning_rate=1e-2,
                optim="sgd", optim_args="momentum=0.9", max_grad_norm=0.0, seed=0, data_seed=0, max_length=64)


def assert_zero_plan_matches(assets, out: Path, engine: str, deepspeed_file: Path | None) -> list[float]:
    """Plan each rank's second step of the "sft" case and compare it with that rank's measured breakdown."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from leantune import plan_memory

    records = [json.loads(p.read_text()) for p in sorted((out / "sft").glob("rank*.json"))]
    assert len(records) == 2 and all("memory" in r for r in records), records
    data = load_dataset("json", data_files=str(assets.root / "sft.jsonl"))["train"]
    tokenizer = AutoTokenizer.from_pretrained(str(assets.model))
    errors = []
    for rank, record in enumerate(records):
        fields = engine_run_fields(2)
        if deepspeed_file is not None:
            fields["deepspeed"] = str(deepspeed_file)
        plan = plan_memory(str(assets.model), data, "sft", processing_class=tokenizer, num_processes=2,
                           engine=engine, rank=rank, max_batches=1, **fields)  # the worst batch is not compared
        measured, predicted = {"peak": record["memory"]["peak"], **record["memory"]["parts"]}, plan.measured_step
        for part in STATE_PARTS:
            assert predicted.parts.get(part, 0) == measured.get(part, 0), (engine, rank, part, predicted.parts,
                                                                         measured)
        error = (predicted.peak_bytes - measured["peak"]) / measured["peak"]
        if engine == "zero2" and abs(error) > PEAK_RTOL:
            # ZeRO-2 reduces the bucket one owner's slice after another; a rank holds its reduced slice (P/N, fp32)
            # at the end of backward in some runs and not in others, on either rank (timing: seen on rank 1 when the
            # suite ran beside other tests; docs/plan.md). The plan counts it on rank 0 only; either outcome is
            # accepted, within the same bound
            held = -(-plan.trainable_parameters // 4) * 4 // 2 * 4
            error = min((error + sign * held / measured["peak"] for sign in (-1, 1)), key=abs)
        assert abs(error) <= PEAK_RTOL, (engine, rank, predicted.peak_bytes, measured)
        errors.append(error)
    return errors
