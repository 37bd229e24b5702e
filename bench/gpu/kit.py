"""leantune's GPU acceptance kit: every row leantune beside TRL 1.16 on real model shapes, in one call.

    bash bench/gpu/run.sh            # on the GPU machine: <= 8 minutes, results in $OUT (or ./gpu-results)
    bash bench/gpu/run.sh --dry      # every row at tiny size on CPU, < 2 minutes (tests/benchmarks/test_gpu_kit.py)
    python bench/gpu/kit.py --list-rows  # the rows' names, in order

Rows run in order of value, each with its own time budget (a SIGALRM timer) and its own try/except: a failing row
records its error and traceback tail and the kit goes on; results.json and results.md are rewritten after every row;
a total time guard stops before the call's limit and marks the rows it did not start "not_run". The planner runs
beside the rows in processes of its own (plan_worker.py); its figures join the rows as they arrive.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gpu import rows as R  # noqa: E402
from bench.gpu.harness import RowTimeout, Settings, error_record, free_memory, log, time_limit, tokenizer, write_results  # noqa: E402,E501
from bench.gpu.plan_worker import PlanWorkers  # noqa: E402

# (name, function, GPU budget s, dry budget s), most valuable first. GPU budgets from the H100 run of 2026-11-27
# (/work/.device/1/results.json; GRPO from the second call, where it ran first in its process): a row's `seconds`
# less its `plan_seconds` (planning now runs in plan_worker.py's processes, beside the rows), plus leantune's warm
# rerun, estimated as TRL's run in that row (both warm: setup + 4 steps), then ~1.3-1.6x for margin:
#   liger_chunked_full 7.8 -> 12 | padded_vs_padding_free 0.5 -> 10 (the guard's floor: a row gets >= 10 s)
#   sft padded 43.7-28.8 = 14.9 + 4 = 18.9 -> 28 | packed_padding_free 42.1-27.5 = 14.6 + 5 = 19.6 -> 28
#   sft liger 44.0-33.6 = 10.4 + 2 = 12.4 -> 20 | offload_streams 40.7-34.4 = 6.3 + 2 = 8.3 -> 15
#   8B QLoRA 86.1-46.1 = 40.0 (24.0 of it saving and loading the 4-bit model) + 4 = 44.0 -> 58
#   8B LoRA 46.9-36.5 = 10.4 + 4 = 14.4 -> 22 | DPO 47.6-38.0 = 9.6 (15.3 run first in call 2) + 3 = 18.3 -> 26
#   KTO 36.4-25.0 (its plan was cut at 25 s) = 11.4 + 5 = 16.4 -> 24 | GRPO 59.0-10.0 = 49.0 -> 50; then (second
#   H100 run, 2026-11-28) a warm rerun for GRPO's tok/s too: 38.2 s + TRL's 13.2 s -> 65
# Sum of those 11 budgets: 308 s (longest context: >= 420 - 24 - 308 = 88 s; it took 55 s on 2026-11-28). Outside the rows (imports, CUDA init, versions, tokenizer) the kit took 24 s
# (419.9 s elapsed, 395.8 s in rows). So even if every row uses its whole budget, longest context starts by
# 24 + 293 = 317 s and gets >= 420 - 317 = 103 s; at the measured times (175 s + 33 s of reruns + 24 s) it starts
# near 232 s and gets its full 185 s, the guard's end (420 s) inside run.sh's `timeout 450`.
ROWS = [
    ("correctness_liger_chunked_full_fp32", R.liger_chunked_full, 12, 90),
    ("correctness_padded_vs_padding_free_fp32", R.padded_vs_padding_free, 10, 60),
    ("sft_qwen2.5-1.5b_padded", R.sft("qwen2.5-1.5b", "padded"), 28, 90),
    ("sft_qwen2.5-1.5b_packed_padding_free", R.sft("qwen2.5-1.5b", "packed_padding_free"), 28, 60),
    ("sft_qwen2.5-1.5b_liger", R.sft("qwen2.5-1.5b", "liger"), 20, 60),
    ("sft_qwen2.5-1.5b_offload_streams", R.sft("qwen2.5-1.5b", "offload_streams"), 15, 60),
    ("sft_llama-3.1-8b_qlora", R.sft("llama-3.1-8b", "padded", peft=True, quantized=True), 58, 60),
    ("sft_llama-3.1-8b_lora", R.sft("llama-3.1-8b", "padded", peft=True), 22, 60),
    ("dpo_qwen2.5-1.5b", R.dpo, 26, 60),
    ("kto_qwen2.5-1.5b", R.kto, 24, 60),
    ("grpo_qwen2.5-1.5b", R.grpo, 65, 60),
    # checkpoint offload (issue 37 item 2): two 1.5B runs at 16,384 tokens, 4 steps each (estimated, not measured yet)
    ("checkpoint_offload_qwen2.5-1.5b", R.checkpoint_offload, 30, 60),
    (R.LONGEST_CONTEXT_ROW, R.longest_context, 185, 90),
]
# Planner processes: on the GPU machine (16 cores) the plans are ~405 s of CPU work in all (2 seeds of ~45 s, 9 rows
# of 28-46 s), more than the kit's 420 s with one process: two finish them by ~220 s. On CPU (--dry, CI's 2 cores)
# one: three tiny plans.
PLANNER_PROCESSES, PLANNER_PROCESSES_DRY = 2, 1
ROW_NAMES = [name for name, *_ in ROWS]


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda or "none",
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"}
    for name in ("transformers", "accelerate", "peft", "triton", "datasets", "dill", "multiprocess", "trl",
                 "liger-kernel", "bitsandbytes", "safetensors", "pyarrow"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "MISSING"
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="every row at tiny size on CPU (< 2 minutes)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-results", help="results folder ($OUT)")
    parser.add_argument("--total-s", type=float, default=float(os.environ.get("GPUKIT_TOTAL_S", 0)) or None,
                        help="stop starting rows after this many seconds (default 420 on GPU; 300 dry, a guard against a hang: the dry target is < 2 minutes)")
    parser.add_argument("--rows", default=None, help=f"comma-separated subset of {ROW_NAMES}")
    parser.add_argument("--list-rows", action="store_true", help="print every row's name, one a line, and exit")
    return parser.parse_args(argv)


def import_then_freeze() -> None:
    """The rows' libraries imported once, then gc.freeze(): the objects of every import leave the collector's scans,
    so each row's free_memory() collection looks at what the rows made only (on the dev VM a collection over them
    all took ~0.35 s, about 90% of a tiny --dry row's CPU time)."""
    import importlib

    for name in ("leantune", "trl", "peft"):
        try:
            importlib.import_module(name)
        except ImportError:  # a row that needs it reports its own error
            pass
    gc.collect()
    gc.freeze()


