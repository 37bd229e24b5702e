"""The run's metrics: what a trainer logs besides its loss, and what it reports at the end of training, in one place.

Real tokens/s, the padding fraction and peak memory (CUDA max allocated on GPU, peak resident set size on CPU) go with
every training log and into the closing summary; a method's per-example values (rewards, accuracies, ...) are gathered
across processes and averaged at each log; one step's memory breakdown (parameters, gradients, optimizer states,
activations, ...) is reported when asked for. An online method's round adds TRL's reward, length and tool metrics over
all processes, the decisions counted over the run (missing or NaN rewards, masked completions, failed tool calls) and a
few logged examples (`RoundMetrics`), into the same per-mode stores.
"""

from __future__ import annotations

import functools
import logging
import resource
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..data.prompt_preparation import PROMPT_IDS
from .memory_breakdown import MemoryBreakdown

MIB = 1024 * 1024
logger = logging.getLogger("leantune.online")  # what an online round reports


class CudaPeak:
    """Peak memory on a CUDA device: the allocator's maximum allocated since the last reset."""

    kind = "cuda_max_allocated"

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated())


class HostPeak:
    """Peak memory of a run on the host: the process's peak resident set size (Linux's VmHWM, which writing 5 to
    /proc/self/clear_refs resets; elsewhere getrusage's maximum, never reset)."""

    kind = "peak_rss"

    def reset(self) -> None:
        if sys.platform.startswith("linux"):
            try:  # Linux resets VmHWM (peak RSS) when 5 is written here
                with open("/proc/self/clear_refs", "w") as handle:
                    handle.write("5")
            except OSError:
                pass

    def bytes(self) -> int:
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


