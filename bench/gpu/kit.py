"""leantune's GPU acceptance kit: every row leantune beside TRL 1.16 on real model shapes, in one call.

    bash bench/gpu/run.sh            # on the GPU machine: <= 8 minutes, results in $OUT (or ./gpu-results)
    bash bench/gpu/run.sh --dry      # every row at tiny size on CPU, < 2 minutes (tests/benchmarks/test_gpu_kit.py)
    python bench/gpu/kit.py --list-rows  # the rows' names, in order

Rows run in order of value, each with its own time budget (a SIGALRM timer) and its own try/except: a failing row
records its error and traceback tail and the kit goes on; results.json and results.md are rewritten after every row;
a total time guard stops before the call's limit and marks the rows it did not start "not_run".
"""

from __future__ import annotations

import argparse
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

# (name, function, GPU budget s, dry budget s). The GPU budgets sum past the total on purpose: the total guard
# cuts what is left, so the most valuable rows (first) always run.
ROWS = [
    ("correctness_liger_chunked_full_fp32", R.liger_chunked_full, 30, 90),
    ("correctness_padded_vs_padding_free_fp32", R.padded_vs_padding_free, 30, 60),
    ("sft_qwen2.5-1.5b_padded", R.sft("qwen2.5-1.5b", "padded"), 60, 90),
    ("sft_qwen2.5-1.5b_packed_padding_free", R.sft("qwen2.5-1.5b", "packed_padding_free"), 60, 60),
    ("sft_qwen2.5-1.5b_liger", R.sft("qwen2.5-1.5b", "liger"), 60, 60),
    ("sft_qwen2.5-1.5b_offload_streams", R.sft("qwen2.5-1.5b", "offload_streams"), 60, 60),
    ("sft_llama-3.1-8b_qlora", R.sft("llama-3.1-8b", "padded", peft=True, quantized=True), 120, 60),
    ("sft_llama-3.1-8b_lora", R.sft("llama-3.1-8b", "padded", peft=True), 70, 60),
    ("dpo_qwen2.5-1.5b", R.dpo, 50, 60),
    ("kto_qwen2.5-1.5b", R.kto, 50, 60),
    ("grpo_qwen2.5-1.5b", R.grpo, 60, 60),
    ("longest_context_llama-3.1-8b_qlora", R.longest_context, 120, 90),
]
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
    header = {"dry": opts.dry, "versions": versions(), "machine": f"{platform.node()} {os.cpu_count()} CPUs",
              "total_s": settings.total_s}
    log(settings, "versions: " + ", ".join(f"{k} {v}" for k, v in header["versions"].items()))
    from bench.common import quiet

    quiet()
    wanted = opts.rows.split(",") if opts.rows else ROW_NAMES
    unknown = set(wanted) - set(ROW_NAMES)
    if unknown:
        print(f"error: --rows: unknown {sorted(unknown)}; choose from {ROW_NAMES}", file=sys.stderr)
        return 2
    # --rows keeps its order and repeats: a row named twice measures what the first run's warm-up cost.
    results = [{"name": name, "status": "not_run", "note": "not started yet"}
               for name in (wanted if opts.rows else ROW_NAMES)]
    write_results(settings, header, results)
    import tempfile

    ctx = R.Context(settings, tokenizer(), Path(tempfile.mkdtemp(prefix="leantune-gpukit-")))
    for row in results:
        _, function, gpu_budget, dry_budget = next(r for r in ROWS if r[0] == row["name"])
        budget = min(dry_budget if opts.dry else gpu_budget, settings.remaining())
        if budget < 10:
            row["note"] = f"time guard: {settings.remaining():.0f} s of {settings.total_s:.0f} s left"
            log(settings, f"{row['name']}: not run ({row['note']})")
            continue
        log(settings, f"{row['name']}: start (budget {budget:.0f} s)")
        row.pop("note", None)
        started, cpu_started = time.monotonic(), time.process_time()
        row["_budget_left"] = lambda started=started, budget=budget: budget - (time.monotonic() - started)
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
        write_results(settings, header, results)
    write_results(settings, header, results)
    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "mismatch", "error", "timeout", "not_run")}
    log(settings, f"done: {counts}; results in {settings.out}/results.json and results.md")
    return 0 if counts["ok"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
