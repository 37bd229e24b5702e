"""Which launches are planned, and what a process of each holds that one process would not.

DDP and FSDP2 launches of N processes are traced as one rank of the launch in this process (planning/sharded.py):
a fake process group of N, the rank's own micro-batches, FSDP2's shards and gathered units, DDP's gradient buckets
where its reducer rebuilds them (step 2). ZeRO-2/3: the one-process trace with DeepSpeed's model states per rank
in place (zero.py). Context parallelism is not planned yet and is refused rather than guessed.
"""

from __future__ import annotations

ENGINES = ("ddp", "fsdp2", "zero2", "zero3", "cp")
PLANNED = ("ddp", "fsdp2", "zero2", "zero3")


def check_engine(engine: str, num_processes: int) -> None:
    if engine not in ENGINES:
        raise ValueError(f"`engine`: {engine!r} is not one of {', '.join(ENGINES)}.")
    if num_processes < 1:
        raise ValueError(f"`num_processes` must be >= 1, got {num_processes}.")
    if engine not in PLANNED and num_processes > 1:
        raise ValueError(f"`engine`: {engine} is not planned yet; `engine=fsdp2` plans the same launch without context "
                         "parallelism, whose activations bound it from above (docs/plan.md).")


def per_rank_notes(engine: str, num_processes: int) -> list[str]:
    if engine in ("zero2", "zero3"):
        return []  # planning/zero.py's notes
    if num_processes == 1:
        return []
    if engine == "fsdp2":
        return [f"FSDP2: one rank of {num_processes} processes traced (fake process group): its shards of parameters, "
                "gradients and optimizer states, each unit gathered for its forward and backward; the worst batch is "
                "the worst micro-batch of any rank."]
    return [f"DDP: one rank of {num_processes} processes traced (fake process group), with DDP's gradient buckets (a "
            "flat copy of the trained gradients, rebuilt in step 2); the worst batch is the worst micro-batch of any "
            "rank."]
