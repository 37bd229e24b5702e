"""The kit's frame: settings (GPU or --dry), synthetic data, model building, one library's measured run, the time
guards and the results files. The rows themselves are in bench/gpu/rows.py."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3


class RowTimeout(Exception):
    """A row ran past its own time budget (raised from a SIGALRM timer in the main thread)."""


@dataclass
class Settings:
    dry: bool
    out: Path
    total_s: float  # the kit stops starting rows after this many seconds, and cuts the running one at it
    started: float = field(default_factory=time.monotonic)

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def dtype(self):
        import torch

        # bf16 on the GPU (the setting). On CPU, fp32: Liger runs under Triton's interpreter there, which
        # computes with numpy (no bf16), and bf16 matmuls on CPU are slow enough to break the 2-minute dry budget.
        return torch.float32 if self.dry else torch.bfloat16

    @property
    def dtype_name(self) -> str:
        return "float32" if self.dry else "bfloat16"

    def remaining(self) -> float:
        return self.total_s - (time.monotonic() - self.started)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # Sizes: (GPU, dry).
    def steps(self) -> int:
        return 2 if self.dry else 4  # the first step is a warm-up, left out of tokens/s

    def seq_len(self, shape: str) -> int:
        return 48 if self.dry else 1024

    def batch(self, shape: str) -> int:
        if self.dry:
            return 2
        return 2 if "8b" in shape else 4

    def common_fields(self, output_dir: str) -> dict:
        """Training settings both libraries get, set explicitly (their defaults differ on some)."""
        fields = dict(
            output_dir=output_dir, gradient_accumulation_steps=1, learning_rate=1e-5, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, seed=0, max_steps=self.steps(), max_grad_norm=1.0,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
            bf16=not self.dry, fp16=False, logging_strategy="no", save_strategy="no", eval_strategy="no",
            report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        )
        if self.dry:
            fields["use_cpu"] = True
        return fields


def log(settings: Settings | None, message: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    elapsed = f" +{settings.elapsed():6.1f}s" if settings else ""
    print(f"[{stamp}{elapsed}] {message}", flush=True)


# --- time guards ------------------------------------------------------------------------------------------------


@contextmanager
def time_limit(seconds: float, error=RowTimeout):
    """Raise `error` in this (main) thread after `seconds`. Training returns to Python between kernels, so the
    exception lands within a step's op; a stuck C call is cut by run.sh's outer `timeout` instead. Nested: an inner
    limit never outlasts the outer one, which is re-armed with what it had left when the inner one ends."""
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    outer_handler = signal.getsignal(signal.SIGALRM)
    entered = time.monotonic()
    if outer_left and outer_left < seconds:
        seconds, error = outer_left, RowTimeout  # the outer limit comes first: it is the outer one's timeout

    def expire(signum, frame):
        raise error(f"ran past its {seconds:.0f} s budget")

    signal.signal(signal.SIGALRM, expire)
    # Repeats every second until cleared: an exception raised inside a __del__ or a C callback is swallowed by
    # Python ("Exception ignored in ..."), and the next tick raises again.
    signal.setitimer(signal.ITIMER_REAL, max(0.5, seconds), 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(0.1, outer_left - (time.monotonic() - entered)), 1.0)


class ProbeTimeout(Exception):
    """One longest-context probe ran past its library's share of the row's time."""


# --- data ---------------------------------------------------------------------------------------------------------


def tokenizer(max_length: int = 1 << 20):
    """leantune's bundled character tokenizer (one token per character): built in code, no files, and a text's
    length in tokens is its length in characters (+ the special tokens), so row lengths are controlled exactly."""
    from leantune.defaults.tokenizer import build_default_tokenizer

    return build_default_tokenizer(model_max_length=max_length)


def random_text(rng: random.Random, length: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz      .,"
    return "".join(rng.choice(letters) for _ in range(max(1, length)))


def text_rows(n: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """Language-modelling rows of 50% to 100% of `max_tokens` (minus room for BOS/EOS): padding has work to do."""
    rng = random.Random(seed)
    return [{"text": random_text(rng, rng.randint(max_tokens // 2, max_tokens - 4))} for _ in range(n)]


def preference_rows(n: int, max_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    quarter = max(4, max_tokens // 4)
    return [{"prompt": random_text(rng, rng.randint(quarter // 2, quarter)),
             "chosen": random_text(rng, rng.randint(quarter, 2 * quarter)),
             "rejected": random_text(rng, rng.randint(quarter, 2 * quarter))} for _ in range(n)]


def unpaired_rows(n: int, max_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    quarter = max(4, max_tokens // 4)
    return [{"prompt": random_text(rng, rng.randint(quarter // 2, quarter)),
             "completion": random_text(rng, rng.randint(quarter, 2 * quarter)), "label": i % 2 == 0}
            for i in range(n)]


def prompt_rows(n: int, prompt_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": random_text(rng, rng.randint(prompt_tokens // 2, prompt_tokens))} for _ in range(n)]


def dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(rows)


# --- models -------------------------------------------------------------------------------------------------------


def build_model(settings: Settings, shape: str, tok, seed: int = 0):
    """Random weights from the real config, built directly on the device in the kit's dtype (an 8B model in
    seconds on a GPU, no CPU copy). The same seed gives the same weights for both libraries."""
    import torch
    from transformers import AutoModelForCausalLM

    from .shapes import model_config

    config = model_config(shape, tok, settings.dry)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(settings.device):
        model = AutoModelForCausalLM.from_config(config, dtype=settings.dtype)
    model.config._attn_implementation = "sdpa"
    return model


def quantized_checkpoint(settings: Settings, shape: str, tok, folder: Path) -> Path:
    """A saved bf16 (fp32 dry) checkpoint of the random model: bitsandbytes quantizes while transformers loads
    weights, so 4-bit needs weights on disk. Saved once per kit run, loaded by each 4-bit run."""
    if (folder / "config.json").exists():
        return folder
    model = build_model(settings, shape, tok)
    model.save_pretrained(folder, max_shard_size="4GB")
    del model
    free_memory()
    return folder


def load_4bit(settings: Settings, folder: Path):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=settings.dtype)
    device_map = {"": "cpu"} if settings.dry else {"": torch.cuda.current_device()}
    model = AutoModelForCausalLM.from_pretrained(str(folder), quantization_config=quant, dtype=settings.dtype,
                                                 device_map=device_map, attn_implementation="sdpa")
    # Each library trains this one model in turn: rows.unload_adapter puts back what a run cast in place.
    model._kit_load_dtypes = {name: p.dtype for name, p in model.named_parameters()}
    return model


QUANT_FIELDS = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def free_memory() -> None:
    """One garbage collection (bench.common.release_memory's, which also trims the heap), then CUDA's cache. A
    collection scans every live object: with torch, transformers and TRL loaded, ~0.35 s on the dev VM, most of a
    tiny --dry row's CPU time, hence one collection here (not two) and kit.py's gc.freeze() after its imports."""
    from bench.common import release_memory

    release_memory()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - freeing must never fail a row
        pass


def is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


# --- memory meter -------------------------------------------------------------------------------------------------


class Meter:
    """Peak memory around a run: CUDA's allocator counters on the GPU; on CPU (--dry) the process's peak RSS (Linux
    VmHWM, reset before), reported in the same fields and marked "cpu_rss"."""

    def __init__(self, settings: Settings):
        self.cuda = not settings.dry

    def start(self) -> None:
        import torch

        from bench.common import reset_peak_rss, rss_bytes

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            free_memory()
            self.before = rss_bytes()
            reset_peak_rss()

    def stop(self) -> dict:
        import torch

        from bench.common import peak_rss_bytes

        if self.cuda:
            torch.cuda.synchronize()
            return {"meter": "cuda", "before_gib": self.before / GIB,
                    "max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                    "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB}
        peak = peak_rss_bytes()
        # No allocator on CPU: "allocated" is the peak RSS, "reserved" the same number (glibc keeps what it took).
        return {"meter": "cpu_rss", "before_gib": self.before / GIB, "max_allocated_gib": peak / GIB,
                "max_reserved_gib": peak / GIB}


# --- one library's measured run -----------------------------------------------------------------------------------


class TokenCounter:
    """Non-padding tokens through the policy model's own forward, per optimizer step: a forward pre-hook on the
    model, the same for every trainer (gradient checkpointing recomputes layers, not this forward)."""

    def __init__(self, model, timer):
        self.timer, self.per_step = timer, {}
        self.handle = model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if ids is None:
            return
        tokens = int(mask.sum()) if mask is not None and mask.dim() == 2 else int(ids.numel())
        step = len(self.timer.step_ends)
        self.per_step[step] = self.per_step.get(step, 0) + tokens

    def close(self):
        self.handle.remove()


class GenerationClock:
    """Each step's seconds in the online trainer's generating call (synchronised on CUDA): leantune's
    `GenerationSession.generate`, TRL's `_generate_single_turn`; the rest of a step is its time without them. Does
    nothing for a trainer that does not generate."""

    def __init__(self, trainer, timer):
        import torch

        self.timer, self.per_step, self.owner = timer, {}, None
        session = getattr(trainer, "generation", None)
        self.owner, self.name = (session, "generate") if hasattr(session, "generate") \
            else (trainer, "_generate_single_turn") if hasattr(trainer, "_generate_single_turn") else (None, None)
        if self.owner is None:
            return
        original = getattr(self.owner, self.name)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def timed(*args, **kwargs):
            sync()
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync()
                step = len(self.timer.step_ends)
                self.per_step[step] = self.per_step.get(step, 0.0) + time.perf_counter() - began

        setattr(self.owner, self.name, timed)

    def split(self, step_seconds: list[float]) -> dict:
        """Per step: seconds generating and the rest of the step (empty for a trainer that does not generate)."""
        if self.owner is None:
            return {}
        generation = [round(self.per_step.get(i, 0.0), 3) for i in range(len(step_seconds))]
        return {"generation_seconds": generation,
                "rest_seconds": [round(s - g, 3) for s, g in zip(step_seconds, generation)]}


def train_measured(settings: Settings, trainer, model) -> dict:
    """Train `trainer` (built with max_steps) and measure: per-step losses, tokens/s after the warm-up step, peak
    memory. `model` is the module the trainer's forward calls (for the token count)."""
    from bench.common import make_step_timer

    timer = make_step_timer(1)
    trainer.add_callback(timer)
    counter = TokenCounter(model, timer)
    clock = GenerationClock(trainer, timer)
    losses: list[float] = []
    training_step = trainer.training_step

    def recording_step(*args, **kwargs):
        loss = training_step(*args, **kwargs)
        losses.append(float(loss.detach().float()))
        return loss

    trainer.training_step = recording_step
    meter = Meter(settings)
    meter.start()
    try:
        trainer.train()
    finally:
        counter.close()
    memory = meter.stop()
    seconds = timer.timed_seconds()
    tokens = sum(n for step, n in counter.per_step.items() if step >= 1)
    # leantune's chunked head: its rows per chunk by vocabulary size (the rule's choice on this device, or
    # loss_chunk_size); None for TRL and for a run whose head never ran chunked
    chunk_rows = dict(getattr(getattr(trainer, "logprobs", None), "chunk_rows", None) or {}) or None
    if chunk_rows:
        log(settings, f"chunked head rows per chunk (vocabulary: rows): {chunk_rows}")
    return {"losses": losses, "steps": len(timer.step_ends), "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "step_seconds": [round(s, 3) for s in timer.step_seconds()], "loss_chunk_rows": chunk_rows, **memory,
            **clock.split(timer.step_seconds())}


def plan_peak(settings: Settings, shape: str, tok, train_rows, method: str, fields: dict, peft_config=None,
              quantized: bool = False, reward_funcs=None, measured_step: bool = True) -> dict:
    """The planner's step peak for the same run (leantune.plan_memory on the config: no weights). The kit builds its
    models in `settings.dtype`; the planner, like the trainers, reads a model given as a config in float32 unless
    `model_init_kwargs` names the dtype (without it a bf16 row's plan was the fp32 figure: 24.7 GiB planned against
    12.5 measured on the H100)."""
    from leantune import plan_memory

    from .shapes import model_config

    fields = {k: v for k, v in fields.items() if k not in ("use_cpu",)}
    if quantized:
        fields["model_init_kwargs"] = {"quantization_config": dict(QUANT_FIELDS), "dtype": "bfloat16"}
    else:
        fields["model_init_kwargs"] = {"dtype": settings.dtype_name}
    started = time.perf_counter()
    plan = plan_memory(model_config(shape, tok, settings.dry), dataset(train_rows), method, processing_class=tok,
                       peft_config=peft_config, reward_funcs=reward_funcs, max_batches=1, measured_step=measured_step,
                       **fields)
    return {"plan_peak_gib": plan.peak_bytes / GIB, "plan_seconds": round(time.perf_counter() - started, 1)}


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def loss_tolerance(settings: Settings) -> float:
    """Relative tolerance of per-step losses, leantune vs TRL. Both compute the same model, data and optimizer;
    they differ in kernels and reduction order (leantune's chunked head vs TRL's full logits, fused vs unfused
    norms). bf16 keeps 8 significant bits: one rounding is 2^-8 relative (finfo.eps / 2); the loss is a mean of
    fp32 log-probs whose logits each went through bf16 matmuls, so per-token errors of a few ulps mostly average
    out; 4 eps (~3%) bounds it with room for the 3 small (lr 1e-5) optimizer steps that follow. In fp32 (--dry),
    the reduction orders differ by ~1e-6 relative, and Adam's first update (about lr x sign(gradient)) can flip
    the sign of gradient entries near zero: 1e-4 leaves two orders of magnitude over what those do to a loss
    near ln(vocab)."""
    import torch

    return 1e-4 if settings.dry else 4 * torch.finfo(torch.bfloat16).eps


def compare_losses(settings: Settings, leantune_losses: list[float], trl_losses: list[float],
                   noise: float | None = None) -> dict:
    """Per-step agreement within loss_tolerance, or within twice `noise` where that is larger: the largest relative
    difference between leantune's two runs of the row (same seed), the run-to-run noise of CUDA's non-deterministic
    kernels (atomics in attention's and the embedding's backward). Each library's run is one draw of that noise, so
    their difference is within twice it. Measured on the H100 (2026-11-27): TRL's own DPO losses moved by 3.4% at
    step 3 between two runs in one process, over the 3.1% of 4 bf16 eps."""
    rtol = max(loss_tolerance(settings), 2 * noise) if noise is not None else loss_tolerance(settings)
    if not leantune_losses or len(leantune_losses) != len(trl_losses):
        return {"losses_match": False, "loss_max_rel_diff": None, "loss_rtol": rtol}
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(leantune_losses, trl_losses))
    return {"losses_match": bool(worst <= rtol), "loss_max_rel_diff": worst, "loss_rtol": rtol,
            **({"loss_noise_rel": noise} if noise is not None else {})}


