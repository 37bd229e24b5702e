"""An online round's micro-batch trained in parts of whole prompt groups: the out-of-memory retry's split
(step_guards.py) for GRPO, RLOO and Online DPO.

A part is collated from its completions' examples as the round collates a micro-batch, so it is the micro-batch a run
configured with the smaller micro-batch trains on. It takes its share of what the round attached: per completion
(advantages, Online DPO's `chosen`) by completion, per target (old, reference and sampling log-probs) by target, in
the flat target order, which runs completion after completion, so the parts' targets follow each other. Advantages,
chosen completions and the KL in RLOO's reward were computed over the whole round before any split, and the parts
hold whole groups, so none of them changes. Its item count is the method's own count of the part: the parts' counts
add up to the micro-batch's, and the optimizer step's divisor (counted before the step) is the configured run's. Each
method sums its loss over completions or tokens before that one division (GRPO's `grpo`, `dapo`, `dr_grpo`, ...
loss types, RLOO's sequences, Online DPO's pairs), so the parts' gradients add up to the micro-batch's. Where a
method's loss would change in parts (GRPO's `bnpo`, its entropy options; PPO), the method says why: `split_problem`.
"""

from __future__ import annotations

import torch

PER_TARGET = ("old_logps", "ref_logps", "sampling_logps")  # the round's per-target inputs of the loss
COUNTS = ("num_sequences", "loss_items")  # the micro-batch's own counts, counted again for each part


class RoundParts:
    """`trainer`: the online trainer whose rounds' micro-batches are split (read when a split is needed)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def problem(self) -> str | None:
        """Why the method's loss would not be the same in smaller micro-batches (None: it is): the method says."""
        return self.trainer.split_problem()

    def part(self, batch: dict, examples: list[dict], start: int, stop: int) -> dict:
        """The micro-batch of examples[start:stop] (whole groups) of the round's micro-batch `batch`."""
        collate, count_targets = self.trainer.rounds.collate, self.trainer.target_reading.count
        part = collate(examples[start:stop])
        first = count_targets(collate(examples[:start])) if start else 0
        last = first + count_targets(part)
        for key, value in batch.items():
            if key in part or key in COUNTS:
                continue
            if key in PER_TARGET:
                if last > len(value) or (stop == len(examples) and last != len(value)):
                    raise RuntimeError(f"{key}: {len(value)} values for the micro-batch's targets, its parts end at "
                                       f"{last}; the micro-batch cannot be split")
                part[key] = value[first:last]
            elif isinstance(value, torch.Tensor) and value.dim() and len(value) == len(examples):
                part[key] = value[start:stop]  # per completion
            else:
                raise RuntimeError(f"The round's `{key}` is neither per completion nor per target; the micro-batch "
                                   f"cannot be split")
        part["num_sequences"] = torch.tensor(stop - start)
        part["loss_items"] = self.trainer.loss_items(part)
        return part
