"""Counts of real and padded tokens seen in training, turned into rates at log time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TokenThroughput:
    real_tokens: int = 0
    batch_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    _window_real: int = 0
    _window_start: float = field(default_factory=time.perf_counter)

    def restart(self) -> None:
        self.real_tokens = self.batch_tokens = self._window_real = 0
        self.started = self._window_start = time.perf_counter()

    def add(self, real: int, total: int) -> None:
        self.real_tokens += real
        self.batch_tokens += total
        self._window_real += real

    def counts(self) -> tuple[int, int, int]:
        return self.real_tokens, self.batch_tokens, self._window_real

    def set_counts(self, counts: tuple[int, int, int]) -> None:
        """The counts as `counts()` read them (the tokens of a discarded attempt taken back)."""
        self.real_tokens, self.batch_tokens, self._window_real = counts

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.batch_tokens if self.batch_tokens else 0.0

    def overall_rate(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.real_tokens / elapsed if elapsed > 0 else 0.0

    def window_rate(self) -> float:
        """Real tokens per second since the previous call."""
        now = time.perf_counter()
        rate = self._window_real / (now - self._window_start) if now > self._window_start else 0.0
        self._window_real, self._window_start = 0, now
        return rate