def error_record(error: BaseException) -> dict:
    tail = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-2500:]
    return {"error": f"{type(error).__name__}: {str(error)[:500]}", "traceback_tail": tail}


# --- results files ------------------------------------------------------------------------------------------------


def write_results(settings: Settings, header: dict, rows: list[dict]) -> None:
    """Rewrite results.json and results.md (called after every row, so a cut run keeps what it measured)."""
    settings.out.mkdir(parents=True, exist_ok=True)
    payload = {**header, "elapsed_s": round(settings.elapsed(), 1), "rows": rows}
    tmp = settings.out / "results.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, settings.out / "results.json")
    (settings.out / "results.md").write_text(render_markdown(header, rows))


def _gib(value) -> str:
    return f"{value:.2f}" if finite(value) else "n/a"


def tokens_per_s_cell(result: dict) -> str:
    """leantune's warm figure when it had its rerun (rows.run_pair), else marked cold when a rerun was skipped."""
    tps = result.get("tokens_per_s")
    if not finite(tps):
        return "n/a"
    cold = "tokens_per_s_cold" in result and not isinstance(result.get("warm_rerun"), dict)
    return f"{tps:,.0f}" + (" (cold)" if cold else "")


def tokens_ratio_cell(library: str, libraries: dict) -> str:
    """leantune's tokens/s over TRL's, on leantune's line."""
    if library != "leantune":
        return ""
    ours, theirs = libraries[library].get("tokens_per_s"), (libraries.get("trl") or {}).get("tokens_per_s")
    return f"{ours / theirs:.2f}" if finite(ours) and finite(theirs) and theirs > 0 else ""


