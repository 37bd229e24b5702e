"""The planner beside the measurements, in processes of its own.

Why: `plan_peak` is CPU work on fake tensors, 28-46 s per row on the H100 machine (its first run, 2026-11-27). In
the measuring process it sat on the kit's critical path (the last two rows never started), and the SIGALRM that
bounded it, landing inside torch's C++ dispatch, aborted the whole process (`pybind11::error_already_set`, exit
134). Here a row submits its plan and goes on; the figures are merged into the rows as they arrive; a plan still
running when the kit stops is reported as not finished, and its process is killed (it holds nothing the kit needs).
The workers are started with "spawn" and never see the GPU (CUDA_VISIBLE_DEVICES is emptied before torch is
imported there), on the GPU machine at a low priority, with one thread: they must not take memory or cores from the
measurements."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue
import time
from dataclasses import dataclass, field

NOT_FINISHED = "not finished in the kit's time"


@dataclass
class PlanJob:
    """What `harness.plan_peak` gets besides the settings and the tokenizer (each worker builds the kit's own)."""

    shape: str
    train_rows: list
    method: str
    fields: dict
    peft_config: object = None
    quantized: bool = False
    reward_funcs: object = None
    measured_step: bool = True  # False for a one-row plan: the trainer's own step 2 is its one batch traced again


@dataclass
class PlanWorkers:
    settings: object
    processes: int = 1
    jobs: object = None
    done: object = None
    workers: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)  # job id -> plan figures, as they arrive
    rows: dict = field(default_factory=dict)  # job id -> the row whose leantune result gets them (not yet merged)
    ids: object = field(default_factory=itertools.count)

    def start(self) -> PlanWorkers:
        context = multiprocessing.get_context("spawn")
        self.jobs, self.done = context.Queue(), context.Queue()
        self.workers = [context.Process(target=serve, args=(self.settings, self.jobs, self.done), daemon=True,
                                        name=f"gpukit-planner-{i}") for i in range(self.processes)]
        for worker in self.workers:
            worker.start()
        return self

    def submit(self, job: PlanJob, row: dict | None = None) -> int:
        """Queue `job` (jobs run in submission order); with `row`, its figures go into row's leantune result."""
        job_id = next(self.ids)
        if row is not None:
            self.rows[job_id] = row
        self.jobs.put((job_id, job))
        return job_id

    def collect(self, timeout: float = 0.0) -> None:
        """Take what has arrived; wait up to `timeout` seconds for the first arrival."""
        while True:
            try:
                job_id, figures = self.done.get(timeout=timeout) if timeout > 0 else self.done.get_nowait()
            except queue.Empty:
                return
            self.figures[job_id] = figures
            timeout = 0.0

    def wait(self, job_ids, timeout: float) -> dict:
        """The figures of `job_ids` that arrive within `timeout` seconds (fewer when a worker is gone)."""
        job_ids, deadline = set(job_ids), time.monotonic() + max(0.0, timeout)
        while not job_ids <= set(self.figures) and any(w.is_alive() for w in self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.collect(min(left, 1.0))
        self.collect()
        return {job_id: self.figures[job_id] for job_id in job_ids if job_id in self.figures}

    def pending(self) -> set:
        """Row plans not arrived yet (a seed no row waits for is not waited for)."""
        return set(self.rows) - set(self.figures)

    def merge(self) -> bool:
        """Put every arrived plan into its row; True when something changed (the results files are rewritten)."""
        self.collect()
        merged = [job_id for job_id in self.rows if job_id in self.figures]
        for job_id in merged:
            merge_plan(self.rows.pop(job_id), self.figures[job_id])
        return bool(merged)

    def stop(self) -> None:
        """The kit stops: what has arrived is merged, what has not is reported, and the workers are killed."""
        self.merge()
        for row in self.rows.values():
            merge_plan(row, {"plan_error": NOT_FINISHED})
        self.rows.clear()
        for _ in self.workers:  # an idle worker leaves at its next read; a busy one is killed
            self.jobs.put(None)
        deadline = time.monotonic() + 1.0
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(5)
        for channel in (self.jobs, self.done):
            if channel is not None:
                channel.cancel_join_thread()  # a job never read must not hold the kit's exit
                channel.close()


def merge_plan(row: dict, figures: dict) -> None:
    result = row.get("libraries", {}).get("leantune")
    if result is None or "error" in result:
        return
    result.update(figures)
    if "plan_peak_gib" in figures and result.get("max_allocated_gib"):
        result["plan_over_measured"] = figures["plan_peak_gib"] / result["max_allocated_gib"]


def serve(settings, jobs, done) -> None:
    """A worker: plans jobs until it reads None (or is killed)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before this process first imports torch: no CUDA context at all
    if not settings.dry:  # dry (CPU) timings are not compared: there a niced worker on busy cores only stalls rows
        try:
            os.nice(10)
        except OSError:
            pass
    import torch

    torch.set_num_threads(1)
    from bench.common import quiet

    from .harness import error_record, plan_peak, tokenizer

    quiet()
    tok = tokenizer()
    import gc

    gc.collect()  # the imports out of the collector's full scans: each traced step's train() runs one (accelerate's
    gc.freeze()  # free_memory), ~0.3 s over them (kit.py's import_then_freeze does the same in the kit's process)
    while True:
        item = jobs.get()
        if item is None:
            gc.unfreeze()  # the exit's own collection as before (frozen objects left to it make nanobind report leaks)
            return
        job_id, job = item
        started = time.perf_counter()
        try:
            figures = plan_peak(settings, job.shape, tok, job.train_rows, job.method, job.fields, job.peft_config,
                                job.quantized, job.reward_funcs, job.measured_step)
        except Exception as error:  # noqa: BLE001 - a plan's failure is reported; the row's numbers stand
            figures = {"plan_error": error_record(error)["error"],
                       "plan_seconds": round(time.perf_counter() - started, 1)}
        done.put((job_id, figures))
