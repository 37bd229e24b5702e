"""Follow-up measurements for what the kit's second H100 run showed (docs/benchmarks.md, 2026-11-28): one call.

    run(command="bash bench/gpu/run.sh --diagnose", carry=["bench/gpu/wheels"], timeout_s=420)
    bash bench/gpu/run.sh --diagnose --dry       # the same code at tiny size on CPU (CUDA-only parts skipped)

0. `shared_prompt`: `shared_prompt=True`'s speed on a GPU (exact and measured on CPU only). GRPO's update step per
   layout (unshared padded / padding-free / shared / TRL), Qwen2.5-1.5B bf16, checkpointing on, 1024:256:16 and
   64:256:16 (prompt:completion:G): warm time, peak, activations, shared's ratios, gradient norms agreeing.
1. `liger_profile`: leantune's Liger row trained at 0.66x TRL's tokens/s (its padded row 0.92x). One warm step of
   each library, Liger and padded, under torch.profiler: the top kernels by device time and the launch count.
2. `grpo_split`: leantune's GRPO steps took 2.7-10.2 s against TRL's 2.6-3.4 s. Each step's time split into
   `generate` (timed around the model's own generate, synchronised) and the rest; leantune twice: its default on
   CUDA (transformers' static cache, the decode step compiled by transformers) and `cache_implementation="dynamic"`
   (the dynamic cache, not compiled), to choose the default by measurement.
3. `long_context`: Llama-3.1-8B QLoRA at 65,536 tokens used 67.9 GiB in leantune, where the planner's line through
   4k and 8k gives ~49. Both libraries' peaks at that length, and for each the live allocations at the peak grouped
   by the first frame outside torch (CUDA's allocator history, replayed here), then one longer probe each.
Results: $OUT/diagnose.json, rewritten after each part. Nothing here is imported by the library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gpu.harness import (  # noqa: E402
    GIB,
    Settings,
    build_model,
    dataset,
    free_memory,
    is_oom,
    load_4bit,
    log,
    lora_config,
    prompt_rows,
    quantized_checkpoint,
    random_text,
    text_rows,
    tokenizer,
)
from bench.gpu.rows import config_class, length_reward, library_fields, liger_patches_undone, unload_adapter  # noqa: E402,E501

LIBRARIES = ("leantune", "trl")


def fields_for(settings: Settings, out: str, **extra) -> dict:
    return {**settings.common_fields(out), **extra}


class StepClock:
    """A TrainerCallback: each step's wall seconds (synchronised), and a profiler around one chosen step."""

    def __init__(self, settings: Settings, profile_step: int | None):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.sync()
                clock.began = time.perf_counter()
                if profile_step is not None and state.global_step == profile_step:
                    clock.start_profile()

            def on_step_end(self, args, state, control, **kwargs):
                clock.sync()
                if clock.profiler is not None:
                    clock.stop_profile()
                now = time.perf_counter()
                clock.steps.append(round(now - clock.began, 3))
                if clock.ended is not None:  # end to end, as the kit times steps: includes what runs between them
                    clock.between_ends.append(round(now - clock.ended, 3))
                clock.ended = now

        self.settings, self.callback, self.steps, self.profiler, self.top = settings, Callback(), [], None, None
        self.began, self.ended, self.between_ends = 0.0, None, []

    def sync(self):
        import torch

        if not self.settings.dry:
            torch.cuda.synchronize()

    def start_profile(self):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([] if self.settings.dry else [ProfilerActivity.CUDA])
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()

    def stop_profile(self):
        self.profiler.__exit__(None, None, None)
        events = self.profiler.key_averages()
        device = not self.settings.dry
        key = (lambda e: e.self_device_time_total) if device else (lambda e: e.self_cpu_time_total)
        ranked = sorted(events, key=key, reverse=True)
        total = sum(key(e) for e in events)
        self.top = {"total_ms": round(total / 1e3, 1), "kernels": [
            {"name": e.key[:90], "ms": round(key(e) / 1e3, 2), "calls": e.count} for e in ranked[:18]],
            "launches": sum(e.count for e in events if device and e.self_device_time_total > 0)}
        self.profiler = None


def liger_profile(settings: Settings, tok, scratch: Path, report: dict) -> None:
    length, batch = settings.seq_len("qwen2.5-1.5b"), settings.batch("qwen2.5-1.5b")
    rows = text_rows(3 * batch, length)
    for variant in ("liger", "padded"):
        for library in LIBRARIES:
            extra = {"use_liger_kernel": True} if variant == "liger" else {}
            if settings.dry and library == "trl":
                extra = {}  # TRL's Liger patching is CUDA-only (see rows.TRL_CUDA_ONLY)
            guard = liger_patches_undone(settings.dry) if variant == "liger" else nullcontext()
            with guard:
                model = build_model(settings, "qwen2.5-1.5b", tok)
                config_cls, trainer_cls = config_class(library, "SFT")
                args = config_cls(**library_fields(library, fields_for(
                    settings, str(scratch / f"{variant}-{library}"), max_length=length, max_steps=3,
                    per_device_train_batch_size=batch, shuffle_dataset=False, **extra)))
                trainer = trainer_cls(model=model, args=args, train_dataset=dataset(rows), processing_class=tok)
                clock = StepClock(settings, profile_step=2)
                trainer.add_callback(clock.callback)
                trainer.train()
                report[f"{variant}/{library}"] = {"step_seconds": clock.steps, "between_step_ends": clock.between_ends,
                                                  "profiled_step": clock.top}
                log(settings, f"liger_profile {variant}/{library}: steps {clock.steps}, device "
                              f"{clock.top['total_ms'] if clock.top else '?'} ms")
                del model, trainer
                free_memory()


