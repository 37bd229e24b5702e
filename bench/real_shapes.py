"""Real model shapes on this machine: Qwen2.5-0.5B's full shape, SFT at 1k-8k tokens a step, leantune and TRL.

    python bench/real_shapes.py [--quick] [--lengths 1024,2048,4096,8192] [--cap-gib 20] [--budget-gib 24]
                                [--out real_shapes.json] [--layers N --hidden H --vocab V ...  (a smaller shape)]

The model is Qwen2.5-0.5B's configuration (24 layers, hidden 896, 14 heads / 2 KV heads, intermediate 4864, vocabulary
151,936, tied embeddings) with random weights in fp32: no Hub here, and the shape, not the weights, sets memory and
time. A step is one sequence of `length` token ids (batch 1), drawn uniformly over the whole vocabulary (special ids
0-2 excepted), the loss on every token. Both libraries get the same seeded model, the same rows and the same settings:
gradient checkpointing on (non-reentrant), AdamW, fp32, lr, seed, `--steps` optimizer steps; each library's defaults
otherwise (leantune's chunked loss; TRL 1.16's own fused LM head and its entropy / accuracy metrics).

Per length and library, each run in its own subprocess (so its RSS peak is its own and its memory goes back):
- peak memory: the second step's tensor peak (leantune's MemoryBreakdownCallback, PyTorch's MemTracker, the same meter
  for both) and the process's peak RSS (Linux VmHWM, the whole process: Python, torch, the model);
- tokens/s over the steps after the first (the warm-up); the second step is metered (its dispatch overhead counts,
  the same for both libraries; it is small next to these matmuls);
- every step's loss (the value `training_step` returns, unrounded); the two libraries' losses are compared;
- model FLOPs utilisation against this machine's fp32 matmul peak, measured in the same run (best of several
  `torch.mm` of square matrices): MFU counts the model's FLOPs (6 x non-embedding parameters x tokens + causal
  attention + the LM head), not the checkpointing's recompute (HFU would be about x 8/6 of the layers' part).

Predictions: leantune's planner (`plan_memory`, the trainer's own step with fake weights) for every length; TRL's
SFTTrainer step traced under the same fake-weight machinery (planning/fake_step.py) with the same meter, checked
against its measured peak where it ran. A run predicted above `--cap-gib` is not run ("predicted, not run"): this
machine's memory is shared. The longest length each library fits in `--budget-gib` is found by bisection on its
prediction (marked predicted).

Time: the steps are the cost. With the checkpointing's recompute a step is 3.95 / 8.26 / 17.96 / 41.69 TFLOP at
1k / 2k / 4k / 8k tokens; 2 steps x 2 libraries make ~16 TFLOP for `--quick` (1k only) and ~287 for the full run, so
at this 2-core machine's ~40 GFLOP/s fp32 peak, `--quick` takes ~10 minutes and the full run ~2.5-3 hours when the
machine is quiet (plus ~2-5 minutes of planning a length); `--lengths` runs a subset.

Nothing is downloaded. The tokenizer (only its special ids are used) is the Mistral one (bench/common.py's
TOKENIZER_DIR: the shared folder's, else the copy in tests/fixtures/shared), or `--tokenizer DIR`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    MIB,
    TOKENIZER_DIR,
    finish_report,
    library_versions,
    machine_description,
    markdown_table,
    peak_rss_bytes,
    print_saved_report,
    quiet,
    release_memory,
    rss_bytes,
    source_state,
)
from devkit.longest_fitting import longest_fitting  # noqa: E402
from devkit.model_flops import model_flops  # noqa: E402
from devkit.qwen2_shape import QWEN25_05B, qwen2_config  # noqa: E402

GIB = 1024 * MIB
LIBRARIES = ("leantune", "trl")
FULL_LENGTHS = (1024, 2048, 4096, 8192)
QUICK_LENGTHS = (1024,)
FIRST_ID = 3  # token ids 0-2 are the tokenizer's unk/pad, bos and eos: a row never holds them


# --- the model and the data ---------------------------------------------------------------------------------------


def model_config(opts):
    """Qwen2.5-0.5B's configuration with the shape flags applied."""
    return qwen2_config(**{name: getattr(opts, name) for name in QWEN25_05B})


