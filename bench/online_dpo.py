"""leantune vs TRL Online DPO, side by side in one process: same model, prompts, reward, order and settings.

    python bench/online_dpo.py [--steps 4] [--rows baseline,lora,...] [--repeats 1] [--json online_dpo.json]

TRL's trainer is `trl.experimental.online_dpo.OnlineDPOTrainer` (TRL 1.16). Model: a small Llama (hidden 256, 4
layers, the 32,000-token vocabulary of the Mistral tokenizer in ../shared), fp32, random init from a fixed seed, saved
once per run to a folder both trainers load (the frozen reference is a copy of it; with LoRA, the adapter disabled).
Prompts: GSM8K questions in dataset order (leantune `shuffle_dataset=False`, TRL `train_sampling_strategy=
"sequential"`), so step i sees the same prompts in both. Reward: characters of the decoded completion / 100. Every
completion has exactly `max_new_tokens` tokens (`generation_kwargs={"min_new_tokens": ...}`, passed to `generate`
by both), so both generate and score the same number of completion tokens. TRL tokenises a plain-text prompt
without special tokens, leantune with them (the BOS): leantune's prompts are one token longer.

Measured per step: wall time of the optimizer step (between the ends of consecutive steps) and of generation (the
call that samples: leantune's `generation.generate`, TRL's `_generate`, wrapped on the trainer instance);
"train" = step - generation (decode, reward, reference and policy log-probs, loss, backward, optimizer). Step 1 is a
warm-up; step 2 is watched whole by leantune's memory meter (`StepMemoryMeter`: PyTorch's MemTracker), generation
included: TRL generates inside `training_step`, leantune in its generation round before it, so the meter starts
at the round in leantune and at the step's start in TRL; steps 3+ are timed. Peak RSS covers the whole `train()`.

Settings shared by every run: 4 prompts per step (per_device_train_batch_size, TRL's meaning) x 2 completions, 64 new
tokens, temperature 0.9, beta 0.1, loss sigmoid, lr 1e-6, seed 42, gradient checkpointing on (non-reentrant: note that
TRL then generates without the KV cache, `use_cache=False`, a choice of its trainer), fp32, `use_cpu=True`, no
logging or saving. leantune-only levers (`padding_free`, `chunked_loss=False`) run TRL with the shared settings; the
`no_checkpointing` row turns gradient checkpointing off in both (TRL's generation then uses the KV cache).
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

# name -> (shared settings, leantune-only settings). Rows with leantune-only settings run TRL with the shared ones.
ROWS = {
    "baseline": ({}, {}),
    "lora": ({"lora": True}, {}),
    "padding_free": ({}, {"padding_free": True}),
    "no_chunked_loss": ({}, {"chunked_loss": False}),
    # gradient checkpointing off in both: TRL's generate then uses the KV cache, as leantune's always does
    "no_checkpointing": ({"gradient_checkpointing": False}, {}),
}
LIBRARIES = ("leantune", "trl")
PARTS = ("parameters", "gradients", "optimizer_states", "activations", "temporaries")


def text_length(completions, **kwargs):
    """Reward: characters of the decoded completion / 100 (cheap, deterministic, rarely a tie)."""
    return [len(completion_text(c)) / 100 for c in completions]


def make_config(library: str, settings: dict, extra: dict, opts, output_dir: str):
    config = {
        "output_dir": output_dir, "per_device_train_batch_size": opts.prompts_per_step,
        "max_new_tokens": opts.new_tokens, "temperature": 0.9,
        "generation_kwargs": {"min_new_tokens": opts.new_tokens}, "beta": 0.1, "loss_type": "sigmoid",
        "learning_rate": 1e-6, "lr_scheduler_type": "linear", "warmup_steps": 0, "seed": opts.seed,
        "max_steps": opts.steps, "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False}, "bf16": False, "fp16": False, "use_cpu": True,
        "logging_strategy": "no", "save_strategy": "no", "eval_strategy": "no", "report_to": [], "disable_tqdm": True,
    }
    config.update({key: value for key, value in settings.items() if key != "lora"})
    if library == "leantune":
        from leantune import OnlineDPOConfig

        config.update(memory_breakdown=False, shuffle_dataset=False, **extra)
        return OnlineDPOConfig(**config)
    from trl.experimental.online_dpo import OnlineDPOConfig as TRLOnlineDPOConfig

    return TRLOnlineDPOConfig(train_sampling_strategy="sequential", **config)


class StepRecorder:
    """Times every generation call, and watches the whole of step `measured_step` with the memory meter."""

    def __init__(self, trainer, device, measured_step: int):
        from transformers import TrainerCallback

        from leantune.metrics.memory_breakdown import StepMemoryMeter

        self.trainer, self.measured_step = trainer, measured_step
        self.meter = StepMemoryMeter(device)
        self.breakdown = None
        self.gen_s: dict[int, float] = {}
        self.completion_tokens: dict[int, int] = {}
        recorder = self

        class Watch(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):  # TRL: generation is inside the step
                if state.global_step == measured_step and not recorder.meter.running and recorder.breakdown is None:
                    recorder.meter.start(trainer.model, trainer.optimizer)

            def on_step_end(self, args, state, control, **kwargs):
                if recorder.meter.running:
                    recorder.breakdown = recorder.meter.stop(state.global_step)

        self.callback = Watch()

    def start_at_round(self, name: str) -> None:
        """leantune: the round (generation, rewards, reference log-probs) runs before the Trainer's step begins."""
        original = getattr(self.trainer, name)

        @functools.wraps(original)
        def watched(*args, **kwargs):
            if self.trainer.state.global_step == self.measured_step and self.breakdown is None:
                self.meter.start(self.trainer.model, self.trainer.optimizer)
            return original(*args, **kwargs)

        setattr(self.trainer, name, watched)

    def time_generation(self, name: str, completions_of, owner=None) -> None:
        owner = self.trainer if owner is None else owner  # leantune generates through its GenerationSession
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = original(*args, **kwargs)
            step = self.trainer.state.global_step
            self.gen_s[step] = self.gen_s.get(step, 0.0) + time.perf_counter() - started
            self.completion_tokens[step] = completions_of(result)
            return result

        setattr(owner, name, timed)


