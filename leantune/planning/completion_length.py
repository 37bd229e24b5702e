"""`leantune plan --solve max_completion_length`: the longest completions an online run can generate and train on
within a budget. Only `max_completion_length` varies, so the prompt groups, the micro-batch and the global batch stay
as configured; each length is planned whole (the generation round and the update step, planner.plan_memory), and
since both only grow with it, a bisection finds the largest length whose device total fits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass
class CompletionLengthSolve:
    budget: int
    limit: int  # the longest the model's context leaves beside the longest prompt
    length: int | None  # the largest that fits, None when not even one token does
    fitting_total: int | None  # its planned device total
    next_total: int | None  # the planned device total one token longer (None at the context's limit)
    plans: int  # how many lengths were planned

    def lines(self) -> list[str]:
        if self.length is None:
            return [f"max_completion_length: none fits {self.budget / MIB:.1f} MiB (one token is planned at "
                    f"{self.next_total / MIB:.1f} MiB); lower the generation batch or the prompts' length"]
        beyond = (f"; {self.length + 1} plans {self.next_total / MIB:.1f} MiB" if self.next_total is not None
                  else "; the model's context leaves no more beside the longest prompt")
        return [f"largest max_completion_length within {self.budget / MIB:.1f} MiB: {self.length} (planned "
                f"{self.fitting_total / MIB:.1f} MiB{beyond}); prompt groups, micro-batch and global batch as "
                f"configured ({self.plans} lengths planned)"]


def solve_max_completion_length(total_at: Callable[[int], int], budget: int, limit: int,
                                start: int | None = None, start_total: int | None = None) -> CompletionLengthSolve:
    """The largest length in [1, limit] with total_at(length) <= budget (total_at: a length's planned device total,
    growing with the length); `start` / `start_total`: a length already planned."""
    totals: dict[int, int] = {}
    if start is not None and start_total is not None and 1 <= start <= limit:
        totals[start] = start_total

    def total(length: int) -> int:
        if length not in totals:
            totals[length] = total_at(length)
        return totals[length]

    fits, too_long = 0, limit + 1  # the largest known to fit (0: none yet), the smallest known not to
    for length, value in totals.items():
        fits, too_long = (max(fits, length), too_long) if value <= budget else (fits, min(too_long, length))
    if too_long > limit and total(limit) <= budget:
        return CompletionLengthSolve(budget, limit, limit, total(limit), None, len(totals))
    too_long = min(too_long, limit)
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        fits, too_long = (middle, too_long) if total(middle) <= budget else (fits, middle)
    if fits == 0:
        return CompletionLengthSolve(budget, limit, None, None, total(1), len(totals))
    return CompletionLengthSolve(budget, limit, fits, total(fits), total(too_long), len(totals))