def build_model(config, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model


def rows_dataset(length: int, vocab: int, seed: int, rows: int):
    """`rows` sequences of `length` token ids, uniform over the vocabulary (ids 0-2 excepted), all the same row: every
    step of either library trains on the same tokens whatever order its sampler takes."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_ID, vocab, (length,), generator=generator).tolist()
    return Dataset.from_list([{"input_ids": ids} for _ in range(rows)])


def tokenizer_dir(opts) -> Path:
    return Path(opts.tokenizer) if opts.tokenizer else TOKENIZER_DIR  # bench/common.py: shared, else tests' copy


def load_tokenizer(opts):
    from transformers import AutoTokenizer

    path = tokenizer_dir(opts)
    if not path.is_dir():
        raise SystemExit(f"error: tokenizer folder {path} not found; set LEANTUNE_SHARED or pass --tokenizer DIR")
    return AutoTokenizer.from_pretrained(str(path))


def sft_settings(library: str, opts, length: int, output_dir: str, steps: int) -> dict:
    """The same explicit settings for both libraries (their defaults differ: TRL's bf16, max_length, ...)."""
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_length=length,
        learning_rate=opts.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
        seed=opts.seed, data_seed=opts.seed, max_steps=steps, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=False, fp16=False, logging_strategy="steps",
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        packing=False, dataset_num_proc=None,
    )
    if library == "leantune":
        settings["memory_breakdown"] = False  # the benchmark attaches the same meter to both libraries
    if getattr(opts, "optimizer_in_backward", False):  # clipping off on both sides: the same training
        settings["max_grad_norm"] = 0.0
        if library == "leantune":
            settings["optimizer_in_backward"] = True
    return settings


def trainer_classes(library: str):
    if library == "leantune":
        from leantune import SFTConfig, SFTTrainer
    else:
        from trl import SFTConfig, SFTTrainer
    return SFTConfig, SFTTrainer


# --- one measured run (in its own process) ------------------------------------------------------------------------


def measure(library: str, length: int, opts) -> dict:
    """Train `opts.steps` steps of `library`'s SFTTrainer at `length` tokens a step; the second step is metered."""
    import torch
    from transformers import set_seed

    from leantune.metrics.memory_breakdown import MemoryBreakdownCallback

    quiet()
    tokenizer = load_tokenizer(opts)
    config_class, trainer_class = trainer_classes(library)
    losses: list[float] = []
    step_ends: list[float] = []

    class Recorded(trainer_class):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    breakdowns = []
    with tempfile.TemporaryDirectory(prefix=f"real-shapes-{library}-") as output_dir:
        args = config_class(**sft_settings(library, opts, length, output_dir, opts.steps))
        model = build_model(model_config(opts), opts.seed)
        set_seed(opts.seed)
        dataset = rows_dataset(length, opts.vocab, opts.seed, opts.steps)
        trainer = Recorded(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                           callbacks=[StepClock(), MemoryBreakdownCallback(args.device, breakdowns.append, step=1)])
        tokens = []
        collator = trainer.data_collator

        def counting(examples):
            batch = collator(examples)
            tokens.append(int(batch["input_ids"].numel()))
            return batch

        trainer.data_collator = counting
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the table is this script's output
        release_memory()
        rss_before = rss_bytes()
        started = time.perf_counter()
        trainer.train()
    timed = step_ends[-1] - step_ends[0]
    return {
        "library": library, "length": length, "steps": len(step_ends), "tokens_per_step": tokens,
        "tokens_per_s": sum(tokens[1:len(step_ends)]) / timed if timed > 0 else None,
        "step_seconds": [round(b - a, 3) for a, b in zip([started, *step_ends[:-1]], step_ends)],
        "peak_mib": breakdowns[0].peak_bytes / MIB if breakdowns else None,
        "parts_mib": {k: v / MIB for k, v in breakdowns[0].parts.items()} if breakdowns else {},
        "peak_rss_mib": peak_rss_bytes() / MIB, "rss_before_train_mib": rss_before / MIB,
        "losses": losses, "threads": torch.get_num_threads(),
    }


def measure_in_subprocess(library: str, length: int, opts) -> dict:
    """`measure` in a child process: its RSS peak is its own and its memory is returned to the machine after."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        result_path = handle.name
    command = [sys.executable, str(Path(__file__).resolve()), "--child", library, "--child-length", str(length),
               "--child-out", result_path, *opts.forwarded]
    started = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        if process.returncode != 0:
            tail = (process.stderr or process.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"library": library, "length": length, "error": f"exit {process.returncode}: {tail[0][:300]}"}
        result = json.loads(Path(result_path).read_text())
    finally:
        Path(result_path).unlink(missing_ok=True)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


# --- predictions --------------------------------------------------------------------------------------------------


def plan_leantune(config, length: int, opts, tokenizer) -> int:
    """leantune's planner: its SFT step, traced with fake weights, peak bytes of the second step."""
    from leantune.planning.planner import plan_memory

    settings = sft_settings("leantune", opts, length, "/tmp/leantune-plan", 2)
    for name in ("output_dir", "max_steps", "logging_strategy", "logging_steps", "save_strategy", "eval_strategy",
                 "report_to", "use_cpu", "disable_tqdm", "memory_breakdown"):
        settings.pop(name)
    plan = plan_memory(config, rows_dataset(length, opts.vocab, opts.seed, 1), "sft", processing_class=tokenizer,
                       measured_step=False, max_batches=1, **settings)
    return plan.worst.peak_bytes


def plan_trl(config, length: int, opts, tokenizer) -> int:
    """TRL's SFTTrainer step traced like leantune's plan: its own trainer, fake weights (planning/fake_step.py),
    the same meter on its second step. As the planner does (docs/plan.md, "Big models"), a model of more than 4
    layers is traced with 2, 3 and 4 and extrapolated when the peak grows by the same bytes a layer, else whole."""
    from leantune.planning.planner import LAYERS_TRACED, _with_layers

    layers = config.num_hidden_layers
    if layers <= LAYERS_TRACED[-1]:
        return _trace_trl(config, length, opts, tokenizer)
    first, second, third = (_trace_trl(_with_layers(config, n), length, opts, tokenizer) for n in LAYERS_TRACED)
    if second - first != third - second:
        return _trace_trl(config, length, opts, tokenizer)
    return first + (layers - LAYERS_TRACED[0]) * (second - first)


def _trace_trl(config, length: int, opts, tokenizer) -> int:
    from transformers import set_seed

    from leantune.metrics.memory_breakdown import MemoryBreakdownCallback
    from leantune.planning.fake_step import fake_model_from_config
    from leantune.planning.planned_run import planning_session
    from leantune.planning.planner import _quiet, _train_quietly

    config_class, trainer_class = trainer_classes("trl")
    breakdowns = []
    with tempfile.TemporaryDirectory(prefix="real-shapes-trl-plan-") as output_dir, planning_session() as mode:
        import torch

        args = config_class(**sft_settings("trl", opts, length, output_dir, 2))
        fake = fake_model_from_config(config, mode, dtype=torch.float32)
        set_seed(opts.seed)
        trainer = trainer_class(model=fake, args=args, train_dataset=rows_dataset(length, opts.vocab, opts.seed, 2),
                                processing_class=tokenizer,
                                callbacks=[MemoryBreakdownCallback(args.device, breakdowns.append, step=1)])
        _quiet(trainer)
        _train_quietly(trainer)
    if not breakdowns:
        raise RuntimeError("the traced TRL step produced no memory breakdown")
    return breakdowns[0].peak_bytes


# --- the machine's peak (model FLOPs: devkit/model_flops.py) ------------------------------------------------------


def matmul_peak_gflops(size: int, repeats: int) -> float:
    """This machine's fp32 matmul rate: the best of `repeats` `torch.mm` of two `size` x `size` matrices."""
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size ** 3 / best / 1e9


# --- the table ----------------------------------------------------------------------------------------------------


def ratio(a, b):
    return a / b if a is not None and b else None


def summarise(report: dict) -> list[dict]:
    rows = []
    for length in report["lengths"]:
        entry = {"length": length}
        for library in LIBRARIES:
            run = report["runs"].get(f"{library}:{length}")
            planned = report["plans"][library].get(str(length))
            entry[library] = {"planned_mib": planned / MIB if planned is not None else None}
            if run and "error" not in run and not run.get("skipped"):
                flops = report["flops"][str(length)]["model"]
                entry[library].update(
                    peak_mib=run["peak_mib"], peak_rss_mib=run["peak_rss_mib"], tokens_per_s=run["tokens_per_s"],
                    loss=run["losses"][-1], mfu=(flops * run["tokens_per_s"] / length) / (report["matmul_gflops"] * 1e9)
                    if run["tokens_per_s"] else None, measured=True)
            else:
                entry[library].update(measured=False, why=(run or {}).get("error") or (run or {}).get("skipped"))
        lt, tr = entry["leantune"], entry["trl"]
        lt_peak = lt.get("peak_mib") or lt["planned_mib"]
        tr_peak = tr.get("peak_mib") or tr["planned_mib"]
        entry["peak_ratio"] = ratio(lt_peak, tr_peak)
        entry["peak_ratio_predicted"] = not (lt["measured"] and tr["measured"])
        entry["speed_ratio"] = ratio(lt.get("tokens_per_s"), tr.get("tokens_per_s"))
        lt_runs, tr_runs = report["runs"].get(f"leantune:{length}"), report["runs"].get(f"trl:{length}")
        if lt["measured"] and tr["measured"]:
            pairs = list(zip(lt_runs["losses"], tr_runs["losses"]))
            entry["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in pairs)
        rows.append(entry)
    return rows


def render(report: dict) -> str:
    def gib(mib):
        return None if mib is None else f"{mib / 1024:.2f}"

    def cell(side, key, fmt=lambda v: v):
        return fmt(side[key]) if side.get("measured") and side.get(key) is not None else (
            "not run" if key != "planned_mib" else None)

    headers = ["tokens/step", "leantune peak GiB (plan)", "TRL peak GiB (trace)", "peak ratio", "leantune RSS GiB",
               "TRL RSS GiB", "leantune tok/s", "TRL tok/s", "speed ratio", "leantune MFU", "TRL MFU",
               "loss (lt / TRL)", "loss max rel diff"]
    rows = []
    for entry in report["summary"]:
        lt, tr = entry["leantune"], entry["trl"]

        def peak(side):
            planned = gib(side["planned_mib"])
            if planned is None and not side.get("measured"):
                return None
            return f"{gib(side['peak_mib'])} ({planned})" if side.get("measured") else f"predicted {planned}"

        def pct(value):
            return f"{value:.1%}"

        loss = (f"{lt['loss']:.5f} / {tr['loss']:.5f}" if lt.get("measured") and tr.get("measured") else None)
        rows.append([
            f"{entry['length']:,}", peak(lt), peak(tr),
            (f"{entry['peak_ratio']:.3f}" + (" (pred.)" if entry["peak_ratio_predicted"] else ""))
            if entry["peak_ratio"] is not None else None,
            cell(lt, "peak_rss_mib", gib), cell(tr, "peak_rss_mib", gib),
            cell(lt, "tokens_per_s", lambda v: f"{v:.1f}"), cell(tr, "tokens_per_s", lambda v: f"{v:.1f}"),
            f"{entry['speed_ratio']:.2f}" if entry["speed_ratio"] else None,
            cell(lt, "mfu", pct), cell(tr, "mfu", pct), loss,
            f"{entry['loss_max_rel_diff']:.1e}" if "loss_max_rel_diff" in entry else None,
        ])
    lines = [markdown_table(headers, rows), ""]
    for library in LIBRARIES:
        longest = report["longest"].get(library)
        if longest:
            lines.append(f"- longest tokens/step in {report['options']['budget_gib']:g} GiB, {library} (predicted): "
                         f"{longest['length']:,} ({longest['peak_mib'] / 1024:.2f} GiB)")
    for key, run in report["runs"].items():
        library, length = key.split(":")
        planned = report["plans"][library].get(length)
        if run.get("peak_mib") and planned is not None:
            how = "leantune's plan" if library == "leantune" else "the traced TRL step"
            lines.append(f"- {key}: {how} predicted {planned / MIB:,.1f} MiB, measured {run['peak_mib']:,.1f} MiB "
                         f"({planned / MIB / run['peak_mib'] - 1:+.2%})")
        if run.get("skipped") or run.get("error"):
            lines.append(f"- {key}: not run: {run.get('skipped') or run.get('error')}")
    both = report.get("matmul_gflops_start_end")
    lines.append(f"- fp32 matmul peak measured here: {report['matmul_gflops']:.1f} GFLOP/s "
                 + (f"(the better of {both[0]:.1f} at the start and {both[1]:.1f} at the end; " if both else "(")
                 + f"{report['options']['matmul_size']}^2, best of {report['options']['matmul_repeats']}); MFU = model "
                 "FLOPs (6N + causal attention + head, no recompute) per second / that peak")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the full shape at 1k tokens only (~10 minutes)")
    parser.add_argument("--lengths", default=None, help="comma-separated tokens per step (default 1024,...,8192)")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run: the first is the warm-up, "
                        "the rest are timed; the second is metered (default 2)")
    parser.add_argument("--cap-gib", type=float, default=20.0,
                        help="do not run a measurement predicted above this (GiB; default 20): the machine is shared")
    parser.add_argument("--budget-gib", type=float, default=24.0, help="the memory whose longest length is searched")
    parser.add_argument("--no-longest", action="store_true", help="skip the longest-length search")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="leantune steps the optimizer inside the backward; gradient clipping off on both sides")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--matmul-size", type=int, default=3072)
    parser.add_argument("--matmul-repeats", type=int, default=5)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the shared Mistral one)")
    for name, value in QWEN25_05B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                            help=f"model shape (default Qwen2.5-0.5B's {value})")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="print the table of an earlier --out report (one cut short too) and exit")
    parser.add_argument("--in-process", action="store_true",
                        help="measure in this process, not one subprocess a run (tests: no import per run; the RSS "
                        "peak is then the whole process's)")
    parser.add_argument("--child", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--child-length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.steps < 2:
        parser.error("--steps must be at least 2 (the first is the warm-up)")
    lengths = opts.lengths or ",".join(map(str, QUICK_LENGTHS if opts.quick else FULL_LENGTHS))
    try:
        opts.length_list = [int(x) for x in lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: expected comma-separated integers, got {lengths!r}")
    unknown = set(opts.libraries.split(",")) - set(LIBRARIES)
    if unknown:
        parser.error(f"--libraries: unknown {sorted(unknown)}; choose from {list(LIBRARIES)}")
    # what a child needs to rebuild the same model and data
    opts.forwarded = ["--steps", str(opts.steps), "--seed", str(opts.seed), "--lr", str(opts.lr)]
    opts.forwarded += [f"--{name.replace('_', '-')}={getattr(opts, name)}" for name in QWEN25_05B]
    if opts.tokenizer:
        opts.forwarded += ["--tokenizer", opts.tokenizer]
    return opts


def size(num_bytes) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.1f} MiB"


def main(argv=None) -> int:
    opts = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed gradient_checkpointing fields
    if opts.render:
        return print_saved_report(opts.render, summarise, render)
    if opts.child:
        result = measure(opts.child, opts.child_length, opts)
        Path(opts.child_out).write_text(json.dumps(result))
        return 0
    quiet()
    started = time.perf_counter()
    config = model_config(opts)
    tokenizer = load_tokenizer(opts)
    libraries = [lib for lib in LIBRARIES if lib in opts.libraries.split(",")]
    cap, budget = int(opts.cap_gib * GIB), int(opts.budget_gib * GIB)
    print(f"# real shapes: {machine_description()}")
    print(f"# {library_versions('transformers', 'trl', 'torch')}; {source_state()}")
    print(f"# model: Qwen2 hidden {opts.hidden}, {opts.layers} layers, {opts.heads}/{opts.kv_heads} heads, "
          f"intermediate {opts.intermediate}, vocab {opts.vocab:,}, tied, fp32, sdpa, random weights; batch 1, "
          f"lengths {opts.length_list}, {opts.steps} steps (first untimed), gradient checkpointing, AdamW lr {opts.lr}",
          flush=True)
    gflops = matmul_peak_gflops(opts.matmul_size, opts.matmul_repeats)
    print(f"# fp32 matmul peak: {gflops:.1f} GFLOP/s", flush=True)
    planners = {"leantune": plan_leantune, "trl": plan_trl}
    report = {"options": {k: v for k, v in vars(opts).items() if not k.startswith("child") and k != "forwarded"},
              "machine": machine_description(), "source": source_state(),
              "versions": library_versions("transformers", "trl", "torch"), "matmul_gflops": gflops,
              "lengths": opts.length_list, "plans": {lib: {} for lib in LIBRARIES}, "runs": {}, "longest": {},
              "flops": {str(n): model_flops(config, n) for n in opts.length_list}}

    def save():  # after every plan and run: a run cut short keeps what it measured (`--render` shows it)
        report["summary"] = summarise(report)
        if opts.out:
            Path(opts.out).write_text(json.dumps(report, indent=1, default=str))

    for index, length in enumerate(opts.length_list):
        order = libraries if index % 2 == 0 else libraries[::-1]  # who goes first alternates
        for library in LIBRARIES:
            planned_at = time.perf_counter()
            report["plans"][library][str(length)] = peak = planners[library](config, length, opts, tokenizer)
            print(f"{length:>7} {library:9s} predicted peak {size(peak)} "
                  f"({time.perf_counter() - planned_at:.0f} s to plan)", flush=True)
            save()
        for library in order:
            peak = report["plans"][library][str(length)]
            if peak > cap:
                report["runs"][f"{library}:{length}"] = {
                    "library": library, "length": length,
                    "skipped": f"predicted, not run: {peak / GIB:.2f} GiB > --cap-gib {opts.cap_gib:g}"}
                print(f"{length:>7} {library:9s} predicted, not run ({peak / GIB:.2f} GiB > cap)", flush=True)
                continue
            run = report["runs"][f"{library}:{length}"] = (measure(library, length, opts) if opts.in_process
                                                            else measure_in_subprocess(library, length, opts))
            if "error" in run:
                print(f"{length:>7} {library:9s} ERROR {run['error']}", flush=True)
            else:
                print(f"{length:>7} {library:9s} peak {size(run['peak_mib'] * MIB)} (RSS "
                      f"{size(run['peak_rss_mib'] * MIB)})  {run['tokens_per_s']:8.1f} tok/s  losses "
                      f"{[round(x, 6) for x in run['losses']]}  steps {run['step_seconds']} s", flush=True)
            save()
    if not opts.no_longest:
        for library in libraries:
            measured = max(opts.length_list)
            def probe(n, lib=library):
                peak = planners[lib](config, n, opts, tokenizer)
                print(f"  probe {lib} {n:,} tokens: {size(peak)}", flush=True)
                return peak

            known = {int(n): peak for n, peak in report["plans"][library].items()}
            length, peak = longest_fitting(probe, budget, measured, known=known)
            report["longest"][library] = {"length": length, "peak_mib": peak / MIB, "predicted": True}
            print(f"longest in {opts.budget_gib:g} GiB, {library}: {length:,} tokens ({size(peak)}, "
                  "predicted)", flush=True)
            save()
    # the machine is shared: the peak is measured again at the end, and the better of the two is the one used
    report["matmul_gflops_start_end"] = [gflops, matmul_peak_gflops(opts.matmul_size, opts.matmul_repeats)]
    report["matmul_gflops"] = max(report["matmul_gflops_start_end"])
    return finish_report(report, started, save, render)


if __name__ == "__main__":
    sys.exit(main())
