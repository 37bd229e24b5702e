"""leantune vs TRL GRPO, side by side in one process: same model, prompts, reward, order and settings.

    python bench/grpo.py [--steps 4] [--rows baseline,beta,...] [--repeats 1] [--json grpo.json] [--merge old.json]

Model: a small Llama (hidden 256, 4 layers, vocabulary of the Mistral tokenizer in ../shared, 32,000, or Llama 3's
128,256 in the optional `vocab128k` row), fp32, random init from a fixed seed, saved once per run to a folder that
the trainer loads (and loads its reference copy from, when beta > 0 and no PEFT). Prompts: GSM8K questions (plain
text, BOS added by both libraries), in dataset order (`shuffle_dataset=False`), so step i sees the same prompts in
both. Reward: characters of the decoded completion / 100 (cheap, deterministic). Every completion has exactly
`max_completion_length` tokens (`generation_kwargs={"min_new_tokens": max_completion_length}`, which both pass to
`generate` as is), so both libraries generate and score the same number of tokens at every step.

Measured per step (wall and process CPU time): generation (the call that samples: leantune's
`generation.generate`, TRL's `_generate_single_turn`, both wrapped on the trainer instance) and training = the
rest of the optimizer step (decode, reward, reference log-probs, loss forward + backward, optimizer), from the
time between the ends of consecutive steps. Step 1 is a warm-up; step 2 is watched by leantune's memory meter
(`leantune.metrics.memory_breakdown.StepMemoryMeter`, the meter of `MemoryBreakdownCallback`: PyTorch's
MemTracker), cut the same way in both libraries into "score" (after generation until the round's batch is ready:
decode, reward, reference log-probs) and "update" (loss forward, backward, optimizer step); steps 3+ are timed.
Generation itself is not watched (both call the same `model.generate`; the meter would slow it several-fold).
Peak RSS covers the whole `train()` call.

Settings shared by every run: per_device_train_batch_size 8 completions = 2 prompts x num_generations 4, one
generation round per optimizer step, max_completion_length 64 (256 in the `long` row), temperature 1.0,
loss_type "dapo", lr 1e-5, seed 42, gradient checkpointing on (non-reentrant), fp32 (bf16 off), `use_cpu=True`,
no logging or saving. TRL's `use_bias_correction_kl` is off so that both use the plain k3 KL term. leantune-only
levers (`chunked_loss=False`, `padding_free`, `activation_offloading`: TRL 1.16's GRPO has none of them) are
compared with TRL's run of the same shared settings. One torch thread by default (`--threads`), for steadier
timings on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    MIB,
    gsm8k_prompt_completion,
    library_versions,
    load_tokenizer,
    machine_description,
    make_step_timer,
    markdown_table,
    peak_rss_bytes,
    quiet,
    release_memory,
    reset_peak_rss,
    rss_bytes,
    source_state,
    tiny_llama,
)
from bench.sft import lora_config  # noqa: E402
from leantune.data.formats import completion_text  # noqa: E402

BIG_VOCAB = 128_256  # Llama 3's vocabulary: the log-prob head dominates

# name -> (shared settings, leantune-only settings). Rows with leantune-only settings run TRL with the shared ones.
ROWS = {
    "baseline": ({}, {}),
    "beta": ({"beta": 0.04}, {}),
    "no_chunked_loss": ({}, {"chunked_loss": False}),
    "padding_free": ({}, {"padding_free": True}),
    "activation_offloading": ({}, {"activation_offloading": True}),
    "lora": ({"lora": True}, {}),
    "lora_beta": ({"lora": True, "beta": 0.04}, {}),
    "long": ({"max_completion_length": 256}, {}),
    "vocab128k": ({"vocab": BIG_VOCAB}, {}),
}
DEFAULT_ROWS = [name for name in ROWS if name != "vocab128k"]  # vocab128k: generation is slow on CPU
LIBRARIES = ("leantune", "trl")
PARTS = ("parameters", "gradients", "optimizer_states", "activations", "temporaries")
PHASES = ("score", "update")


def saved_policy(opts, tokenizer, output_dir, vocab: int | None = None, intermediate: int = 1024) -> tuple[str, float]:
    """(folder, millions of parameters) of the seeded tiny Llama both libraries load the policy (and, with beta > 0
    and no PEFT, the reference) from; the global seed set again after it is built."""
    from transformers import set_seed

    model = tiny_llama(opts.seed, vocab_size=vocab or len(tokenizer), hidden=opts.hidden, layers=opts.layers,
                       intermediate=intermediate, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    parameters_m = sum(p.numel() for p in model.parameters()) / 1e6
    model_dir = str(Path(output_dir) / "model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    set_seed(opts.seed)
    return model_dir, parameters_m


def grpo_trainer_class(library: str):
    if library == "leantune":
        from leantune import GRPOTrainer
    else:
        from trl import GRPOTrainer
    return GRPOTrainer


def text_length(completions, **kwargs):
    """Reward: characters of the decoded completion / 100 (deterministic, cheap, and different between the
    completions of a group, so every advantage is non-zero)."""
    texts = [completion_text(c) for c in completions]
    return [len(text) / 100 for text in texts]


def gsm8k_prompts(limit: int):
    """The first `limit` GSM8K questions as prompts (the shared loader's rows, without their answers)."""
    return gsm8k_prompt_completion(limit).remove_columns("completion")


def row_settings(name: str, opts) -> tuple[dict, dict]:
    shared, leantune_only = ROWS[name]
    settings = {"beta": 0.0, "lora": False, "vocab": None, "max_completion_length": opts.completion_length}
    settings.update(shared)
    return settings, dict(leantune_only)


def make_config(library: str, settings: dict, extra: dict, opts, output_dir: str):
    length = settings["max_completion_length"]
    generation_kwargs = {"min_new_tokens": length}
    if settings["vocab"]:
        # The tokenizer knows 32,000 ids: the larger head never samples the ids it could not decode.
        generation_kwargs["suppress_tokens"] = list(range(opts.tokenizer_size, settings["vocab"]))
    config = {
        "output_dir": output_dir, "per_device_train_batch_size": opts.batch_size,
        "num_generations": opts.num_generations, "max_completion_length": length, "temperature": 1.0,
        "generation_kwargs": generation_kwargs, "beta": settings["beta"], "loss_type": "dapo",
        "learning_rate": 1e-5, "lr_scheduler_type": "linear", "warmup_steps": 0, "seed": opts.seed,
        "max_steps": opts.steps, "shuffle_dataset": False,
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": False, "fp16": False, "use_cpu": True, "logging_strategy": "no", "save_strategy": "no",
        "eval_strategy": "no", "report_to": [], "disable_tqdm": True,
    }
    if library == "leantune":
        from leantune import GRPOConfig

        config["memory_breakdown"] = False  # the benchmark runs the same meter for both libraries
        config.update(extra)
        return GRPOConfig(**config)
    from trl import GRPOConfig as TRLGRPOConfig

    config["use_bias_correction_kl"] = False  # plain k3 KL, as leantune
    return TRLGRPOConfig(**config)


class PhaseRecorder:
    """Wraps a trainer's round and generation methods (on the instance) and times every call. On the measured step
    the memory meter watches the rest of the round after generation (decode, reward, reference log-probs: "score"),
    then the update (loss forward, backward, optimizer step). Generation itself is not watched: both libraries call
    the same `model.generate`, and the meter would make it several times slower."""

    def __init__(self, trainer, device, measured_step: int):
        from transformers import TrainerCallback

        from leantune.metrics.memory_breakdown import StepMemoryMeter

        self.trainer, self.measured_step = trainer, measured_step
        self.score_meter, self.update_meter = StepMemoryMeter(device), StepMemoryMeter(device)
        self.measuring = False
        self.breakdowns: dict[str, object] = {}
        self.gen_s: dict[int, float] = {}
        self.gen_cpu_s: dict[int, float] = {}
        self.round_s: dict[int, float] = {}
        self.round_cpu_s: dict[int, float] = {}
        self.completion_tokens: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}
        recorder = self

        class StopUpdateMeter(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if recorder.update_meter.running:
                    recorder.breakdowns["update"] = recorder.update_meter.stop(state.global_step)

            def on_train_end(self, args, state, control, **kwargs):
                recorder.update_meter.stop(state.global_step)

        self.callback = StopUpdateMeter()

    def _step(self) -> int:
        return self.trainer.state.global_step

    def wrap_round(self, name: str) -> None:
        original = getattr(self.trainer, name)

        @functools.wraps(original)
        def timed_round(*args, **kwargs):
            step = self._step()
            self.measuring = step == self.measured_step and "score" not in self.breakdowns
            started, cpu_started = time.perf_counter(), time.process_time()
            try:
                result = original(*args, **kwargs)
            finally:
                if self.score_meter.running:
                    self.breakdowns["score"] = self.score_meter.stop(step)
            self.round_s[step] = time.perf_counter() - started
            self.round_cpu_s[step] = time.process_time() - cpu_started
            if self.measuring:
                self.measuring = False
                self.update_meter.start(self.trainer.model, self.trainer.optimizer)
            return result

        setattr(self.trainer, name, timed_round)

    def wrap_generation(self, name: str, prompt_ids_arg: int = 0, owner=None) -> None:
        owner = self.trainer if owner is None else owner  # leantune generates through its GenerationSession
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed_generation(*args, **kwargs):
            started, cpu_started = time.perf_counter(), time.process_time()
            result = original(*args, **kwargs)
            step = self._step()
            self.gen_s[step] = time.perf_counter() - started
            self.gen_cpu_s[step] = time.process_time() - cpu_started
            completions = result[0] if isinstance(result, tuple) else result  # TRL: (completion_ids, logprobs)
            self.completion_tokens[step] = sum(len(ids) for ids in completions)
            self.prompt_tokens[step] = sum(len(ids) for ids in args[prompt_ids_arg])
            if self.measuring:  # the rest of the round: decode, reward, reference (and old) log-probs
                self.score_meter.start(self.trainer.model, self.trainer.optimizer)
            return result

        setattr(owner, name, timed_generation)


def run_one(library: str, name: str, opts, dataset, tokenizer) -> dict:

    result = {"library": library, "row": name}
    release_memory()
    with tempfile.TemporaryDirectory(prefix=f"bench-grpo-{library}-") as output_dir:
        try:
            settings, extra = row_settings(name, opts)
            args = make_config(library, settings, extra, opts, output_dir)
            model_dir, result["parameters_m"] = saved_policy(opts, tokenizer, output_dir, settings["vocab"])
            GRPOTrainer = grpo_trainer_class(library)
            timer = make_step_timer(2)
            trainer = GRPOTrainer(model=model_dir, reward_funcs=text_length, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[timer],
                                  peft_config=lora_config() if settings["lora"] else None)
            recorder = PhaseRecorder(trainer, args.device, measured_step=1)
            trainer.add_callback(recorder.callback)
            if library == "leantune":
                recorder.wrap_round("generation_round")
                recorder.wrap_generation("generate", owner=trainer.generation)
            else:
                recorder.wrap_round("_generate_and_score_completions")
                recorder.wrap_generation("_generate_single_turn")
            release_memory()
            rss_before = rss_bytes()
            reset_peak_rss()
            started = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):  # the trainers' own log lines
                output = trainer.train()
            result["train_s"] = round(time.perf_counter() - started, 2)
            result["peak_rss_mib"] = peak_rss_bytes() / MIB
            result["rss_before_mib"] = rss_before / MIB
        except Exception as error:  # noqa: BLE001 - one configuration that cannot run must not hide the others
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            if opts.verbose:
                traceback.print_exc()
            return result
        steps = len(timer.step_ends)
        step_s = timer.step_seconds()
        cpu_ends = [timer.cpu_train_begin] + timer.cpu_step_ends
        step_cpu_s = [b - a for a, b in zip(cpu_ends[:-1], cpu_ends[1:])]
        timed = range(2, steps)  # step 0: warm-up; step 1: watched by the memory meter
        per_step = []
        for i in timed:
            gen, rnd = recorder.gen_s.get(i), recorder.round_s.get(i)
            per_step.append({
                "step_s": step_s[i], "step_cpu_s": step_cpu_s[i], "gen_s": gen, "gen_cpu_s": recorder.gen_cpu_s.get(i),
                "score_s": rnd - gen, "update_s": step_s[i] - rnd, "train_s": step_s[i] - gen,
                "train_cpu_s": step_cpu_s[i] - recorder.gen_cpu_s[i],
                "prompt_tokens": recorder.prompt_tokens[i], "completion_tokens": recorder.completion_tokens[i],
            })
        result.update(
            steps=steps,
            per_step=per_step,
            medians={key: statistics.median(s[key] for s in per_step) for key in per_step[0]},
            memory={phase: {"peak_mib": b.peak_bytes / MIB,
                            "parts_mib": {p: b.parts.get(p, 0) / MIB for p in PARTS}}
                    for phase, b in recorder.breakdowns.items() if b is not None},
            final_loss=output.training_loss,
            prompt_tokens=[recorder.prompt_tokens[i] for i in sorted(recorder.prompt_tokens)],
            completion_tokens=[recorder.completion_tokens[i] for i in sorted(recorder.completion_tokens)],
        )
        del trainer
    release_memory()
    return result