def peak_memory_meter(device: torch.device | None = None) -> CudaPeak | HostPeak:
    """The peak memory a run on `device` reports, chosen once: CUDA's allocator, else the host's."""
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    return CudaPeak() if cuda else HostPeak()


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
        self.peak_memory = peak_memory_meter(device)  # CUDA's allocator or the host's resident set, chosen once
        self.summarise = summarise
        self.throughput = TokenThroughput()
        self.memory_breakdown: MemoryBreakdown | None = None
        # Per-example values of the method's own metrics, gathered across processes, averaged at each log.
        self.values: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def restart(self) -> None:
        """A train() call's start: its token counts and peak memory from zero."""
        self.peak_memory.reset()
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
        logs["peak_memory_mb"] = round(self.peak_memory.bytes() / MIB, 1)

    def summary(self) -> dict:
        """The run's closing numbers (the trainer adds its own)."""
        summary = {
            "real_tokens": self.throughput.real_tokens,
            "real_tokens_per_second": round(self.throughput.overall_rate(), 2),
            "padding_fraction": round(self.throughput.padding_fraction, 4),
            "peak_memory_mb": round(self.peak_memory.bytes() / MIB, 1),
            "peak_memory_kind": self.peak_memory.kind,
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


class RoundMetrics:
    """What an online round reports, written into the trainer's per-mode metric stores (`RunMetrics.values`)."""

    def __init__(self, settings, accelerator, metric_values: dict, round_size: int):
        self.settings = settings  # RoundReportSettings (trainers/settings.py)
        self.accelerator, self.metric_values = accelerator, metric_values
        self.counts: dict[str, int] = defaultdict(int)  # counted decisions over the run (logged)
        # What reward functions hand to `log_extra`, per column, for the last round_size completions (TRL's `_logs`)
        self.extra = defaultdict(lambda: deque(maxlen=round_size))
        # The callbacks reward functions receive, made once per mode (training or not), not in every round
        self.reward_logging = {training: self.reward_callbacks(training) for training in (True, False)}

    def store(self, training: bool) -> dict:
        return self.metric_values["train" if training else "eval"]

    def reward_callbacks(self, training: bool) -> dict:
        """The `log_extra` and `log_metric` callbacks reward functions receive (TRL's)."""
        def log_extra(column: str, values: list) -> None:
            self.extra[column].extend(values)

        def log_metric(name: str, value: float) -> None:
            self.store(training)[name].append(float(value))

        return {"log_extra": log_extra, "log_metric": log_metric}

    def count_reward_gaps(self, scores, rows: list[dict], texts: list[str]) -> None:
        for name, missing, nan in zip(scores.names, scores.missing, scores.nan):
            if missing:
                self.counts[f"no_reward/{name}"] += missing
            if nan:
                self.counts[f"nan_reward/{name}"] += nan
                logger.warning("Reward function %r returned NaN for %d completion(s): treated as no reward from it "
                               "(a completion no function scores gets advantage 0).", name, nan)
        unscored = scores.unscored()
        if unscored.any():
            self.counts["unscored_completions"] += int(unscored.sum())
            first = int(unscored.nonzero()[0])
            example = {name: value for name, value in rows[first].items() if name != PROMPT_IDS}
            logger.warning("All reward functions returned None for the following kwargs: %s (completion %r); %d "
                           "completion(s) of this round have no reward and get advantage 0.",
                           example, texts[first], int(unscored.sum()))

    def record_tools(self, rollout, count: int, training: bool) -> None:
        """TRL's `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed calls per call),
        over all processes; leantune adds `tools/malformed_frequency` (call blocks that did not parse, per
        completion: those completions were read as plain text) and counts both over the run."""
        totals = torch.tensor([rollout.tool_calls, rollout.tool_failures, rollout.malformed_tool_calls,
                               rollout.over_budget, count], device=self.accelerator.device, dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        calls, failures, malformed, over_budget, completions = totals.cpu().tolist()
        store = self.store(training)
        store["tools/call_frequency"].append(calls / completions)
        store["tools/failure_frequency"].append(failures / calls if calls else 0.0)
        store["tools/malformed_frequency"].append(malformed / completions)
        if rollout.malformed_tool_calls:
            self.counts["malformed_tool_calls"] += rollout.malformed_tool_calls
            logger.warning("%d tool call(s) of this round could not be parsed (bad JSON, no name, or never closed); "
                           "their completions were read as plain text.", rollout.malformed_tool_calls)
        if rollout.tool_failures:
            self.counts["failed_tool_calls"] += rollout.tool_failures
        if rollout.over_budget:
            self.counts["tool_results_over_budget"] += rollout.over_budget
            logger.info("%d rollout(s) ended at a tool call whose results would not fit in max_completion_length=%d "
                        "(or the model's context).", rollout.over_budget, self.settings.max_completion_length)

    def record_round(self, names, per_function, rewards, lengths, terminated, training: bool) -> None:
        store = self.store(training)
        # float64: a float32 std overflows above rewards of ~1.8e19 (losses/policy_gradient.py computes its own in float64)
        per_function, rewards = per_function.double(), rewards.double()
        for i, name in enumerate(names):
            column = per_function[:, i]
            column = column[~torch.isnan(column)]
            if column.numel():
                store[f"rewards/{name}/mean"].append(column.mean().item())
                store[f"rewards/{name}/std"].append(column.std().item() if column.numel() > 1 else 0.0)
        valid = rewards[~torch.isnan(rewards)]
        if valid.numel():
            store["reward"].append(valid.mean().item())
            store["reward_std"].append(valid.std().item() if valid.numel() > 1 else 0.0)
        groups = rewards.view(-1, self.settings.num_generations if training else self.settings.eval_num_generations)
        scored = [g[~torch.isnan(g)] for g in groups]
        zero_std = [float(g.numel() < 2 or g.std().item() == 0) for g in scored]  # fewer than two: no spread
        store["frac_reward_zero_std"].append(sum(zero_std) / len(zero_std))
        lengths = lengths.float()
        store["completions/mean_length"].append(lengths.mean().item())
        store["completions/min_length"].append(lengths.min().item())
        store["completions/max_length"].append(lengths.max().item())
        store["completions/clipped_ratio"].append(1.0 - terminated.float().mean().item())
        if terminated.any():
            store["completions/mean_terminated_length"].append(lengths[terminated].mean().item())
        if training:
            store["num_tokens"].append(float(lengths.sum().item()))

    def log_examples(self, rows, texts, rewards) -> None:
        count = self.settings.num_completions_to_print or 4
        for row, text, reward in list(zip(rows, texts, rewards.tolist()))[:count]:
            logger.info("prompt %r -> completion %r, reward %.3f", row["prompt"], text, reward)
