"""Benchmark `leantune profile` on a million chat examples: is the profile bounded by tokenisation?

    python bench/profiler.py [--num-examples 1000000] [--num-proc N] [--repeats R] [--data-dir DIR]

Data: the 7,473 GSM8K training rows as conversations ([user: question, assistant: answer]), repeated up to
`--num-examples` rows, saved once with `save_to_disk` and memory-mapped (as a user's data file would be), and the
Mistral tokenizer with its chat template, both from `../shared`.

Two timings, each in its own fresh process (so neither reuses the other's cache or warm heap):

- tokenisation alone: `tokenize_lengths`, the batched `Dataset.map` the profile runs, on all cores;
- the whole profile: `profile_dataset` (loading, tokenisation, every number for the default candidates and the
  recommendation), then the figure and the JSON, as `leantune profile` writes them.

The ratio says how much the report adds to tokenisation; with `--repeats`, the stages alternate and the fastest
run of each is kept (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    GSM8K_TRAIN,
    TOKENIZER_DIR,
    library_versions,
    machine_description,
    source_state,
)


def build_chat_dataset(num_examples: int, data_dir: Path) -> Path:
    """Save `num_examples` GSM8K conversations to `data_dir` (reused when already there with that size)."""
    import datasets

    path = data_dir / f"gsm8k-chat-{num_examples}"
    if (path / "dataset_info.json").exists():
        return path
    with open(GSM8K_TRAIN, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    conversations = datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
        for r in rows
    ])
    copies = -(-num_examples // len(conversations))
    repeated = datasets.concatenate_datasets([conversations] * copies).select(range(num_examples))
    repeated.flatten_indices().save_to_disk(str(path))
    return path


def time_stage(stage: str, data_path: Path, num_proc: int | None, out_dir: Path) -> dict:
    """Run one stage in a fresh Python process and return what it reports."""
    code = f"""
import json, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import datasets
datasets.disable_caching()
from transformers import AutoTokenizer
started = time.perf_counter()
data = datasets.load_from_disk({str(data_path)!r})
tokenizer = AutoTokenizer.from_pretrained({str(TOKENIZER_DIR)!r})
result = {{}}
if {stage!r} == "tokenise":
    from leantune.profiling.lengths import tokenize_lengths
    began = time.perf_counter()
    lengths = tokenize_lengths(data, tokenizer, num_proc={num_proc!r})
    result["seconds"] = time.perf_counter() - began
    result["tokens"] = int(lengths.sequences.sum())
else:
    from leantune import profile_dataset
    from leantune.profiling import write_length_figure
    began = time.perf_counter()
    profile = profile_dataset(data, tokenizer, num_proc={num_proc!r})
    written = time.perf_counter()
    write_length_figure(profile, {str(out_dir / "length_profile.png")!r})
    profile.to_json({str(out_dir / "length_profile.json")!r})
    result["seconds"] = time.perf_counter() - began
    result["figure_and_json_seconds"] = time.perf_counter() - written
    result["stages"] = profile.seconds
    result["tokens"] = profile.stats["sequences"].total_tokens
    result["recommendation"] = profile.recommendation.config_lines
    result["report"] = profile.format_text()
print("RESULT " + json.dumps(result))
"""
    env = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        raise RuntimeError(f"{stage} failed:\n{run.stderr[-4000:]}")
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    # CPU time of the process and its tokenisation workers, start-up included: less sensitive to other load.
    result["cpu_seconds"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-examples", type=int, default=1_000_000)
    parser.add_argument("--num-proc", type=int, default=None, help="tokenisation processes (default: all cores)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each stage, alternating; the best is kept")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "leantune-bench-profile")
    args = parser.parse_args()

    print(f"machine: {machine_description()}")
    print(f"libraries: {library_versions('datasets', 'transformers', 'tokenizers', 'numpy', 'matplotlib')}")
    print(f"source: {source_state()}")
    args.data_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    data_path = build_chat_dataset(args.num_examples, args.data_dir)
    print(f"data: {args.num_examples:,} GSM8K conversations at {data_path} ({time.perf_counter() - began:.1f} s)")

    runs = {"tokenise": [], "profile": []}
    for repeat in range(args.repeats):  # alternate the order, so slow spells of a shared machine hit both
        order = ("tokenise", "profile") if repeat % 2 == 0 else ("profile", "tokenise")
        for stage in order:
            runs[stage].append(time_stage(stage, data_path, args.num_proc, args.data_dir))
            print(f"  run {repeat + 1} {stage}: {runs[stage][-1]['seconds']:.1f} s", flush=True)
    tokenise = min(runs["tokenise"], key=lambda r: r["seconds"])
    whole = min(runs["profile"], key=lambda r: r["seconds"])
    assert tokenise["tokens"] == whole["tokens"], (tokenise["tokens"], whole["tokens"])
    print()
    print(whole["report"])
    print()
    stages = whole["stages"]
    rate = args.num_examples / tokenise["seconds"]
    print(f"load average after the runs: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; best of {args.repeats}")
    print(f"tokenisation alone: {tokenise['seconds']:.1f} s ({rate:,.0f} examples/s, {tokenise['tokens']:,} tokens); "
          f"process CPU {tokenise['cpu_seconds']:.1f} s")
    print(f"whole profile:      {whole['seconds']:.1f} s (load {stages['load']:.1f} s, tokenise "
          f"{stages['tokenise']:.1f} s, report {stages['report']:.1f} s, figure + JSON "
          f"{whole['figure_and_json_seconds']:.1f} s); process CPU {whole['cpu_seconds']:.1f} s")
    print(f"ratio whole / tokenisation alone: {whole['seconds'] / tokenise['seconds']:.3f} wall, "
          f"{whole['cpu_seconds'] / tokenise['cpu_seconds']:.3f} CPU")
    after_tokenising = stages["report"] + whole["figure_and_json_seconds"]
    print(f"inside the whole profile: report + figure + JSON = {after_tokenising:.1f} s, "
          f"{after_tokenising / stages['tokenise']:.1%} of its tokenisation")


if __name__ == "__main__":
    main()