def run_one(library: str, name: str, opts, dataset, tokenizer) -> dict:
    from transformers import set_seed

    result = {"library": library, "row": name}
    release_memory()
    shared, extra = ROWS[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-online-dpo-{library}-") as output_dir:
        try:
            args = make_config(library, shared, extra, opts, output_dir)
            model = tiny_llama(opts.seed, vocab_size=len(tokenizer), hidden=opts.hidden, layers=opts.layers,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)
            model_dir = str(Path(output_dir) / "model")
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            del model
            set_seed(opts.seed)
            timer = make_step_timer(2)
            peft_config = lora_config() if shared.get("lora") else None
            if library == "leantune":
                from leantune import OnlineDPOTrainer
            else:
                from trl.experimental.online_dpo import OnlineDPOTrainer
            trainer = OnlineDPOTrainer(model=model_dir, reward_funcs=text_length, args=args, train_dataset=dataset,
                                       processing_class=tokenizer, callbacks=[timer], peft_config=peft_config)
            recorder = StepRecorder(trainer, args.device, measured_step=1)
            trainer.add_callback(recorder.callback)
            if library == "leantune":
                recorder.start_at_round("generation_round")
                recorder.time_generation("generate", lambda out: sum(len(ids) for ids in out), owner=trainer.generation)
            else:
                recorder.time_generation("_generate", lambda out: int(out[3].sum()))  # completion_mask
            release_memory()
            rss_before = rss_bytes()
            reset_peak_rss()
            started = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                output = trainer.train()
            result["train_call_s"] = round(time.perf_counter() - started, 2)
            result["peak_rss_mib"] = peak_rss_bytes() / MIB
            result["rss_before_mib"] = rss_before / MIB
        except Exception as error:  # noqa: BLE001 - one configuration that cannot run must not hide the others
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            if opts.verbose:
                traceback.print_exc()
            return result
        step_s = timer.step_seconds()
        per_step = [{"step_s": step_s[i], "gen_s": recorder.gen_s[i], "train_s": step_s[i] - recorder.gen_s[i],
                     "completion_tokens": recorder.completion_tokens[i]} for i in range(2, len(step_s))]
        breakdown = recorder.breakdown
        result.update(
            per_step=per_step,
            medians={key: statistics.median(s[key] for s in per_step) for key in per_step[0]},
            step_peak_mib=breakdown.peak_bytes / MIB if breakdown else None,
            parts_mib={p: breakdown.parts.get(p, 0) / MIB for p in PARTS} if breakdown else {},
            final_loss=output.training_loss,
        )
        del trainer
    release_memory()
    return result


def render(results: list[dict]) -> str:
    grouped: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        grouped.setdefault((r["row"], r["library"]), []).append(r)

    def summary(name, library):
        runs = [r for r in grouped.get((name, library), []) if "error" not in r]
        if not runs:
            return None
        return {"medians": {k: statistics.median(r["medians"][k] for r in runs) for k in runs[0]["medians"]},
                "peak": runs[0]["step_peak_mib"], "parts": runs[0]["parts_mib"],
                "rss": statistics.median(r["peak_rss_mib"] - r["rss_before_mib"] for r in runs)}

    def ratio(a, b):
        return a / b if a is not None and b else None

    names = list(dict.fromkeys(r["row"] for r in results))
    time_rows, memory_rows, notes = [], [], []
    for name in names:
        lt = summary(name, "leantune")
        borrowed = name if (name, "trl") in grouped else next(
            (other for other in names if (other, "trl") in grouped and ROWS[other][0] == ROWS[name][0]), None)
        tr = summary(borrowed, "trl") if borrowed else None
        label = name + (f" (TRL: {borrowed})" if borrowed and borrowed != name else "")

        def med(d, key):
            return d["medians"][key] if d else None

        time_rows.append([label, med(lt, "gen_s"), med(tr, "gen_s"), ratio(med(lt, "gen_s"), med(tr, "gen_s")),
                          med(lt, "train_s"), med(tr, "train_s"), ratio(med(lt, "train_s"), med(tr, "train_s")),
                          med(lt, "step_s"), med(tr, "step_s"), ratio(med(lt, "step_s"), med(tr, "step_s"))])
        peak = (lt or {}).get("peak"), (tr or {}).get("peak")
        rss = (lt or {}).get("rss"), (tr or {}).get("rss")
        parts = ["/".join(f"{d['parts'][p]:.0f}" for p in PARTS) if d and d["parts"] else None for d in (lt, tr)]
        memory_rows.append([label, peak[0], peak[1], ratio(*peak), rss[0], rss[1], ratio(*rss), *parts])
        for library in LIBRARIES:
            for r in grouped.get((name, library), []):
                if "error" in r:
                    notes.append(f"- {name} / {library}: did not run: {r['error']}")
    text = markdown_table(["row", "gen s lt", "gen s TRL", "gen ratio", "train s lt", "train s TRL", "train ratio",
                           "step s lt", "step s TRL", "step ratio"], time_rows)
    text += "\n\n" + markdown_table(["row", "step peak MiB lt", "TRL", "ratio", "RSS +train MiB lt", "TRL", "ratio",
                                     "step parts lt P/G/O/A/T", "TRL P/G/O/A/T"], memory_rows)
    return text + ("\n\n" + "\n".join(notes) if notes else "")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (>= 3)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {list(ROWS)}")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--repeats", type=int, default=1, help="runs of every (row, library); medians reported")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--prompts-per-step", type=int, default=4, help="pairs per optimizer step")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64, help="GSM8K questions to use, in order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="write every run's measurements here")
    parser.add_argument("--verbose", action="store_true")
    opts = parser.parse_args(argv)
    unknown = [r for r in opts.rows.split(",") if r and r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if opts.steps < 3:
        parser.error("--steps must be at least 3 (step 1 warms up, step 2 is measured, steps 3+ are timed)")
    return opts


def main(argv=None) -> int:
    import torch

    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    quiet()
    warnings.filterwarnings("ignore")  # TRL's experimental-API and transformers' renaming warnings
    tokenizer = load_tokenizer()
    dataset = gsm8k_prompt_completion(opts.prompts).remove_columns("completion")
    libraries = [lib for lib in LIBRARIES if lib in opts.libraries.split(",")]
    names = [r for r in opts.rows.split(",") if r]
    print(f"# Online DPO benchmark: {machine_description()}")
    print(f"# {library_versions('torch', 'transformers', 'trl', 'peft', 'accelerate')}; {source_state()}")
    print(f"# model: Llama hidden {opts.hidden}, {opts.layers} layers, vocab {len(tokenizer)}, fp32; {len(dataset)} "
          f"GSM8K questions in order; {opts.prompts_per_step} prompts x 2 completions of exactly {opts.new_tokens} "
          f"tokens per step; {opts.steps} steps; {opts.repeats} repeat(s)", flush=True)
    results, trl_done = [], set()
    for repeat in range(opts.repeats):
        trl_done.clear()
        for index, name in enumerate(names):
            order = libraries if (index + repeat) % 2 == 0 else libraries[::-1]
            for library in order:
                key = json.dumps(ROWS[name][0], sort_keys=True)
                if library == "trl" and key in trl_done:
                    continue  # TRL's settings of this row equal an earlier row's
                result = run_one(library, name, opts, dataset, tokenizer)
                results.append(result)
                if library == "trl":
                    trl_done.add(key)
                if "error" in result:
                    print(f"{name:16s} {library:9s} ERROR {result['error']}", flush=True)
                    continue
                m = result["medians"]
                print(f"{name:16s} {library:9s} step {m['step_s']:6.2f} s (gen {m['gen_s']:5.2f}, train "
                      f"{m['train_s']:5.2f}); step peak {result['step_peak_mib'] or float('nan'):7.1f} MiB; RSS +train "
                      f"{result['peak_rss_mib'] - result['rss_before_mib']:7.1f} MiB; completion tokens/step "
                      f"{m['completion_tokens']:.0f}; loss {result['final_loss']:.4f}", flush=True)
    print()
    print(render(results))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "machine": machine_description(),
                                               "versions": library_versions("torch", "transformers", "trl", "peft"),
                                               "source": source_state(), "runs": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