def render_markdown(header: dict, rows: list[dict]) -> str:
    lines = [f"# leantune GPU kit ({'dry, CPU' if header.get('dry') else 'GPU'})", "",
             "; ".join(f"{k}: {v}" for k, v in header.get("versions", {}).items()), "",
             *([header["cuda_tests_line"], ""] if header.get("cuda_tests_line") else []),
             "| row | status | library | peak alloc GiB | reserved GiB | plan GiB | tok/s | leantune/TRL tok/s | losses "
             "| note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        libraries = row.get("libraries") or {}
        note = row.get("error") or row.get("summary") or row.get("note") or ""
        if not libraries:
            lines.append(f"| {row['name']} | {row['status']} | | | | | | | | {note[:160]} |")
            continue
        for library, result in libraries.items():
            losses = ", ".join(f"{x:.4f}" for x in result.get("losses", [])[:6])
            lines.append(
                f"| {row['name']} | {row['status']} | {library} | {_gib(result.get('max_allocated_gib'))} | "
                f"{_gib(result.get('max_reserved_gib'))} | {_gib(result.get('plan_peak_gib'))} | "
                f"{tokens_per_s_cell(result)} | {tokens_ratio_cell(library, libraries)} | {losses} | "
                f"{(result.get('error') or note)[:160]} |")
    return "\n".join(lines) + "\n"


def scratch_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=f"leantune-gpukit-{prefix}-")
