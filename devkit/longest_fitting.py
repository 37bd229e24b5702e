"""The longest sequence length whose predicted peak fits a memory budget, found in a few predictions: each one is a
traced step (seconds of CPU), so the search follows the near-linear peak instead of bisecting. bench/real_shapes.py
searches with it; tests/benchmarks/test_bench_real_shapes.py checks it on a line."""

from __future__ import annotations


def longest_fitting(predict, budget: int, start: int, step: int = 256, limit: int = 1 << 20,
                    tolerance: float = 1 / 64, known: dict[int, int] | None = None) -> tuple[int, int]:
    """(longest length, a multiple of `step`, whose predicted peak fits `budget`; its prediction). Each prediction is
    a traced step (seconds of CPU), and a peak is close to linear in the length, so the next length probed is where
    the line through the last two probes meets the budget (bisection where that is not strictly inside the bracket),
    until the bracket is `step` tokens or `tolerance` of the length wide. (0, 0) when not even `step` tokens fit;
    at most `limit`. `known`: predictions already made ({length: peak}), the first points of the line."""
    cache: dict[int, int] = dict(known or {})

    def peak(length):
        if length not in cache:
            cache[length] = predict(length)
        return cache[length]

    def snap(length):
        return max(step, min(limit, int(length) // step * step))

    low, high = 0, None  # low fits (0: nothing probed fits yet), high does not
    sides = []  # which side each probe fell on: True fits
    for length in sorted({*cache, snap(start), snap(2 * start)} if len(cache) < 2 else cache):
        sides.append(peak(length) <= budget)
        low, high = (max(low, length), high) if sides[-1] else (low, length if high is None else min(high, length))
    while not (high is not None and high - low <= max(step, low * tolerance)) and not (high is None and low >= limit):
        if high is None:  # grow along the line through the two longest probes
            (a, pa), (b, pb) = sorted(cache.items())[-2:]
            guess = snap(a + (budget - pa) * (b - a) / (pb - pa)) if pb > pa else 2 * low
            guess = max(guess, low + step)
        elif low and sides[-1] != sides[-2]:  # the line between the bracket's ends (regula falsi)
            guess = snap(low + (budget - cache[low]) * (high - low) / (cache[high] - cache[low]))
            guess = min(max(guess, low + step), high - step)
        else:  # the last two probes fell on one side: halve (keeps a curved peak from stalling the line)
            guess = snap((low + high) / 2)
        if high is not None and not low < guess < high:
            guess = snap((low + high) / 2)
        if guess in cache:
            break
        sides.append(peak(guess) <= budget)
        low, high = (guess, high) if sides[-1] else (low, guess)
    return low, cache.get(low, 0)
