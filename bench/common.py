"""Shared helpers for leantune's benchmarks (bench/*.py): paths, data, tiny models, timing, memory, tables.

Nothing here is imported by the library itself. Data: the full-size copies in the project's `shared/` folder
(`LEANTUNE_SHARED=/path/to/shared`, else `<repo>/../shared` where it exists), or else the slices of the same files kept
in the repository's tests/fixtures/shared (3,000 GSM8K rows, 300 HH-RLHF pairs, the same tokenizer); nothing is downloaded.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """Where the benchmarks read their data: full size where the shared folder is given or beside the clone."""
    explicit = os.environ.get("LEANTUNE_SHARED")
    if explicit:
        return Path(explicit)
    beside = REPO.parent / "shared"
    return beside if beside.is_dir() else REPO / "tests" / "fixtures" / "shared"


SHARED = data_root()
GSM8K_TRAIN = SHARED / "data" / "gsm8k" / "train.jsonl"
TOKENIZER_DIR = SHARED / "tokenizers" / "mistral-7b-v0.1"

MIB = 1024 * 1024


# --- environment ------------------------------------------------------------------------------------------------


def quiet() -> None:
    """Silence progress bars and info logs so that the tables stay readable."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import logging

    for name in ("leantune", "trl", "accelerate", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)


def machine_description() -> str:
    import torch

    mem_gib = None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    mem_gib = int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = f"{mem_gib:.0f} GiB RAM" if mem_gib else "RAM unknown"
    return (
        f"{os.cpu_count()}-core CPU ({cpu}), {mem}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def source_state(path: str = "leantune") -> str:
    """The commit and the uncommitted files under `path`, so a number can be tied to the code that produced it."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    # Porcelain lines are "XY path": keep the leading status column (a strip() would shift the first path).
    dirty = [line[3:] for line in git("status", "--porcelain", "--", path).splitlines() if line.strip()]
    return f"{path} at {commit}" + (f" + uncommitted {', '.join(dirty)}" if dirty else "")


def library_versions(*names: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in names:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


# --- memory -----------------------------------------------------------------------------------------------------


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset_peak_rss() (Linux VmHWM)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset Linux's peak RSS to the current RSS (write 5 to /proc/self/clear_refs). False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def release_memory() -> None:
    """Collect garbage and give freed heap pages back to the OS, so one run's leftovers do not count in the next."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass


# --- models and data --------------------------------------------------------------------------------------------


def tiny_llama(seed: int, vocab_size: int, hidden: int = 256, layers: int = 4, heads: int = 4, intermediate: int = 1024,
               pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2, attn_implementation: str = "sdpa"):
    """A small fp32 Llama with a reproducible random init (the same seed gives the same weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = attn_implementation
    return model


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def gsm8k_prompt_completion(limit: int | None = None, tokenizer=None, max_tokens: int | None = None):
    """GSM8K train as prompt-completion: prompt = question, completion = " " + answer.

    With `tokenizer` and `max_tokens`, rows whose prompt + completion + EOS exceed `max_tokens` tokens are left out,
    so that no library has to truncate (truncation policies differ between libraries and modes).
    """
    from datasets import Dataset

    rows = []
    with open(GSM8K_TRAIN) as handle:
        for line in handle:
            item = json.loads(line)
            rows.append({"prompt": item["question"], "completion": " " + item["answer"]})
    if tokenizer is not None and max_tokens is not None:
        lengths = [len(ids) + 1 for ids in tokenizer([r["prompt"] + r["completion"] for r in rows])["input_ids"]]
        rows = [r for r, n in zip(rows, lengths) if n <= max_tokens]
    if limit is not None:
        rows = rows[:limit]
    return Dataset.from_list(rows)


# --- timing -----------------------------------------------------------------------------------------------------


def write_sft_jsonl(path, rows: int) -> None:
    """The first `rows` GSM8K questions as prompt-completion JSONL (the data the scale-out benchmarks launch on)."""
    import json

    with open(GSM8K_TRAIN, encoding="utf-8") as source, open(path, "w", encoding="utf-8") as handle:
        for _, line in zip(range(rows), source):
            row = json.loads(line)
            handle.write(json.dumps({"prompt": row["question"], "completion": " " + row["answer"]}) + "\n")


def make_step_timer(warmup_steps: int):
    """A TrainerCallback recording the wall time at the end of every optimizer step."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.warmup_steps = warmup_steps
            self.step_ends: list[float] = []
            self.cpu_step_ends: list[float] = []
            self.train_begin: float | None = None
            self.cpu_train_begin: float | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.perf_counter()
            self.cpu_train_begin = time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter())
            self.cpu_step_ends.append(time.process_time())

        def timed_seconds(self) -> float:
            """Seconds from the end of the warm-up steps to the end of the last step."""
            if len(self.step_ends) <= self.warmup_steps:
                raise RuntimeError(f"Only {len(self.step_ends)} steps ran; need more than {self.warmup_steps}.")
            start = self.step_ends[self.warmup_steps - 1] if self.warmup_steps else self.train_begin
            return self.step_ends[-1] - start

        def timed_cpu_seconds(self) -> float:
            """CPU seconds (user + system, all threads) of the process over the same steps: less sensitive to
            other jobs on the machine than wall time."""
            start = self.cpu_step_ends[self.warmup_steps - 1] if self.warmup_steps else self.cpu_train_begin
            return self.cpu_step_ends[-1] - start

        def step_seconds(self) -> list[float]:
            starts = [self.train_begin] + self.step_ends[:-1]
            return [b - a for a, b in zip(starts, self.step_ends)]

    return StepTimer()


