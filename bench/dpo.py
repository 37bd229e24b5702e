"""leantune vs TRL DPO, side by side in one process: same model, pairs, order and settings.

    python bench/dpo.py [--steps 8] [--configs padded,padding_free,lora,precompute_ref]

Data: the Anthropic HH-RLHF harmless pairs in ../shared, their prompt split off once (leantune's implicit-prompt
rule) and given to both libraries as explicit {prompt, chosen, rejected}; pairs whose prompt + completion exceed
`--max-length` tokens are left out, so neither library truncates. Model: a small Llama (fixed seed), fp32.
One step (the second) is watched by the same memory meter for both (PyTorch's MemTracker through
`leantune.metrics.memory_breakdown`): peak tensor memory and its parts. Real tokens/s (prompt + completion tokens
of both sequences of every pair) are timed over the steps after the measured one.

Settings shared by every run: batch 8 pairs, beta 0.1, sigmoid loss, lr 5e-6, gradient checkpointing on
(non-reentrant), no logging/saving, `use_cpu=True`. TRL 1.16 accepts `padding_free=True` but warns and pads
(its docs say so); the row shows what each library does with the same flag.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    MIB,
    SHARED,
    library_versions,
    load_tokenizer,
    machine_description,
    make_step_timer,
    markdown_table,
    quiet,
    release_memory,
    source_state,
    tiny_llama,
)
from bench.sft import lora_config  # noqa: E402

HH_PAIRS = SHARED / "data" / "hh-rlhf-harmless" / "test.jsonl.gz"
CONFIGS = {
    "padded": {},
    "padding_free": {"padding_free": True},
    "lora": {"lora": True},
    "precompute_ref": {"precompute_ref_log_probs": True},
}
LIBRARIES = ("leantune", "trl")
PARTS = ("parameters", "gradients", "optimizer_states", "activations", "temporaries")


def explicit_pairs(tokenizer, max_length: int, limit: int | None):
    from datasets import Dataset

    from leantune.data.preference_formats import PreferenceFormat, explicit_prompt_example

    rows = []
    with gzip.open(HH_PAIRS, "rt", encoding="utf-8") as handle:
        for line in handle:
            pair = explicit_prompt_example(json.loads(line), PreferenceFormat.IMPLICIT_PROMPT)
            if pair["chosen"].strip() and pair["rejected"].strip() and pair["chosen"] != pair["rejected"]:
                rows.append(pair)
    prompts = tokenizer([r["prompt"] for r in rows])["input_ids"]
    kept = []
    for row, prompt in zip(rows, prompts):
        sides = tokenizer([row["chosen"], row["rejected"]], add_special_tokens=False)["input_ids"]
        if max(len(prompt) + len(side) + 1 for side in sides) <= max_length:
            kept.append(row)
    return Dataset.from_list(kept[:limit] if limit else kept)


class PairTokenCounter:
    """Wrap a preference collator and record the real tokens of each batch (both sequences of every pair)."""

    def __init__(self, collator):
        self.collator, self.real = collator, []

    def __call__(self, examples):
        def size(ex, side):
            for prefix in ("", "_input"):
                if f"prompt{prefix}_ids" in ex:
                    return len(ex[f"prompt{prefix}_ids"]) + len(ex[f"{side}{prefix}_ids"])
            raise KeyError(sorted(ex))

        self.real.append(sum(size(ex, "chosen") + size(ex, "rejected") for ex in examples))
        return self.collator(examples)

    def __getattr__(self, name):
        return getattr(self.collator, name)


def make_config(library: str, flags: dict, opts, output_dir: str):
    settings = {
        "output_dir": output_dir, "per_device_train_batch_size": opts.batch_size, "max_length": opts.max_length,
        "learning_rate": 5e-6, "beta": 0.1, "seed": opts.seed, "max_steps": opts.steps,
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": False, "fp16": False, "logging_strategy": "no", "save_strategy": "no", "eval_strategy": "no",
        "report_to": [], "use_cpu": True, "disable_tqdm": True, "lr_scheduler_type": "linear", "warmup_steps": 0,
        "padding_free": bool(flags.get("padding_free")),
        "precompute_ref_log_probs": bool(flags.get("precompute_ref_log_probs")),
    }
    if library == "leantune":
        from leantune import DPOConfig

        settings["memory_breakdown"] = False  # the benchmark attaches the same meter to both libraries
    else:
        from trl import DPOConfig
    return DPOConfig(**settings)


def run_one(library: str, name: str, opts, dataset, tokenizer) -> dict:
    from transformers import set_seed

    from leantune.metrics.memory_breakdown import MemoryBreakdownCallback

    flags = CONFIGS[name]
    result = {"library": library, "config": name}
    release_memory()
    with tempfile.TemporaryDirectory(prefix=f"bench-dpo-{library}-") as output_dir:
        try:
            args = make_config(library, flags, opts, output_dir)
            model = tiny_llama(opts.seed, vocab_size=len(tokenizer), hidden=opts.hidden, layers=opts.layers,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)
            # Both libraries load the model (and, without PEFT, their reference copy) from the same local folder.
            model_dir = str(Path(output_dir) / "model")
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            model = model_dir
            set_seed(opts.seed)
            if library == "leantune":
                from leantune import DPOTrainer
            else:
                from trl import DPOTrainer
            breakdowns, timer = [], make_step_timer(2)
            trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 peft_config=lora_config() if flags.get("lora") else None,
                                 callbacks=[timer, MemoryBreakdownCallback(args.device, breakdowns.append, step=1)])
            counter = PairTokenCounter(trainer.data_collator)
            trainer.data_collator = counter
            started = time.perf_counter()
            output = trainer.train()
            result["train_s"] = round(time.perf_counter() - started, 2)
        except Exception as error:  # noqa: BLE001 - one configuration that cannot run must not hide the others
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            if opts.verbose:
                traceback.print_exc()
            return result
        steps = len(timer.step_ends)
        # With precomputed reference log-probs the collator also ran for the precompute pass first.
        real = counter.real[-steps:]
        breakdown = breakdowns[0]
        result.update(
            steps=steps,
            tokens_per_s=sum(real[2:steps]) / timer.timed_seconds(),
            peak_mib=breakdown.peak_bytes / MIB,
            parts_mib={part: breakdown.parts.get(part, 0) / MIB for part in PARTS},
            final_loss=output.training_loss,
        )
        del trainer
    release_memory()
    return result


def render(results: list[dict]) -> str:
    by_key = {(r["config"], r["library"]): r for r in results}
    headers = ["config", "leantune peak MiB", "TRL peak MiB", "mem ratio", "leantune tok/s", "TRL tok/s",
               "speed ratio", "leantune parts P/G/O/A/T", "TRL parts P/G/O/A/T", "loss leantune / TRL"]
    rows, notes = [], []
    for name in dict.fromkeys(r["config"] for r in results):
        lt, tr = by_key.get((name, "leantune"), {}), by_key.get((name, "trl"), {})

        def get(d, key):
            return d.get(key) if d and "error" not in d else None

        def parts(d):
            return "/".join(f"{d['parts_mib'][p]:.0f}" for p in PARTS) if d and "error" not in d else None

        def ratio(a, b):
            return a / b if a is not None and b else None

        losses = None
        if get(lt, "final_loss") is not None and get(tr, "final_loss") is not None:
            losses = f"{lt['final_loss']:.5f} / {tr['final_loss']:.5f}"
        rows.append([name, get(lt, "peak_mib"), get(tr, "peak_mib"), ratio(get(lt, "peak_mib"), get(tr, "peak_mib")),
                     get(lt, "tokens_per_s"), get(tr, "tokens_per_s"),
                     ratio(get(lt, "tokens_per_s"), get(tr, "tokens_per_s")), parts(lt), parts(tr), losses])
        for library, d in (("leantune", lt), ("TRL", tr)):
            if d and "error" in d:
                notes.append(f"- {name} / {library}: did not run: {d['error']}")
    return markdown_table(headers, rows) + ("\n\n" + "\n".join(notes) if notes else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=400, help="pairs to use (default 400)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--verbose", action="store_true")
    opts = parser.parse_args(argv)
    if opts.steps < 4:
        parser.error("--steps must be at least 4")
    quiet()
    tokenizer = load_tokenizer()
    dataset = explicit_pairs(tokenizer, opts.max_length, opts.pairs)
    libraries = [lib for lib in LIBRARIES if lib in opts.libraries.split(",")]
    print(f"# DPO benchmark: {machine_description()}")
    print(f"# {library_versions('transformers', 'trl', 'peft', 'datasets', 'accelerate')}; {source_state()}")
    print(f"# model: Llama hidden {opts.hidden}, {opts.layers} layers, vocab {len(tokenizer)}, fp32; data: "
          f"{len(dataset)} HH-RLHF pairs <= {opts.max_length} tokens; batch {opts.batch_size} pairs; "
          f"{opts.steps} steps", flush=True)
    results = []
    for index, name in enumerate(opts.configs.split(",")):
        for library in (libraries if index % 2 == 0 else libraries[::-1]):
            result = run_one(library, name, opts, dataset, tokenizer)
            results.append(result)
            if "error" in result:
                print(f"{name:16s} {library:9s} ERROR {result['error']}", flush=True)
            else:
                parts = " ".join(f"{p[:3]} {result['parts_mib'][p]:.0f}" for p in PARTS)
                print(f"{name:16s} {library:9s} peak {result['peak_mib']:8.1f} MiB ({parts})  "
                      f"{result['tokens_per_s']:8.1f} tok/s  loss {result['final_loss']:.5f}", flush=True)
    print()
    print(render(results))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "machine": machine_description(),
                                               "source": source_state(), "runs": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