def run_row(ctx: R.Context, row: dict, dry: bool) -> None:
    """One row, inside its time budget and its own try/except: its status, error, seconds."""
    settings = ctx.settings
    _, function, gpu_budget, dry_budget = next(r for r in ROWS if r[0] == row["name"])
    budget = min(dry_budget if dry else gpu_budget, settings.remaining())
    if budget < 10:
        row["note"] = f"time guard: {settings.remaining():.0f} s of {settings.total_s:.0f} s left"
        log(settings, f"{row['name']}: not run ({row['note']})")
        return
    log(settings, f"{row['name']}: start (budget {budget:.0f} s)")
    row.pop("note", None)
    started, cpu_started = time.monotonic(), time.process_time()
    row["_budget_left"] = lambda: budget - (time.monotonic() - started)
    try:
        with time_limit(budget):
            function(ctx, row)
        row["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - a failing row records its error; the kit goes on
        if isinstance(error, RowTimeout) or "RowTimeout" in repr(error):  # Triton's interpreter wraps it
            row.update(status="timeout", error=f"ran past its {budget:.0f} s budget")
        elif isinstance(error, AssertionError):
            row.update(status="mismatch", **error_record(error))
        else:
            row.update(status="error", **error_record(error))
    finally:
        row.pop("_budget_left", None)
        row["seconds"] = round(time.monotonic() - started, 1)
        row["cpu_seconds"] = round(time.process_time() - cpu_started, 1)
        free_memory()
    log(settings, f"{row['name']}: {row['status']} in {row['seconds']} s"
                  + (f" - {row.get('summary')}" if row.get("summary") else "")
                  + (f" - {row['error']}" if row.get("error") else ""))


def cuda_tests_of_this_call(out: Path) -> dict:
    """What `run.sh --tests` ran before the kit in this call (run.sh removes an older file first)."""
    path = out / "cuda_tests.json"
    if not path.exists():
        return {}
    from bench.gpu.cuda_tests import markdown_line

    result = json.loads(path.read_text())
    return {"cuda_tests": result, "cuda_tests_line": markdown_line(result)}


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.list_rows:
        print("\n".join(ROW_NAMES))
        return 0
    settings = Settings(dry=opts.dry, out=Path(opts.out), total_s=opts.total_s or (300 if opts.dry else 420))
    import torch

    if not opts.dry and not torch.cuda.is_available():
        log(settings, "no CUDA device: run with --dry on CPU")
        return 2
    wanted = opts.rows.split(",") if opts.rows else ROW_NAMES
    unknown = set(wanted) - set(ROW_NAMES)
    if unknown:
        print(f"error: --rows: unknown {sorted(unknown)}; choose from {ROW_NAMES}", file=sys.stderr)
        return 2
    header = {"dry": opts.dry, "versions": versions(), "machine": f"{platform.node()} {os.cpu_count()} CPUs",
              "total_s": settings.total_s, **cuda_tests_of_this_call(settings.out)}
    log(settings, "versions: " + ", ".join(f"{k} {v}" for k, v in header["versions"].items()))
    # --rows keeps its order and repeats: a row named twice measures what the first run's warm-up cost.
    results = [{"name": name, "status": "not_run", "note": "not started yet"}
               for name in (wanted if opts.rows else ROW_NAMES)]
    write_results(settings, header, results)
    import tempfile

    # The planner first, and the longest-context seeds ahead of every row's plan: its processes import torch and
    # leantune while this one imports the rest.
    planner = PlanWorkers(settings, PLANNER_PROCESSES_DRY if opts.dry else PLANNER_PROCESSES).start()
    ctx = R.Context(settings, None, Path(tempfile.mkdtemp(prefix="leantune-gpukit-")), planner)
    try:
        if R.LONGEST_CONTEXT_ROW in wanted:
            R.submit_longest_context_seeds(ctx)
        from bench.common import quiet

        quiet()
        import_then_freeze()
        ctx.tok = tokenizer()
        for row in results:
            run_row(ctx, row, opts.dry)
            planner.merge()
            write_results(settings, header, results)
        pending = planner.pending()
        if pending and settings.remaining() > 0:
            log(settings, f"waiting up to {settings.remaining():.0f} s for {len(pending)} plan(s)")
            planner.wait(pending, settings.remaining())
    finally:
        planner.stop()  # what has not arrived: plan_error "not finished in the kit's time"; the workers killed
        gc.unfreeze()  # the exit's own collection as before (frozen objects left to it make nanobind report leaks)
    write_results(settings, header, results)
    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "mismatch", "error", "timeout", "not_run")}
    log(settings, f"done: {counts}; results in {settings.out}/results.json and results.md")
    return 0 if counts["ok"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
