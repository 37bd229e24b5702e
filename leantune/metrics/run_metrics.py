"""The run's metrics: what a trainer logs besides its loss, and what it reports at the end of training, in one place.

Real tokens/s, the padding fraction and peak memory (CUDA max allocated on GPU, peak resident set size on CPU) go with
every training log and into the closing summary; a method's per-example values (rewards, accuracies, ...) are gathered
across processes and averaged at each log; one step's memory breakdown (parameters, gradients, optimizer states,
activations, ...) is reported when asked for.
"""

from __future__ import annotations

import functools
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .memory_breakdown import MemoryBreakdown

MIB = 1024 * 1024


def _uses_cuda(device: torch.device | None) -> bool:
    return torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")


def reset_peak_memory(device: torch.device | None = None) -> None:
    if _uses_cuda(device):
        torch.cuda.reset_peak_memory_stats()
    elif sys.platform.startswith("linux"):
        try:  # Linux resets VmHWM (peak RSS) when 5 is written here.
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            pass


def peak_memory_bytes(device: torch.device | None = None) -> int:
    if _uses_cuda(device):
        return int(torch.cuda.max_memory_allocated())
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def memory_kind(device: torch.device | None = None) -> str:
    return "cuda_max_allocated" if _uses_cuda(device) else "peak_rss"


@dataclass
class TokenThroughput:
    """Counts of real and padded tokens seen in training, turned into rates at log time."""

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


class RunMetrics:
    """`summarise(store) -> dict`: the method's logged form of its stored values (means, by default); `cp_size`: the
    processes of a context-parallel group, each holding 1/cp_size of a batch's laid-out slots."""

    def __init__(self, accelerator, device, cp_size: int, summarise: Callable[[dict], dict]):
        self.accelerator = accelerator
        self.cp_size = cp_size
        self.device = device
        self.summarise = summarise
        self.throughput = TokenThroughput()
        self.memory_breakdown: MemoryBreakdown | None = None
        # Per-example values of the method's own metrics, gathered across processes, averaged at each log.
        self.values: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def restart(self) -> None:
        """A train() call's start: its token counts and peak memory from zero."""
        reset_peak_memory(self.device)
        self.throughput.restart()

    def count_tokens(self, model, inputs: dict, prefix: str = "") -> None:
        """Real and padded tokens of a training batch (its collator's `num_real_tokens`, taken out of the inputs;
        `prefix`: of a second layout, KTO's `kl_`). Under context parallelism the count is of the whole batch and
        this process holds 1/cp_size of its laid-out slots."""
        real = inputs.pop(prefix + "num_real_tokens", None)
        if model.training and real is not None:
            self.throughput.add(int(real), int(inputs[prefix + "input_ids"].numel()) * self.cp_size)

    def record(self, model, **values: torch.Tensor) -> None:
        """Keep per-example values (1-D tensors of equal length) of this step, gathered across processes."""
        names = list(values)
        stacked = torch.stack([values[name].detach().float() for name in names]).T.contiguous()
        gathered = self.accelerator.gather_for_metrics(stacked)
        store = self.values["train" if model.training else "eval"]
        for name, column in zip(names, gathered.T):
            store[name].extend(column.tolist())

    def mark(self):
        """A callable that puts the training values and token counts back as they are now (a discarded attempt)."""
        lengths = {name: len(column) for name, column in self.values["train"].items()}
        return functools.partial(self._put_back, lengths, self.throughput.counts())

    def _put_back(self, lengths: dict, counts) -> None:
        store = self.values["train"]
        for name in list(store):
            if name in lengths:
                del store[name][lengths[name]:]
            else:
                del store[name]
        self.throughput.set_counts(counts)

    def add_method_values(self, logs: dict, prefix: str) -> None:
        """A log's method metrics: the values since the last log (then emptied), `<prefix>_` before eval names."""
        mode = "train" if "loss" in logs or "train_loss" in logs else "eval"
        prefix = f"{prefix}_" if mode == "eval" else ""
        store = self.values[mode]
        if store:
            logs.update({f"{prefix}{name}": value for name, value in self.summarise(store).items()})
            store.clear()

    def add_step_values(self, logs: dict) -> None:
        """A training step's log: tokens/s over the logging window, the padding fraction and peak memory."""
        logs["real_tokens_per_second"] = round(self.throughput.window_rate(), 2)
        logs["padding_fraction"] = round(self.throughput.padding_fraction, 4)
        logs["peak_memory_mb"] = round(peak_memory_bytes(self.device) / MIB, 1)

    def summary(self) -> dict:
        """The run's closing numbers (the trainer adds its own)."""
        summary = {
            "real_tokens": self.throughput.real_tokens,
            "real_tokens_per_second": round(self.throughput.overall_rate(), 2),
            "padding_fraction": round(self.throughput.padding_fraction, 4),
            "peak_memory_mb": round(peak_memory_bytes(self.device) / MIB, 1),
            "peak_memory_kind": memory_kind(self.device),
        }
        if self.memory_breakdown is not None:
            summary.update(self.memory_breakdown.as_metrics())
        return summary

    def keep_memory_breakdown(self, breakdown: MemoryBreakdown) -> None:
        self.memory_breakdown = breakdown


def mean_of_values(store: dict[str, list[float]]) -> dict[str, float]:
    """The default logged form of stored values: their means, NaN (nothing measured) left out."""
    summary = {}
    for name, values in store.items():
        values = [v for v in values if v == v]
        if values:
            summary[name] = round(sum(values) / len(values), 6)
    return summary
