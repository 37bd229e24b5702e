"""`max_completions_per_generate` within a budget: the largest piece of whole prompt groups each `generate` call may
take so that the generation round fits (`leantune plan --solve max_completions_per_generate`, and `memory_budget`
when the round is what exceeds it).

Only the round's pieces vary: the round, its groups, the micro-batch and the global batch stay as configured, so the
update steps are the plan's own; a piece's KV cache and decode logits are per sequence (generation_round.py), so each
size is figured from the one plan, not traced again. What is learned stays the same in distribution only: the
pieces continue the round's seeded sampling stream, so their completions are not token for token one call's.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024
SAME_IN_DISTRIBUTION = ("the pieces continue the round's seeded sampling stream: completions from the same "
                        "distribution, not token for token those of one call, so what is learned is the same in "
                        "distribution")


@dataclass
class GenerationBatchSolve:
    budget: int
    group: int  # completions of one prompt group (num_generations)
    round_sequences: int  # the round's completions per process
    size: int | None  # the largest piece whose round fits, None when not even one group's does
    fitting_total: int | None  # the round's device total with that piece
    next_total: int | None  # with one group more (None: the piece is the whole round)
    step_total: int  # the update step alone on the device: the round cannot bring the plan below it

    def lines(self) -> list[str]:
        if self.size is None:
            return [f"max_completions_per_generate: none fits {self.budget / MIB:.1f} MiB (a round of one group of "
                    f"{self.group} per call plans {self.next_total / MIB:.1f} MiB); lower max_completion_length or "
                    f"the prompts' length"]
        beyond = (f"; {self.size + self.group} plans {self.next_total / MIB:.1f} MiB" if self.next_total is not None
                  else "; the whole round in one call")
        out = [f"largest max_completions_per_generate within {self.budget / MIB:.1f} MiB: {self.size} of the round's "
               f"{self.round_sequences} completions per process (its round planned {self.fitting_total / MIB:.1f} MiB"
               f"{beyond}); "
               f"the round, prompt groups, micro-batch and global batch as configured; {SAME_IN_DISTRIBUTION}"]
        if self.step_total > self.budget:
            out.append(f"  the update step alone plans {self.step_total / MIB:.1f} MiB, over the budget whatever the "
                       f"piece: see the candidates that learn the same thing")
        return out


def round_total(plan, size: int) -> int:
    """The device total of `plan`'s generation round alone, generated `size` sequences per call."""
    return plan.generation.with_batch(size).peak_bytes + sum(term.bytes for term in plan.terms)


def solve_generation_batch(plan, budget: int, group: int) -> GenerationBatchSolve:
    """The largest multiple of `group` (up to the round) whose round, on the device, fits `budget`; a plan without a
    transformers round (vLLM's pool is reserved at start) has nothing to solve (ValueError)."""
    generation = plan.generation
    if generation is None or generation.backend != "transformers":
        raise ValueError("max_completions_per_generate sizes transformers' generate; this run's round "
                         + ("is vLLM's (its pool is reserved at start)" if generation is not None else "is not planned"))
    whole = max(generation.round_sequences, generation.batch)
    sizes = sorted({*range(group, whole + 1, group), whole})
    fitting = [size for size in sizes if round_total(plan, size) <= budget]
    step_total = _step_total(plan)
    if not fitting:
        return GenerationBatchSolve(budget, group, whole, None, None, round_total(plan, sizes[0]), step_total)
    size = fitting[-1]
    larger = [s for s in sizes if s > size]
    return GenerationBatchSolve(budget, group, whole, size, round_total(plan, size),
                                round_total(plan, larger[0]) if larger else None, step_total)


def pieces_for_budget(plan, budget: int, group: int) -> GenerationBatchSolve | None:
    """Where transformers' generation round, as configured, is what exceeds `budget`: the solve for the largest piece
    (its `size` None when not even one group fits); otherwise None (no round, vLLM's, or one that fits)."""
    generation = plan.generation
    if generation is None or generation.backend != "transformers" or round_total(plan, generation.batch) <= budget:
        return None
    return solve_generation_batch(plan, budget, group)


def _step_total(plan) -> int:
    """The plan's device total without its round: the update steps and the device terms."""
    steps = max(plan.worst.peak_bytes, plan.any_order.peak_bytes if plan.any_order else 0)
    return steps + sum(term.bytes for term in plan.terms)
