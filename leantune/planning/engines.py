"""Which launches are planned, and what a process of each holds that one process would not.

Under DDP every process runs the whole step on its own micro-batch, so its traced step is the one-process step of
`per_device_train_batch_size`; DDP's gradient buckets live in C++ (invisible to MemTracker, so to the measured
breakdown too) and are listed as a device term (devices.py). FSDP2, ZeRO-2/3 and context parallelism shard what a
process holds; their per-rank plan is not traced yet and is refused rather than guessed.
"""

from __future__ import annotations

ENGINES = ("ddp", "fsdp2", "zero2", "zero3", "cp")
PLANNED = ("ddp", "fsdp2")


def check_engine(engine: str, num_processes: int) -> None:
    if engine not in ENGINES:
        raise ValueError(f"`engine`: {engine!r} is not one of {', '.join(ENGINES)}.")
    if num_processes < 1:
        raise ValueError(f"`num_processes` must be >= 1, got {num_processes}.")
    if engine not in PLANNED and num_processes > 1:
        raise ValueError(f"`engine`: {engine} is not planned yet (its per-rank shards are not traced); plan with "
                         "`engine=ddp`, whose per-process step is the one-process step (docs/plan.md).")


def per_rank_notes(engine: str, num_processes: int) -> list[str]:
    if num_processes == 1:
        return []
    return [f"DDP: each of the {num_processes} processes runs this step on its own micro-batch; the worst batch and "
            "its step are those of a one-process loader (each process sees a different shard of the data)."]
