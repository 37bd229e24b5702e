"""GRPO's step split into generation and the rest, leantune vs TRL 1.16 side by side in one process (issue 38 item 4).

    python bench/grpo_step.py [--steps 6] [--hidden 64] [--layers 2] [--completion-length 16] [--profile] [--json f]

On the H100 the rest of leantune's GRPO step (rewards, log-probs, loss, backward, optimizer, metrics) took 0.55-0.66 s
against TRL's ~0.26 s. On a GPU that part is mostly what the host does per step: Python, one launch per dispatched
op, and a wait at every device-to-host read. So the default model here is small (Llama, hidden 64, 2 layers, the
Mistral tokenizer's 32,000-token vocabulary, fp32): its arithmetic is cheap on CPU and the same host work shows.
Everything else is bench/grpo.py's (`make_config`: the same prompts in order, reward, loss_type "dapo", beta 0,
checkpointing on, completions of exactly `--completion-length` tokens, 2 prompts x 4 generations a step).

Per step: generation (the library's generating call: leantune's `GenerationSession.generate`, TRL's
`_generate_single_turn`), rest = the step minus it (from one step's end to the next). Step 1 warms up. Step 2 is
counted, outside generation: the aten ops dispatched (a GPU launches a kernel for nearly each), the host reads of a
tensor's value (`aten::_local_scalar_dense`: `.item()`, `int()`, `bool()` of a tensor: a device sync on a GPU), and
the model's forward calls. With `--profile`, step 3 runs under cProfile outside generation and its top functions are
printed. The remaining steps are timed (wall and process CPU seconds), medians reported, leantune / TRL ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    library_versions,
    load_tokenizer,
    machine_description,
    markdown_table,
    quiet,
    release_memory,
    source_state,
)
from bench.grpo import grpo_trainer_class, gsm8k_prompts, make_config, saved_policy, text_length  # noqa: E402

LIBRARIES = ("leantune", "trl")
HOST_READ = "aten._local_scalar_dense"


class OpCounter:
    """The aten ops dispatched while `active` (a TorchDispatchMode, entered for one whole step); with `where`, also
    the innermost Python line outside torch that dispatched each op (`--where`: which code adds them)."""

    def __init__(self, where: bool = False):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter.active:
                    counter.ops[str(func.overloadpacket)] += 1
                    if where:
                        line = caller_outside_torch()
                        counter.lines[line] += 1
                        if str(func.overloadpacket) == HOST_READ:
                            counter.read_lines[line] += 1
                return func(*args, **(kwargs or {}))

        self.mode, self.ops, self.lines, self.read_lines, self.active = Mode(), Counter(), Counter(), Counter(), False


def caller_outside_torch() -> str:
    """file:line of the innermost frame whose file is not torch's own (nor this file's)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and name != __file__:
            parts = Path(name).parts
            return f"{'/'.join(parts[-3:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class StepWatch:
    """Times each step's generation and the rest; counts ops (step `counted`) and profiles (step `profiled`) outside
    generation. Steps are numbered from 0 as `state.global_step` before they end."""

    def __init__(self, trainer, owner, name: str, base_model, counted: int, profiled: int | None,
                 where: bool = False):
        from transformers import TrainerCallback

        self.step_ends, self.cpu_ends, self.gen_s, self.gen_cpu_s = [], [], {}, {}
        self.counted, self.profiled = counted, profiled
        self.counter, self.profile, self.forwards = OpCounter(where), cProfile.Profile(), 0
        self.watching = None  # "count" / "profile" during those steps
        watch = self
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed_generation(*args, **kwargs):
            watch.pause(True)
            started, cpu_started = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                step = len(watch.step_ends)
                watch.gen_s[step] = watch.gen_s.get(step, 0.0) + time.perf_counter() - started
                watch.gen_cpu_s[step] = watch.gen_cpu_s.get(step, 0.0) + time.process_time() - cpu_started
                watch.pause(False)

        setattr(owner, name, timed_generation)

        def count_forward(module, args):
            if watch.watching == "count" and watch.counter.active:
                watch.forwards += 1

        base_model.register_forward_pre_hook(count_forward)

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                watch.step_ends.append(time.perf_counter())
                watch.cpu_ends.append(time.process_time())
                watch.begin(0)

            def on_step_end(self, args, state, control, **kwargs):
                watch.end()
                watch.step_ends.append(time.perf_counter())
                watch.cpu_ends.append(time.process_time())
                watch.begin(len(watch.step_ends) - 1)

            def on_train_end(self, args, state, control, **kwargs):
                watch.end()

        self.callback = Callback()

    def begin(self, step: int) -> None:
        if step == self.counted:
            self.watching = "count"
            self.counter.mode.__enter__()
            self.counter.active = True
        elif step == self.profiled:
            self.watching = "profile"
            self.profile.enable()

    def end(self) -> None:
        if self.watching == "count":
            self.counter.active = False
            self.counter.mode.__exit__(None, None, None)
        elif self.watching == "profile":
            self.profile.disable()
        self.watching = None

    def pause(self, paused: bool) -> None:
        if self.watching == "count":
            self.counter.active = not paused
        elif self.watching == "profile":
            (self.profile.disable if paused else self.profile.enable)()