@dataclass
class BatchLog:
    """What one collated batch holds: real (non-padding) tokens and all token slots fed to the model."""

    real: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)


class CountingCollator:
    """Wrap a collator and record, per batch and in collation order, the real tokens it feeds to the model.

    Real tokens are counted from the examples themselves (the length of each tokenised example or packed row,
    before any padding), the same way for every library, and cross-checked against the batch: with an
    attention_mask its sum must match; without one, the batch's token slots must hold at least that many.
    Batches come out of the DataLoader in collation order, so batch i is optimizer step i (no accumulation).
    """

    def __init__(self, collator, log: BatchLog | None = None):
        self.collator = collator
        self.log = log or BatchLog()

    def __call__(self, examples):
        real = sum(len(ex["input_ids"]) for ex in examples)
        batch = self.collator(examples)
        ids = batch["input_ids"]
        if "attention_mask" in batch and batch["attention_mask"] is not None:
            masked = int(batch["attention_mask"].sum())
            if masked != real:
                raise AssertionError(f"attention_mask counts {masked} tokens, the examples hold {real}.")
        if ids.numel() < real:
            raise AssertionError(f"The batch has {ids.numel()} token slots for {real} real tokens.")
        self.log.real.append(real)
        self.log.slots.append(int(ids.numel()))
        self.log.rows.append(int(ids.shape[0]))
        self.log.widths.append(int(ids.shape[-1]))
        return batch

    def __getattr__(self, name):  # behave like the wrapped collator for anything else
        return getattr(self.collator, name)


# --- tables -----------------------------------------------------------------------------------------------------


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(value):
        if value is None:
            return "n/a"
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 10 else f"{value:,.0f}"
        return str(value)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([line, sep, *body])


def print_saved_report(path, summarise, render) -> int:
    """`--render`: the table of an earlier `--out` report, its summary recomputed (so a report written before a
    summary rule changed renders as today's). Returns the exit code."""
    report = json.loads(Path(path).read_text())
    report["summary"] = summarise(report)
    print(render(report))
    return 0


def finish_report(report: dict, started: float, save, render) -> int:
    """A bench's end: its seconds in the report, the report saved, its table and the seconds printed. Returns the
    exit code."""
    report["seconds"] = round(time.perf_counter() - started, 1)
    save()
    print()
    print(render(report))
    print(f"\n({report['seconds']:.0f} s in all)")
    return 0