def grpo_split(settings: Settings, tok, scratch: Path, report: dict) -> None:
    from bench.gpu.shapes import model_config

    batch = settings.batch("qwen2.5-1.5b")
    completion = 8 if settings.dry else 64
    vocab = model_config("qwen2.5-1.5b", tok, settings.dry).vocab_size
    for variant, library, own in (("leantune", "leantune", {}),
                                  ("leantune/dynamic_cache", "leantune", {"cache_implementation": "dynamic"}),
                                  ("trl", "trl", {})):
        model = build_model(settings, "qwen2.5-1.5b", tok)
        generate, spent, clock = model.generate, [], StepClock(settings, profile_step=None)

        def timed_generate(*args, _generate=generate, _clock=clock, _spent=spent, **kwargs):
            _clock.sync()
            began = time.perf_counter()
            out = _generate(*args, **kwargs)
            _clock.sync()
            _spent.append(round(time.perf_counter() - began, 3))
            return out

        model.generate = timed_generate
        config_cls, trainer_cls = config_class(library, "GRPO")
        args = config_cls(**library_fields(library, fields_for(
            settings, str(scratch / f"grpo-{library}"), max_steps=4, per_device_train_batch_size=batch,
            num_generations=batch, max_completion_length=completion, temperature=1.0, beta=0.0, loss_type="dapo",
            shuffle_dataset=False, generation_kwargs={"min_new_tokens": completion,
                                                      "suppress_tokens": list(range(len(tok), vocab))}), own))
        trainer = trainer_cls(model=model, args=args, processing_class=tok, reward_funcs=length_reward,
                              train_dataset=dataset(prompt_rows(4 * batch, 32 if settings.dry else 128)))
        trainer.add_callback(clock.callback)
        trainer.train()
        report[variant] = {"step_seconds": clock.steps, "between_step_ends": clock.between_ends,
                           "generate_seconds": spent,
                           "generate_calls": len(spent)}
        log(settings, f"grpo_split {variant}: steps {clock.steps}, generate {spent}")
        del model, trainer
        free_memory()


def live_at_peak(snapshot: dict) -> dict:
    """Replays CUDA's allocator trace: the peak of the bytes allocated during the recording, and the blocks live
    then, grouped by the innermost frame outside torch's own files (where the tensor was made)."""
    trace = [e for e in snapshot.get("device_traces", [[]])[0] if e.get("action") in ("alloc", "free_completed")]
    live, total, peak, peak_at = {}, 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
        elif event["addr"] in live:
            total -= live.pop(event["addr"])
        if total > peak:
            peak, peak_at = total, index
    live, sites = {}, {}
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    for event in live.values():
        frames = event.get("frames") or []
        site = next((f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in frames
                     if "/torch/" not in f["filename"] and f["filename"] not in ("??", "")), "?")
        count, size = sites.get(site, (0, 0))
        sites[site] = (count + 1, size + event["size"])
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][1])[:15]
    return {"recorded_peak_gib": round(peak / GIB, 2), "events": len(trace),
            "sites": [{"site": s, "blocks": c, "gib": round(b / GIB, 3)} for s, (c, b) in ranked]}