def run_one(library: str, opts, dataset, tokenizer) -> dict:

    release_memory()
    settings = {"beta": 0.0, "lora": False, "vocab": None, "max_completion_length": opts.completion_length}
    with tempfile.TemporaryDirectory(prefix=f"bench-grpo-step-{library}-") as output_dir:
        args = make_config(library, settings, dict(opts.leantune_fields) if library == "leantune" else {}, opts,
                           output_dir)
        model_dir, _ = saved_policy(opts, tokenizer, output_dir, intermediate=4 * opts.hidden)
        GRPOTrainer = grpo_trainer_class(library)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=text_length, args=args, train_dataset=dataset,
                              processing_class=tokenizer)
        owner, name = (trainer.generation, "generate") if library == "leantune" else (trainer, "_generate_single_turn")
        base = trainer.model.get_decoder() if hasattr(trainer.model, "get_decoder") else trainer.model
        watch = StepWatch(trainer, owner, name, base, counted=1, profiled=2 if opts.profile else None,
                          where=opts.where)
        trainer.add_callback(watch.callback)
        with contextlib.redirect_stdout(io.StringIO()):
            output = trainer.train()
        del trainer
    release_memory()
    steps = len(watch.step_ends) - 1
    step_s = [b - a for a, b in zip(watch.step_ends, watch.step_ends[1:])]
    step_cpu = [b - a for a, b in zip(watch.cpu_ends, watch.cpu_ends[1:])]
    timed = [i for i in range(steps) if i not in (0, watch.counted, watch.profiled)]
    per_step = [{"step_s": step_s[i], "gen_s": watch.gen_s.get(i, 0.0), "rest_s": step_s[i] - watch.gen_s.get(i, 0.0),
                 "gen_cpu_s": watch.gen_cpu_s.get(i, 0.0), "rest_cpu_s": step_cpu[i] - watch.gen_cpu_s.get(i, 0.0)}
                for i in timed]
    ops = watch.counter.ops
    result = {"library": library, "steps": steps, "per_step": per_step, "final_loss": output.training_loss,
              "medians": {key: statistics.median(s[key] for s in per_step) for key in per_step[0]},
              "rest_ops": sum(ops.values()), "rest_host_reads": ops.get(HOST_READ, 0), "rest_forwards": watch.forwards,
              "top_ops": ops.most_common(opts.top_ops), "top_lines": watch.counter.lines.most_common(opts.top_ops),
              "host_read_lines": watch.counter.read_lines.most_common()}
    if opts.profile:
        text = io.StringIO()
        stats = pstats.Stats(watch.profile, stream=text)
        stats.sort_stats("cumulative").print_stats(opts.profile_lines)
        stats.sort_stats("tottime").print_stats(opts.profile_lines)
        result["profile"] = text.getvalue()
    return result


