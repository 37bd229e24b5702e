"""`leantune plan --solve max_length`: the longest `max_length` whose step fits a budget, for an offline method (SFT,
DPO, KTO, reward, GKD; an online method's length is its completions': planning/completion_length.py).

Only `max_length` varies: the data, the model, the method and every technique stay as configured, so a length is the
longest the run as set up can train. Lengths are multiples of `step` (the answer is `length` that fits while
`length + step` does not), up to `limit`: the data's longest row, beyond which a longer `max_length` truncates nothing
more and plans the same. The step's memory only grows with the length, so a bisection finds it in log2(limit / step)
plans, each of them a whole plan (planner.plan_memory), whose time does not grow with the length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..metrics.memory_breakdown import MIB

GIB = 1024 * MIB


def size_words(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / MIB:.1f} MiB"


def dominant_part(plan) -> tuple[str, int]:
    """(the part of the plan's worst step that holds the most bytes at its peak, its bytes)."""
    return max(plan.worst.parts.items(), key=lambda item: item[1])


@dataclass
class MaxLengthSolve:
    budget: int
    limit: int  # the data's longest row: the longest max_length that still changes the plan
    step: int
    length: int | None  # the longest multiple of `step` that fits (or `limit`), None when `step` does not
    fitting: object | None  # its plan (planner.MemoryPlan)
    beyond: int | None  # the next length, which does not fit: length + step, or the limit (None: length is the limit)
    beyond_total: int | None  # its device total
    plans: int  # how many lengths were planned

    def lines(self) -> list[str]:
        if self.length is None:
            return [f"max_length: none fits {size_words(self.budget)} ({self.step} tokens plan "
                    f"{size_words(self.beyond_total)} on the device); a smaller model, LoRA or QLoRA, or the "
                    f"techniques --memory_budget turns on"]
        part, size = dominant_part(self.fitting)
        beyond = (f"; {self.beyond} plans {size_words(self.beyond_total)}" if self.beyond is not None
                  else f"; the data's longest row is {self.limit} tokens, so no longer max_length changes the step")
        return [f"longest max_length within {size_words(self.budget)}: {self.length} (peak "
                f"{size_words(self.fitting.peak_bytes)}, on the device {size_words(self.fitting.device_total_bytes)}"
                f"{beyond}); most of the peak: {part.replace('_', ' ')} {size_words(size)}; lengths in steps of "
                f"{self.step}, {self.plans} planned"]


def length_step(limit: int) -> int:
    """The search's resolution: 1/256 of the longest row, as a power of two from 16 tokens (8,192 tokens: 32; 500,000
    tokens: 1,024), so the answer is within 0.4% of the longest that fits in at most ~8 plans more than the fewest."""
    step = 16
    while step * 2 <= limit / 256:
        step *= 2
    return step


def solve_max_length(plan_at: Callable[[int], object], budget: int, limit: int, step: int | None = None,
                     known: dict | None = None) -> MaxLengthSolve:
    """The longest length (a multiple of `step`, or `limit` itself) whose plan's device total fits `budget`;
    plan_at(length): a MemoryPlan at that max_length. `known`: {length: plan} already made."""
    step = step or length_step(limit)
    plans: dict[int, object] = dict(known or {})

    def total(length: int) -> int:
        if length not in plans:
            plans[length] = plan_at(length)
        return plans[length].device_total_bytes

    def made() -> int:
        return len([length for length in plans if length not in (known or {})])

    if total(limit) <= budget:
        return MaxLengthSolve(budget, limit, step, limit, plans[limit], None, None, made())
    fits, too_long = 0, -(-limit // step)  # in steps: the most known to fit (0: none yet), the fewest known not to
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        fits, too_long = (middle, too_long) if total(middle * step) <= budget else (fits, middle)
    if fits == 0:
        return MaxLengthSolve(budget, limit, step, None, None, step, total(step), made())
    beyond = min(too_long * step, limit)
    return MaxLengthSolve(budget, limit, step, fits * step, plans[fits * step], beyond, total(beyond), made())