def long_context(settings: Settings, tok, scratch: Path, report: dict, lengths: list[int], deadline: float,
                 save=lambda: None) -> None:
    import torch

    model = load_4bit(settings, quantized_checkpoint(settings, "llama-3.1-8b", tok, scratch / "llama-3.1-8b"))
    for number, length in enumerate(lengths):
        for library in LIBRARIES:
            if time.monotonic() > deadline:
                report.setdefault("skipped", []).append(f"{library} at {length}: out of time")
                continue
            config_cls, trainer_cls = config_class(library, "SFT")
            args = config_cls(**library_fields(library, fields_for(
                settings, str(scratch / f"long-{library}"), max_length=length, max_steps=1,
                per_device_train_batch_size=1)))
            trainer = trainer_cls(model=model, args=args, processing_class=tok, peft_config=lora_config(),
                                  train_dataset=dataset([{"text": random_text(__import__("random").Random(length),
                                                                              length - 4)}]))
            record = number == 0 and not settings.dry
            entry = {"max_length": length}
            began = time.perf_counter()
            try:
                if not settings.dry:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    entry["before_gib"] = round(torch.cuda.memory_allocated() / GIB, 2)
                if record:
                    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
                trainer.train()
                entry["fits"] = True
            except Exception as error:  # noqa: BLE001
                if not is_oom(error):
                    entry["error"] = repr(error)[:300]
                entry["fits"] = False
            finally:
                if not settings.dry:
                    torch.cuda.synchronize()
                    entry["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
                if record:
                    try:
                        entry["at_peak"] = live_at_peak(torch.cuda.memory._snapshot())
                    except Exception as error:  # noqa: BLE001
                        entry["at_peak"] = {"error": repr(error)[:300]}
                    torch.cuda.memory._record_memory_history(enabled=None)
                unload_adapter(trainer)
                del trainer
                free_memory()
            entry["seconds"] = round(time.perf_counter() - began, 1)
            report.setdefault(library, []).append(entry)
            save()  # a long probe may outlast the call: what was measured comes back
            log(settings, f"long_context {library} {length}: {entry.get('fits')} "
                          f"{entry.get('max_allocated_gib')} GiB in {entry['seconds']} s")
    del model
    free_memory()


def shared_prompt(settings: Settings, tok, report: dict, budget_s: float = 90.0) -> None:
    """GRPO's update step per layout (bench/shared_prompt.py's `measure`, on CUDA in bf16, checkpointing on):
    Qwen2.5-1.5B's shape at prompt:completion:G rows, each layout on fresh weights of seed 0."""
    import importlib.util

    from bench.shared_prompt import MODES, TRL, gsm8k_tokens, measure


    rows = ["24:16:4", "8:16:4"] if settings.dry else ["1024:256:16", "64:256:16", "256:256:16"]
    modes = [m for m in MODES if m != TRL or importlib.util.find_spec("trl") is not None]
    deadline = time.monotonic() + budget_s
    for spec in rows:
        prompt_length, completion_length, group = (int(v) for v in spec.split(":"))
        prompt, completions = gsm8k_tokens(tok, prompt_length, completion_length, group)
        measured = report.setdefault(spec, {})
        for mode in modes:
            if time.monotonic() > deadline:
                report.setdefault("skipped", []).append(f"{spec} {mode}: out of time")
                continue
            try:
                model = build_model(settings, "qwen2.5-1.5b", tok)
                measured[mode] = measure(mode, prompt, completions, 3, checkpointing=True, model=model,
                                         tokenizer=tok, cuda=not settings.dry)
            except Exception as error:  # noqa: BLE001 - one layout failing (an OOM) must not hide the others
                measured[mode] = {"error": repr(error)[:300]}
            model = None
            free_memory()
            log(settings, f"shared_prompt {spec} {mode}: {measured[mode]}")
        shared = measured.get("shared", {})
        for mode, m in measured.items():
            if mode == "shared" or "seconds" not in m or "seconds" not in shared:
                continue
            m["shared_over_this"] = {key: round(shared[key] / m[key], 3)
                                     for key in ("seconds", "peak_mib", "activations_mib") if m.get(key)}
            if "grad_norm" in m:
                # bf16 keeps 8 bits of mantissa; a gradient summed over thousands of tokens in another order moves
                # by a few units of 2^-8 relative: 8 of them of the norm's own size
                bound = 8 * 2 ** -8 * max(m["grad_norm"], shared["grad_norm"])
                m["grad_norm_agrees_with_shared"] = abs(m["grad_norm"] - shared["grad_norm"]) <= bound

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-results")
    parser.add_argument("--total-s", type=float, default=300.0, help="start no long-context probe after this")
    parser.add_argument("--parts", default="shared_prompt,liger_profile,grpo_split,long_context")
    parser.add_argument("--lengths", default="65536,131072")
    opts = parser.parse_args(argv)
    settings = Settings(dry=opts.dry, out=Path(opts.out), total_s=opts.total_s)
    settings.out.mkdir(parents=True, exist_ok=True)
    import tempfile

    from bench.common import quiet

    quiet()
    tok, scratch = tokenizer(), Path(tempfile.mkdtemp(prefix="leantune-diagnose-"))
    results: dict = {"dry": opts.dry}
    lengths = [128, 192] if opts.dry else [int(n) for n in opts.lengths.split(",")]
    parts = {"shared_prompt": lambda r: shared_prompt(settings, tok, r),
             "liger_profile": lambda r: liger_profile(settings, tok, scratch, r),
             "grpo_split": lambda r: grpo_split(settings, tok, scratch, r),
             "long_context": lambda r: long_context(settings, tok, scratch, r, lengths,
                                                    settings.started + settings.total_s, save)}

    def save():
        (settings.out / "diagnose.json").write_text(json.dumps(results, indent=1))

    for name in opts.parts.split(","):
        report = results.setdefault(name, {})
        began = time.monotonic()
        try:
            parts[name](report)
        except Exception as error:  # noqa: BLE001 - one part failing must not hide the others
            import traceback

            report["error"] = repr(error)[:400]
            report["traceback"] = traceback.format_exc()[-1500:]
            log(settings, f"{name}: ERROR {report['error']}")
        report["seconds"] = round(time.monotonic() - began, 1)
        save()
    log(settings, f"diagnose done in {settings.elapsed():.0f} s: {settings.out}/diagnose.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