def ratio(a, b):
    return a / b if a is not None and b else None


def render(results: dict) -> str:
    lt, trl = results.get("leantune"), results.get("trl")
    headers = ["measure", "leantune", "TRL", "leantune / TRL"]
    rows = []
    for key, label in (("gen_s", "generation s (median)"), ("gen_cpu_s", "generation, CPU s"),
                       ("rest_s", "rest of the step s (median)"), ("rest_cpu_s", "rest of the step, CPU s"),
                       ("step_s", "step s")):
        a = lt["medians"][key] if lt else None
        b = trl["medians"][key] if trl else None
        rows.append([label, a, b, ratio(a, b)])
    for key, label in (("rest_ops", "aten ops outside generation (step 2)"),
                       ("rest_host_reads", "host reads of a tensor value (step 2)"),
                       ("rest_forwards", "model forwards outside generation (step 2)")):
        a = lt[key] if lt else None
        b = trl[key] if trl else None
        rows.append([label, a, b, ratio(a, b)])
    return markdown_table(headers, rows)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (>= 3): warm-up, counted, timed")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per optimizer step")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64, help="GSM8K questions to use, in order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--leantune", action="append", default=[], metavar="FIELD=JSON",
                        help="a leantune-only config field, e.g. shared_prompt=false (repeatable)")
    parser.add_argument("--profile", action="store_true", help="cProfile one step outside generation (step 3)")
    parser.add_argument("--profile-lines", type=int, default=30)
    parser.add_argument("--top-ops", type=int, default=15)
    parser.add_argument("--where", action="store_true", help="count step 2's ops by the line that dispatched them")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    minimum = 4 if opts.profile else 3
    if opts.steps < minimum:
        parser.error(f"--steps must be at least {minimum}")
    if opts.batch_size % opts.num_generations:
        parser.error("--batch-size must be a multiple of --num-generations")
    opts.leantune_fields = {}
    for item in opts.leantune:
        key, _, value = item.partition("=")
        opts.leantune_fields[key] = json.loads(value)
    return opts


def main(argv=None) -> int:
    import torch

    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    quiet()
    warnings.filterwarnings("ignore", category=FutureWarning)
    tokenizer = load_tokenizer()
    opts.tokenizer_size = len(tokenizer)
    dataset = gsm8k_prompts(opts.prompts)
    print(f"# GRPO step, generation vs the rest: {machine_description()}")
    print(f"# {library_versions('torch', 'transformers', 'trl')}; {source_state()}")
    print(f"# Llama hidden {opts.hidden}, {opts.layers} layers, vocab {len(tokenizer)}, fp32; {opts.batch_size} "
          f"completions/step ({opts.num_generations} per prompt) of {opts.completion_length} tokens; {opts.steps} "
          f"steps; leantune fields {opts.leantune_fields or '{}'}", flush=True)
    results = {}
    for library in [lib for lib in LIBRARIES if lib in opts.libraries.split(",")]:
        result = run_one(library, opts, dataset, tokenizer)
        results[library] = result
        m = result["medians"]
        print(f"{library:9s} step {m['step_s']:.3f} s: generation {m['gen_s']:.3f} (CPU {m['gen_cpu_s']:.3f}), rest "
              f"{m['rest_s']:.3f} "
              f"(CPU {m['rest_cpu_s']:.3f}); rest of step 2: {result['rest_ops']} ops, {result['rest_host_reads']} "
              f"host reads, {result['rest_forwards']} forwards; top ops {result['top_ops'][:8]}", flush=True)
        if opts.where:
            print("  ops by the line that dispatched them:\n" + "\n".join(f"  {n:6d} {line}"
                                                                        for line, n in result["top_lines"]))
            print("  host reads by line:\n" + "\n".join(f"  {n:6d} {line}" for line, n in result["host_read_lines"]))
        if opts.profile:
            print(result["profile"])
    print()
    print(render(results))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": {k: v for k, v in vars(opts).items()},
                                               "source": source_state(), "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