def trl_key(name: str, opts) -> str:
    """Rows whose TRL settings are the same share one TRL run (leantune-only levers have no TRL counterpart)."""
    settings, _ = row_settings(name, opts)
    return json.dumps(settings, sort_keys=True)


def ratio(a, b):
    return a / b if a is not None and b else None


def summarise(results: list[dict], opts) -> dict:
    """(row, library) -> medians over the repeats of every run's per-step medians, and the memory (exact, so the
    first run's)."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        grouped.setdefault((r["row"], r["library"]), []).append(r)
    out = {}
    for key, runs in grouped.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            out[key] = {"error": runs[0]["error"]}
            continue
        medians = {m: statistics.median(r["medians"][m] for r in ok) for m in ok[0]["medians"]}
        spread = {m: (min(r["medians"][m] for r in ok), max(r["medians"][m] for r in ok)) for m in ok[0]["medians"]}
        out[key] = {"runs": len(ok), "medians": medians, "spread": spread, "memory": ok[0]["memory"],
                    "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in ok),
                    "rss_train_mib": statistics.median(r["peak_rss_mib"] - r["rss_before_mib"] for r in ok),
                    "final_loss": ok[0]["final_loss"], "parameters_m": ok[0]["parameters_m"]}
    return out


def trl_for(name: str, summary: dict, opts, names: list[str]):
    """TRL's numbers for a row: its own run, else the run of a row with the same TRL settings (and that row)."""
    if (name, "trl") in summary:
        return summary[(name, "trl")], None
    key = trl_key(name, opts)
    for other in names:
        if other != name and (other, "trl") in summary and trl_key(other, opts) == key:
            return summary[(other, "trl")], other
    return {}, None


