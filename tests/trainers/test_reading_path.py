"""A structural guard (issue 25): following GRPO through one training step, from `train()` to the end of the first
optimizer step, reads at most 1,500 lines of leantune's functions (devkit/reading_path.py measures it)."""

from __future__ import annotations

import pytest

from devkit.reading_path import reading_path

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds


def test_grpo_step_reads_at_most_1500_lines_of_functions():
    counts, spans = reading_path("grpo")
    # the step really ran through the trainer, the round and the loss (the tracer saw the path, not a shortcut)
    names = {name for functions in spans.values() for name in functions}
    assert {"OnlineTrainer.compute_loss", "GRPOTrainer.policy_loss", "RoundBuilder.training_round"} <= names
    assert counts["function_lines"] <= 1500, counts
