"""Benchmark leantune's `pack_dataset` against TRL's on synthetic lognormal-length sequences.

    python bench/packing.py [--num-sequences 1000000] [--seq-length 2048] [--repeats 3] [--in-process]

Both tools pack the same in-memory Arrow `input_ids` dataset (same seed) with the same strategy. By
default every measurement runs in a fresh Python process: on a small shared VM the heap left behind by
one multi-GB packing run changes the cost of the next one several-fold (leantune's bfd took 1.2 s
before TRL had run in the process and 7-9 s after), so sharing a process measures the allocator, not
the packer. `--in-process` times both in this process instead, alternating them.

TRL is only needed here: `pip install leantune[bench]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

STRATEGIES = ("bfd", "bfd_split", "wrapped")
TOOLS = ("leantune", "trl")


def lognormal_lengths(num_sequences: int, mean: float, max_length: int, sigma: float, seed: int) -> np.ndarray:
    """Sequence lengths with the given mean (before clipping to 1..max_length)."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma**2 / 2  # mean of a lognormal is exp(mu + sigma^2 / 2)
    return np.clip(np.rint(rng.lognormal(mu, sigma, num_sequences)), 1, max_length).astype(np.int64)


def token_dataset(lengths: np.ndarray, dtype: str, vocab_size: int = 32000):
    """An `input_ids` Dataset built straight from Arrow offsets and values (no Python lists)."""
    import datasets

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array((np.arange(offsets[-1], dtype=np.int64) % vocab_size).astype(dtype))
    if offsets[-1] <= np.iinfo(np.int32).max:
        input_ids = pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)
    else:
        input_ids = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    return datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": input_ids})))


def packer(tool: str):
    if tool == "leantune":
        from leantune.data.packing import pack_dataset

        return pack_dataset
    try:
        from trl.data_utils import pack_dataset
    except ImportError as error:
        raise SystemExit(
            f"This benchmark compares against TRL, which is not installed ({error}). "
            "Install it with: pip install leantune[bench]"
        ) from error
    return pack_dataset


@dataclass
class Timing:
    wall_s: float
    cpu_s: float  # user + system time of the process: less sensitive to other load on a shared machine
    rows: int
    fill: float


def timed(pack, dataset, seq_length: int, strategy: str) -> Timing:
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    packed = pack(dataset, seq_length, strategy=strategy)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rows = len(packed)
    tokens = pc.sum(pc.list_value_length(packed.data.table.column("input_ids"))).as_py()
    del packed
    gc.collect()
    return Timing(wall, cpu, rows, tokens / (rows * seq_length))


def median_timing(timings: list[Timing]) -> Timing:
    """Median wall and CPU time over repeats (rows and fill ratio are the same every time)."""
    return Timing(
        float(np.median([t.wall_s for t in timings])),
        float(np.median([t.cpu_s for t in timings])),
        timings[0].rows,
        timings[0].fill,
    )


def data_arguments(args) -> list[str]:
    return [
        f"--num-sequences={args.num_sequences}",
        f"--seq-length={args.seq_length}",
        f"--mean-length={args.mean_length}",
        f"--max-length={args.max_length}",
        f"--sigma={args.sigma}",
        f"--dtype={args.dtype}",
        f"--seed={args.seed}",
    ]


def build_dataset(args):
    import datasets

    datasets.disable_progress_bars()
    lengths = lognormal_lengths(args.num_sequences, args.mean_length, args.max_length, args.sigma, args.seed)
    return lengths, token_dataset(lengths, args.dtype)


def run_worker(args) -> None:
    """Child process: build the data, time one tool on one strategy, print the result as JSON."""
    import logging

    logging.disable(logging.WARNING)
    tool, strategy = args.worker
    pack = packer(tool)
    _, dataset = build_dataset(args)
    print(json.dumps(asdict(timed(pack, dataset, args.seq_length, strategy))))


def measure_in_fresh_process(args, tool: str, strategy: str) -> Timing:
    command = [sys.executable, str(Path(__file__).resolve()), *data_arguments(args), "--worker", tool, strategy]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        raise SystemExit(f"{tool} {strategy} failed:\n{finished.stdout}\n{finished.stderr}")
    return Timing(**json.loads(finished.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-sequences", type=int, default=1_000_000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--mean-length", type=float, default=400.0)
    parser.add_argument("--max-length", type=int, default=8000)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal shape")
    parser.add_argument("--dtype", default="int32", help="token id dtype of the input_ids values")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per tool and strategy; the median is reported")
    parser.add_argument("--skip-trl", action="store_true", help="time leantune only")
    parser.add_argument("--in-process", action="store_true", help="time both tools in this process")
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "STRATEGY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(args)

    import datasets

    tools = TOOLS[:1] if args.skip_trl else TOOLS
    packers = {tool: packer(tool) for tool in tools}  # fail early when TRL is missing
    lengths = lognormal_lengths(args.num_sequences, args.mean_length, args.max_length, args.sigma, args.seed)
    print(f"{platform.machine()}, python {platform.python_version()}, datasets {datasets.__version__}, "
          f"pyarrow {pa.__version__}; {'one process' if args.in_process else 'a fresh process per run'}")
    print(f"{len(lengths):,} sequences, {int(lengths.sum()):,} tokens ({args.dtype}), mean length "
          f"{lengths.mean():.1f}, max {lengths.max()}, {(lengths > args.seq_length).sum():,} longer than "
          f"seq_length={args.seq_length}", flush=True)
    dataset = build_dataset(args)[1] if args.in_process else None

    results = []
    for strategy in args.strategies:
        timings = {tool: [] for tool in tools}
        for _ in range(args.repeats):  # alternate the tools so background load hits both alike
            for tool in tools:
                if args.in_process:
                    timing = timed(packers[tool], dataset, args.seq_length, strategy)
                else:
                    timing = measure_in_fresh_process(args, tool, strategy)
                timings[tool].append(timing)
                print(f"  {strategy}: {tool} {timing.wall_s:.2f} s (cpu {timing.cpu_s:.2f} s)", flush=True)
        results.append((strategy, {tool: median_timing(runs) for tool, runs in timings.items()}))

    lower_bound = -(-int(np.minimum(lengths, args.seq_length).sum()) // args.seq_length)
    print(f"\nmedian of {args.repeats} run(s); bfd row lower bound ceil(tokens after truncation / seq_length) "
          f"= {lower_bound:,}")
    print("| strategy | leantune wall s (cpu s) | TRL wall s (cpu s) | speed-up wall (cpu) "
          "| fill leantune | fill TRL | rows leantune | rows TRL |")
    print("|---|---|---|---|---|---|---|---|")
    for strategy, by_tool in results:
        ours, theirs = by_tool["leantune"], by_tool.get("trl")
        if theirs is None:
            print(f"| {strategy} | {ours.wall_s:.2f} ({ours.cpu_s:.2f}) | - | - | {ours.fill:.5f} | - "
                  f"| {ours.rows:,} | - |")
            continue
        print(f"| {strategy} | {ours.wall_s:.2f} ({ours.cpu_s:.2f}) | {theirs.wall_s:.2f} ({theirs.cpu_s:.2f}) "
              f"| {theirs.wall_s / ours.wall_s:.1f}x ({theirs.cpu_s / ours.cpu_s:.1f}x) | {ours.fill:.5f} "
              f"| {theirs.fill:.5f} | {ours.rows:,} | {theirs.rows:,} |")


if __name__ == "__main__":
    main()
