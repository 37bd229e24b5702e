"""A step's peak memory measured at the allocator, sharing no code with MemTracker (metrics/memory_breakdown.py).

MemTracker and the plan's FakeTensor trace see tensors as ops dispatched through Python return them; memory an op
allocates and frees inside itself is invisible to both (metrics/op_scratch.py). torch.profiler's memory events are
the CPU allocator's own record of every allocation and free, so this meter checks the other two: bench/plan_accuracy.py
reports it beside MemTracker for every row, and tests check that the breakdown leaves a run as it found it. Slow
(every op is recorded): a check, not a training option.
"""

from __future__ import annotations

import contextlib
import gc
import warnings

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import TrainerCallback


class AllocatorMeter:
    """A second measure of the step `memory_breakdown` measures, sharing nothing with MemTracker: the CPU allocator's
    live bytes from torch.profiler's memory events (every allocation and free, op-internal buffers included), plus
    the storages already live when profiling began (the loaded weights, found through the garbage collector).

    `with meter.profiling(trainer): trainer.train()`, then `meter.peak_bytes`: the most bytes live at once during the
    measured step (marked by a profiler range from its `on_step_begin` to its `on_step_end`)."""

    RANGE = "allocator meter: measured step"

    def __init__(self, step: int = 1):
        self.step = step
        self.peak_bytes = self.before_bytes = None
        self.peak_ops = []  # the ops running when the peak was reached, outermost first

    @staticmethod
    def live_storage_bytes() -> int:
        from torch._subclasses.fake_tensor import FakeTensor

        # Garbage first: an earlier job's tensors in reference cycles (a planner's trace in the same process) would
        # count here and then be collected in the middle of the run, two runs then differing by their size.
        gc.collect()
        seen, total = set(), 0
        with warnings.catch_warnings():  # isinstance() on every object touches deprecated module attributes
            warnings.simplefilter("ignore")
            tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for obj in tensors:
            if obj.device.type != "cpu" or isinstance(obj, FakeTensor):  # a fake tensor holds no memory
                continue
            try:
                storage = obj.untyped_storage()
            except Exception:  # a tensor without storage (fake, sparse, a subclass)
                continue
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def profiling(self, trainer):
        meter = self

        class StepRange(TrainerCallback):
            marker, done = None, False

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == meter.step and not self.done:
                    self.marker, self.done = record_function(meter.RANGE), True
                    self.marker.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                if self.marker is not None:
                    self.marker.__exit__(None, None, None)
                    self.marker = None

        @contextlib.contextmanager
        def watching():
            step_range = StepRange()
            trainer.add_callback(step_range)
            before = self.live_storage_bytes()
            try:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    yield
            finally:
                trainer.remove_callback(step_range)
            events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
            window = next(e for e in events if e.name() == self.RANGE)
            start, end = window.start_ns(), window.start_ns() + window.duration_ns()
            live, peak, at = before, None, start
            for event in events:
                if event.name() != "[memory]" or str(event.device_type()) != "DeviceType.CPU":
                    continue
                live += event.nbytes()
                if start <= event.start_ns() <= end and (peak is None or live > peak):
                    peak, at = live, event.start_ns()
            self.peak_bytes, self.before_bytes = peak, before
            covering = [e for e in events if e.name().startswith("aten::") and e.start_ns() <= at <= e.end_ns()]
            self.peak_ops = [e.name() for e in sorted(covering, key=lambda e: e.start_ns())]

        return watching()


@contextlib.contextmanager
def block_peak(result: dict):
    """The most bytes the CPU allocator held at once during the block beyond what it held at its start (every
    allocation and free, from torch.profiler's memory events), put in `result["peak_bytes"]` when it ends."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    live = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]" and str(event.device_type()) == "DeviceType.CPU":
            live += event.nbytes()
            peak = max(peak, live)
    result["peak_bytes"] = peak
