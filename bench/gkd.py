"""leantune vs TRL GKD (trl.experimental.gkd), side by side in one process: same student, teacher, data and settings.

    python bench/gkd.py [--steps 6] [--configs off_policy,on_policy] [--json gkd.json]

Models: two small Llamas with the Mistral tokenizer's 32,000-token vocabulary (../shared), fp32, random init from
fixed seeds, saved once to folders both trainers load: the student (hidden 256, 4 layers) and a wider teacher
(hidden 512, 4 layers). Data: GSM8K questions and answers as the same pre-tokenised rows for both libraries
(`input_ids` = BOS + question + " " + answer + EOS, `completion_mask` on the answer and EOS), rows over
`--max-length` tokens left out, in dataset order; the loss is on the completion tokens in both.

Rows: `off_policy` (lmbda=0: the dataset's completions, deterministic, so both libraries' losses must agree) and
`on_policy` (lmbda=1, max_new_tokens 64: every step trains on the student's own samples; the samples differ between
libraries, so their losses do not compare). One step (the second) is watched by the same memory meter in both
(PyTorch's MemTracker through `leantune.metrics.memory_breakdown`): TRL holds the student's and the teacher's
[batch, time, vocabulary] logits and their log-softmaxes; leantune never does. leantune generates in
`get_batch_samples`, before the watched step begins, TRL inside its `training_step`: the on-policy peak of TRL
includes generation, leantune's does not (generation's own peak is the KV cache of a 4-layer model, a few MiB
here); peak RSS covers the whole `train()` of both. Time: seconds per optimizer step after two warm-up steps.

Settings shared by every run: batch 8, beta 0.5, temperature 0.9 (TRL's defaults), lr 1e-5, seed 42, gradient
checkpointing on (non-reentrant), fp32, `use_cpu=True`, no logging or saving, dropout off.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    GSM8K_TRAIN,
    MIB,
    library_versions,
    load_tokenizer,
    machine_description,
    make_step_timer,
    markdown_table,
    peak_rss_bytes,
    quiet,
    release_memory,
    reset_peak_rss,
    source_state,
    tiny_llama,
)

CONFIGS = {"off_policy": {"lmbda": 0.0}, "on_policy": {"lmbda": 1.0}}
LIBRARIES = ("leantune", "trl")
PARTS = ("parameters", "gradients", "optimizer_states", "activations", "temporaries")


def pretokenised_rows(tokenizer, max_length: int, limit: int):
    from datasets import Dataset

    rows = []
    with open(GSM8K_TRAIN, encoding="utf-8") as handle:
        for line in handle:
            item = json.loads(line)
            prompt = tokenizer(item["question"])["input_ids"]
            completion = tokenizer(" " + item["answer"], add_special_tokens=False)["input_ids"] + [
                tokenizer.eos_token_id]
            if len(prompt) + len(completion) <= max_length:
                rows.append({"input_ids": prompt + completion,
                             "completion_mask": [0] * len(prompt) + [1] * len(completion),
                             "prompt": item["question"]})
            if len(rows) == limit:
                break
    # TRL's GKD collator reads a `prompt` column (its prompt tokens come from `completion_mask`); leantune's
    # preparation takes the pre-tokenised columns alone
    return Dataset.from_list(rows)


def make_config(library: str, flags: dict, opts, output_dir: str):
    settings = {
        "output_dir": output_dir, "per_device_train_batch_size": opts.batch_size, "max_length": opts.max_length,
        "learning_rate": 1e-5, "seed": opts.seed, "max_steps": opts.steps, "beta": 0.5, "temperature": 0.9,
        "lmbda": flags["lmbda"], "max_new_tokens": opts.max_new_tokens,
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": False, "fp16": False, "logging_strategy": "no", "save_strategy": "no", "eval_strategy": "no",
        "report_to": [], "use_cpu": True, "disable_tqdm": True, "lr_scheduler_type": "linear", "warmup_steps": 0,
    }
    if library == "leantune":
        from leantune import GKDConfig

        settings["memory_breakdown"] = False  # the benchmark attaches the same meter to both libraries
    else:
        from trl.experimental.gkd import GKDConfig
    return GKDConfig(**settings)


def run_one(library: str, name: str, opts, dataset, student_dir: str, teacher_dir: str, tokenizer) -> dict:
    from transformers import set_seed

    from leantune.metrics.memory_breakdown import MemoryBreakdownCallback

    result = {"library": library, "config": name}
    release_memory()
    with tempfile.TemporaryDirectory(prefix=f"bench-gkd-{library}-") as output_dir:
        try:
            args = make_config(library, CONFIGS[name], opts, output_dir)
            set_seed(opts.seed)
            if library == "leantune":
                from leantune import GKDTrainer
            else:
                from trl.experimental.gkd import GKDTrainer
            breakdowns, timer = [], make_step_timer(2)
            data = dataset.remove_columns("prompt") if library == "leantune" else dataset
            trainer = GKDTrainer(model=student_dir, teacher_model=teacher_dir, args=args, train_dataset=data,
                                 processing_class=tokenizer,
                                 callbacks=[timer, MemoryBreakdownCallback(args.device, breakdowns.append, step=1)])
            reset_peak_rss()
            started = time.perf_counter()
            output = trainer.train()
            result["train_s"] = round(time.perf_counter() - started, 2)
            result["peak_rss_mib"] = peak_rss_bytes() / MIB
        except Exception as error:  # noqa: BLE001 - one configuration that cannot run must not hide the others
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            if opts.verbose:
                traceback.print_exc()
            return result
        steps = len(timer.step_ends)
        breakdown = breakdowns[0]
        result.update(steps=steps, s_per_step=timer.timed_seconds() / (steps - 2),
                      peak_mib=breakdown.peak_bytes / MIB,
                      parts_mib={part: breakdown.parts.get(part, 0) / MIB for part in PARTS},
                      final_loss=output.training_loss)
        del trainer
    release_memory()
    return result


def render(results: list[dict]) -> str:
    by_key = {(r["config"], r["library"]): r for r in results}
    headers = ["config", "leantune step peak MiB", "TRL step peak MiB", "mem ratio", "leantune s/step",
               "TRL s/step", "time ratio", "leantune peak RSS MiB", "TRL peak RSS MiB", "mean loss leantune / TRL"]
    rows, notes = [], []
    for name in dict.fromkeys(r["config"] for r in results):
        lt, tr = by_key.get((name, "leantune"), {}), by_key.get((name, "trl"), {})

        def get(d, key):
            return d.get(key) if d and "error" not in d else None

        def ratio(a, b):
            return a / b if a is not None and b else None

        losses = None
        if get(lt, "final_loss") is not None and get(tr, "final_loss") is not None:
            losses = f"{lt['final_loss']:.5f} / {tr['final_loss']:.5f}"
        rows.append([name, get(lt, "peak_mib"), get(tr, "peak_mib"), ratio(get(lt, "peak_mib"), get(tr, "peak_mib")),
                     get(lt, "s_per_step"), get(tr, "s_per_step"), ratio(get(lt, "s_per_step"), get(tr, "s_per_step")),
                     get(lt, "peak_rss_mib"), get(tr, "peak_rss_mib"), losses])
        for library, d in (("leantune", lt), ("TRL", tr)):
            if d and "error" in d:
                notes.append(f"- {name} / {library}: did not run: {d['error']}")
    return markdown_table(headers, rows) + ("\n\n" + "\n".join(notes) if notes else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=200, help="GSM8K rows to use (default 200)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--verbose", action="store_true")
    opts = parser.parse_args(argv)
    if opts.steps < 4:
        parser.error("--steps must be at least 4")
    import torch

    torch.set_num_threads(opts.threads)
    quiet()
    tokenizer = load_tokenizer()
    tokenizer.pad_token = tokenizer.unk_token  # TRL's GKD collator needs a pad token; leantune takes the same
    dataset = pretokenised_rows(tokenizer, opts.max_length, opts.rows)
    libraries = [lib for lib in LIBRARIES if lib in opts.libraries.split(",")]
    print(f"# GKD benchmark: {machine_description()}")
    print(f"# {library_versions('transformers', 'trl', 'datasets', 'accelerate')}; {source_state()}")
    print(f"# student: Llama hidden 256, 4 layers; teacher: Llama hidden 512, 4 layers; vocab {len(tokenizer)}, fp32; "
          f"data: {len(dataset)} GSM8K rows <= {opts.max_length} tokens; batch {opts.batch_size}; {opts.steps} steps; "
          f"{opts.threads} torch thread(s)", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-gkd-models-") as models:
        folders = {}
        for role, seed, hidden in (("student", opts.seed, 256), ("teacher", opts.seed + 1, 512)):
            model = tiny_llama(seed, vocab_size=len(tokenizer), hidden=hidden, layers=4, intermediate=4 * hidden,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)
            folders[role] = str(Path(models) / role)
            model.save_pretrained(folders[role])
            tokenizer.save_pretrained(folders[role])
            del model
        for index, name in enumerate(opts.configs.split(",")):
            for library in (libraries if index % 2 == 0 else libraries[::-1]):
                result = run_one(library, name, opts, dataset, folders["student"], folders["teacher"], tokenizer)
                results.append(result)
                if "error" in result:
                    print(f"{name:12s} {library:9s} ERROR {result['error']}", flush=True)
                else:
                    parts = " ".join(f"{p[:3]} {result['parts_mib'][p]:.0f}" for p in PARTS)
                    print(f"{name:12s} {library:9s} step peak {result['peak_mib']:8.1f} MiB ({parts})  "
                          f"{result['s_per_step']:6.2f} s/step  peak RSS {result['peak_rss_mib']:.0f} MiB  "
                          f"loss {result['final_loss']:.5f}", flush=True)
    print()
    print(render(results))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "machine": machine_description(),
                                               "source": source_state(), "runs": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
