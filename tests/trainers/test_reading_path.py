"""A structural guard: following GRPO (its defaults, shared prompts on) through one training step, from `train()` to the
end of the first optimizer step, reads only leantune functions that the step needs (devkit/reading_path.py measures
it). Issue 36's target is at most 1,200 lines in at most 15 files. On 2026-11-29 the path went from 1,374 lines in 21
files to 1,328 lines in 18: one job per file (the round's prompt sampler in round_builder.py, the advantages in
policy_gradient.py, the NaN/inf guard and the out-of-memory retry in step_guards.py), and what every round shares
made once when the trainer is built (the transformers backend and its GenerationConfig, the reward functions' logging
callbacks); then 1,311 with the shared-prompt block layout built with the batch (data/collators.py) instead of in the
first layer's attention; then 1,296 lines in 15 files (issue 36's file target), each file that held one small step of
the path moved beside what uses it: the chunk order beside the chunked head (losses/token_logprobs.py), the
generation session beside the sampling settings and completions it runs on (generation/sampling.py), the step's loss
normaliser beside the trainer that holds it (trainers/base.py), and no forwarding `normalise` or second Liger
decision per step, GRPO's vespo loss a function of its own as the other loss types are; then 1,197 lines (issue 36's
line target), each choice made once when the trainer is built instead of checked at every call: the output head's
class is the engine's (one process, DDP, ZeRO-3/FSDP: models/output_head.py's `head_kind`), a round's share of the
completions is the processes' (`OneProcess` gathers nothing), the GRPO loss type's sum and divisor are taken once
(`LossAggregation`), the peak-memory meter is the device's, a dense model's forwards note no router loss, and the
log-prob engine's full-logits and Liger scorings and a stream's round loader are functions of their own. This test
holds issue 36's targets (1,200 lines in 15 files), now met."""

from __future__ import annotations

import pytest

from devkit.reading_path import TARGET_FILES, TARGET_LINES, reading_path

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

# What a GRPO step with every optional feature off must never enter: each is built only when its feature is on.
FEATURE_OFF_FILES = ("generation/zero3.py", "generation/backend.py", "trainers/parts/context_parallel.py",
                     "memory/checkpoint_offload.py", "losses/head_choice.py",
                     "trainers/parts/saving.py", "trainers/parts/distributed.py", "trainers/run_bounds.py",
                     "trainers/parts/optimizer_in_backward.py", "memory/tiled_mlp.py", "memory/offloading.py",
                     "models/gathered_attention.py")


def test_grpo_step_reads_only_what_it_needs():
    counts, spans = reading_path("grpo")
    # the step really ran through the trainer, the round and the loss (the tracer saw the path, not a shortcut)
    names = {name for functions in spans.values() for name in functions}
    assert {"OnlineTrainer.compute_loss", "GRPOTrainer.policy_loss", "RoundBuilder.training_round"} <= names
    entered = {path.split("leantune/", 1)[1] for path in spans}
    assert not entered & set(FEATURE_OFF_FILES), sorted(entered & set(FEATURE_OFF_FILES))
    # one process enters none of the other engines' code: their head and round share are chosen when it is built
    engines = {name for name in names if name.split(".")[0] in ("DDPOutputHead", "ShardedOutputHead", "ProcessShare")}
    assert not engines, sorted(engines)
    # issue 36's target, met (1,197 lines in 15 files reached): at most 1,200 lines in at most 15 files
    assert counts["function_lines"] <= TARGET_LINES and counts["files"] <= TARGET_FILES, counts