def render(results: list[dict], opts) -> str:
    summary = summarise(results, opts)
    names = list(dict.fromkeys(r["row"] for r in results))
    time_rows, memory_rows, notes = [], [], []
    for name in names:
        lt = summary.get((name, "leantune"), {})
        tr, borrowed = trl_for(name, summary, opts, names)
        label = name + (f" (TRL: {borrowed})" if borrowed else "")

        def med(d, key):
            return d["medians"][key] if d and "error" not in d else None

        def mem(d, phase):
            return d["memory"][phase]["peak_mib"] if d and "error" not in d and phase in d["memory"] else None

        def parts(d, phase):
            if not d or "error" in d or phase not in d["memory"]:
                return None
            return "/".join(f"{d['memory'][phase]['parts_mib'][p]:.0f}" for p in PARTS)

        def rss(d):
            return d["rss_train_mib"] if d and "error" not in d else None

        time_rows.append([label, med(lt, "gen_s"), med(tr, "gen_s"), ratio(med(lt, "gen_s"), med(tr, "gen_s")),
                          med(lt, "train_s"), med(tr, "train_s"), ratio(med(lt, "train_s"), med(tr, "train_s")),
                          med(lt, "step_s"), med(tr, "step_s"), ratio(med(lt, "step_s"), med(tr, "step_s")),
                          ratio(med(lt, "gen_cpu_s"), med(tr, "gen_cpu_s")),
                          ratio(med(lt, "train_cpu_s"), med(tr, "train_cpu_s"))])
        memory_rows.append([label, mem(lt, "update"), mem(tr, "update"), ratio(mem(lt, "update"), mem(tr, "update")),
                            mem(lt, "score"), mem(tr, "score"), ratio(mem(lt, "score"), mem(tr, "score")),
                            rss(lt), rss(tr), ratio(rss(lt), rss(tr)), parts(lt, "update"), parts(tr, "update")])
        for library, d in (("leantune", lt), ("TRL", tr)):
            if d and "error" in d:
                notes.append(f"- {name} / {library}: did not run: {d['error']}")
    time_headers = ["row", "gen s lt", "gen s TRL", "gen ratio", "train s lt", "train s TRL", "train ratio",
                    "step s lt", "step s TRL", "step ratio", "gen CPU ratio", "train CPU ratio"]
    memory_headers = ["row", "update peak MiB lt", "TRL", "ratio", "score peak MiB lt", "TRL", "ratio",
                      "RSS +train MiB lt", "TRL", "ratio", "update parts lt P/G/O/A/T", "TRL P/G/O/A/T"]
    text = markdown_table(time_headers, time_rows) + "\n\n" + markdown_table(memory_headers, memory_rows)
    return text + ("\n\n" + "\n".join(notes) if notes else "")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (>= 3; default 4: step 1 "
                        "warm-up, step 2 memory, steps 3-4 timed)")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated subset of {list(ROWS)}")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--repeats", type=int, default=1, help="runs of every (row, library), medians reported")
    parser.add_argument("--rerun-trl", action="store_true",
                        help="run TRL for every row, also where its settings equal an earlier row's")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per optimizer step")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64, help="GSM8K questions to use, in order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="write every run's measurements here")
    parser.add_argument("--merge", action="append", default=[],
                        help="a --json file of an earlier run: its runs are added to this run's (repeatable)")
    parser.add_argument("--verbose", action="store_true")
    opts = parser.parse_args(argv)
    unknown = [r for r in opts.rows.split(",") if r and r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if opts.steps < 3:
        parser.error("--steps must be at least 3 (step 1 warms up, step 2 is measured, steps 3+ are timed)")
    if opts.batch_size % opts.num_generations:
        parser.error("--batch-size must be a multiple of --num-generations")
    return opts


def main(argv=None) -> int:
    import torch

    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    quiet()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' gradient_checkpointing renames
    tokenizer = load_tokenizer()
    opts.tokenizer_size = len(tokenizer)
    dataset = gsm8k_prompts(opts.prompts)
    libraries = [lib for lib in LIBRARIES if lib in opts.libraries.split(",")]
    names = [r for r in opts.rows.split(",") if r]
    print(f"# GRPO benchmark: {machine_description()}")
    print(f"# {library_versions('torch', 'transformers', 'trl', 'peft', 'accelerate')}; {source_state()}")
    print(f"# model: Llama hidden {opts.hidden}, {opts.layers} layers, vocab {len(tokenizer)} (or {BIG_VOCAB:,}), "
          f"fp32; {len(dataset)} GSM8K questions in order; {opts.batch_size} completions/step = "
          f"{opts.batch_size // opts.num_generations} prompts x {opts.num_generations}; completions of exactly "
          f"{opts.completion_length} tokens unless the row says otherwise; {opts.steps} steps; "
          f"{opts.repeats} repeat(s)", flush=True)
    results, trl_done = [], set()
    for repeat in range(opts.repeats):
        trl_done.clear()
        for index, name in enumerate(names):
            order = libraries if (index + repeat) % 2 == 0 else libraries[::-1]
            for library in order:
                if library == "trl" and not opts.rerun_trl and trl_key(name, opts) in trl_done:
                    continue
                result = run_one(library, name, opts, dataset, tokenizer)
                result["repeat"] = repeat
                results.append(result)
                if library == "trl":
                    trl_done.add(trl_key(name, opts))
                if "error" in result:
                    print(f"{name:22s} {library:9s} ERROR {result['error']}", flush=True)
                    continue
                m, memory = result["medians"], result["memory"]
                print(f"{name:22s} {library:9s} step {m['step_s']:6.2f} s (gen {m['gen_s']:5.2f} [CPU {m['gen_cpu_s']:5.2f}], score "
                      f"{m['score_s']:5.2f}, update {m['update_s']:5.2f}; train CPU {m['train_cpu_s']:5.2f})  update peak "
                      f"{memory.get('update', {}).get('peak_mib', float('nan')):7.1f} MiB, score peak "
                      f"{memory.get('score', {}).get('peak_mib', float('nan')):7.1f} MiB, RSS +train "
                      f"{result['peak_rss_mib'] - result['rss_before_mib']:7.1f} MiB; tokens/step prompt "
                      f"{result['per_step'][0]['prompt_tokens']} completion {result['per_step'][0]['completion_tokens']}"
                      "", flush=True)
    for path in opts.merge:
        results = json.loads(Path(path).read_text())["runs"] + results
    print()
    print(render(results, opts))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "machine": machine_description(),
                                               "versions": library_versions("torch", "transformers", "trl", "peft"),
                                               "source": source_state(), "runs": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
