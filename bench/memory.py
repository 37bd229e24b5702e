"""Memory techniques one by one and combined: leantune vs TRL SFT, same model, data and settings, one process.

    python bench/memory.py [--steps 6] [--configs baseline,gc,...] [--libraries leantune,trl]

Every run trains the same small Llama (fixed seed) on GSM8K prompt-completion rows (real Mistral tokenizer) with
`leantune.SFTTrainer` or `trl.SFTTrainer`. One step (the second: the first that holds optimizer states) is watched
by the same meter for both libraries (`leantune.metrics.memory_breakdown`, PyTorch's dispatch-based MemTracker):
its peak tensor memory and the parts of that peak (parameters, gradients, optimizer states, activations saved for
backward, temporaries). Real tokens/s are timed over the steps after the measured one (the meter slows its step).

Settings shared by every run: fp32, batch 8, max_length 512 (rows that would need truncation are left out, as in
bench/sft.py), lr 5e-4, no logging/saving, `use_cpu=True`, gradient checkpointing off unless the row adds it.
A row named "+ X" is the baseline plus X alone; "all" combines every technique. "chunked loss" is
`use_liger_kernel=True` for TRL (liger-kernel: CUDA only) and leantune's `chunked_loss=True` (its default; the
other rows set it False). TRL 1.16's SFT loss always runs through its own tiled LM head, in every row.
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

from bench.common import (
    MIB,
    BatchLog,
    CountingCollator,
    gsm8k_prompt_completion,
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
from bench.sft import lora_config

BIG_VOCAB = 128_256  # Llama 3's vocabulary: the logits dominate

CONFIGS = {
    "baseline": ({}, None),
    "+ gradient checkpointing": ({"gradient_checkpointing": True}, None),
    "+ chunked loss": ({"use_liger_kernel": True}, None),
    "+ activation offloading": ({"activation_offloading": True}, None),
    "+ LoRA": ({"lora": True}, None),
    "+ packing": ({"packing": True}, None),
    "gc + LoRA + packing": ({"gradient_checkpointing": True, "lora": True, "packing": True}, None),
    "gc + LoRA + packing + chunked loss": ({"gradient_checkpointing": True, "lora": True, "packing": True,
                                            "use_liger_kernel": True}, None),
    "all but chunked loss": ({"gradient_checkpointing": True, "activation_offloading": True, "lora": True,
                              "packing": True}, None),
    "all": ({"gradient_checkpointing": True, "use_liger_kernel": True, "activation_offloading": True, "lora": True,
             "packing": True}, None),
    "vocab 128k baseline": ({}, BIG_VOCAB),
    "vocab 128k + gradient checkpointing": ({"gradient_checkpointing": True}, BIG_VOCAB),
    "vocab 128k + chunked loss + gc": ({"gradient_checkpointing": True, "use_liger_kernel": True}, BIG_VOCAB),
}
KEYS = {name: name.replace(" ", "_").replace("+", "plus") for name in CONFIGS}
LIBRARIES = ("leantune", "trl")
PARTS = ("parameters", "gradients", "optimizer_states", "activations", "temporaries")


def make_config(library: str, flags: dict, opts, output_dir: str):
    settings = {
        "output_dir": output_dir,
        "per_device_train_batch_size": opts.batch_size,
        "max_length": opts.max_length,
        "learning_rate": opts.lr,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "seed": opts.seed,
        "max_steps": opts.steps,
        "gradient_checkpointing": bool(flags.get("gradient_checkpointing")),
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": False,
        "fp16": False,
        "logging_strategy": "no",
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "shuffle_dataset": False,
        "packing": bool(flags.get("packing")),
        "use_liger_kernel": bool(flags.get("use_liger_kernel")),
        "activation_offloading": bool(flags.get("activation_offloading")),
    }
    if library == "leantune":
        from leantune import SFTConfig

        settings["memory_breakdown"] = False  # the benchmark attaches the same meter to both libraries
        # leantune's default is its chunked loss; rows without "chunked loss" turn it off to show what it does.
        settings["chunked_loss"] = settings.pop("use_liger_kernel")
    else:
        from trl import SFTConfig
    return SFTConfig(**settings)


def run_one(library: str, name: str, opts, dataset, tokenizer) -> dict:
    from transformers import set_seed

    from leantune.metrics.memory_breakdown import MemoryBreakdownCallback

    flags, vocab = CONFIGS[name]
    result = {"library": library, "config": name}
    release_memory()
    with tempfile.TemporaryDirectory(prefix=f"bench-memory-{library}-") as output_dir:
        try:
            args = make_config(library, flags, opts, output_dir)
            model = tiny_llama(opts.seed, vocab_size=vocab or len(tokenizer), hidden=opts.hidden, layers=opts.layers,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)
            set_seed(opts.seed)
            if library == "leantune":
                from leantune import SFTTrainer
            else:
                from trl import SFTTrainer
            breakdowns = []
            timer = make_step_timer(2)
            trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 peft_config=lora_config() if flags.get("lora") else None,
                                 callbacks=[timer, MemoryBreakdownCallback(args.device, breakdowns.append, step=1)])
            log = BatchLog()
            trainer.data_collator = CountingCollator(trainer.data_collator, log)
            started = time.perf_counter()
            output = trainer.train()
            result["train_s"] = round(time.perf_counter() - started, 2)
        except Exception as error:  # noqa: BLE001 - one configuration that cannot run must not hide the others
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            if opts.verbose:
                traceback.print_exc()
            return result
        steps = len(timer.step_ends)
        breakdown = breakdowns[0]
        result.update(
            steps=steps,
            tokens_per_s=sum(log.real[2:steps]) / timer.timed_seconds(),
            peak_mib=breakdown.peak_bytes / MIB,
            parts_mib={part: breakdown.parts.get(part, 0) / MIB for part in PARTS},
            other_devices_mib={k: v / MIB for k, v in breakdown.other_devices.items()},
            final_loss=output.training_loss,
            padding_fraction=1 - sum(log.real) / max(1, sum(log.slots)),
        )
        del trainer
    release_memory()
    return result


def ratio(a, b):
    return a / b if a is not None and b else None


def render(results: list[dict]) -> str:
    by_key = {(r["config"], r["library"]): r for r in results}
    headers = ["config", "leantune peak MiB", "TRL peak MiB", "mem ratio", "leantune tok/s", "TRL tok/s",
               "speed ratio", "leantune parts P/G/O/A/T", "TRL parts P/G/O/A/T"]
    rows, notes = [], []
    for name in dict.fromkeys(r["config"] for r in results):
        lt, tr = by_key.get((name, "leantune"), {}), by_key.get((name, "trl"), {})

        def get(d, key):
            return d.get(key) if d and "error" not in d else None

        def parts(d):
            if not d or "error" in d:
                return None
            return "/".join(f"{d['parts_mib'][p]:.0f}" for p in PARTS)

        rows.append([name, get(lt, "peak_mib"), get(tr, "peak_mib"), ratio(get(lt, "peak_mib"), get(tr, "peak_mib")),
                     get(lt, "tokens_per_s"), get(tr, "tokens_per_s"),
                     ratio(get(lt, "tokens_per_s"), get(tr, "tokens_per_s")), parts(lt), parts(tr)])
        for library, d in (("leantune", lt), ("TRL", tr)):
            if d and "error" in d:
                notes.append(f"- {name} / {library}: did not run: {d['error']}")
            elif d:
                notes.append(f"- {name} / {library}: loss {d['final_loss']:.4f}, padding {d['padding_fraction']:.1%}"
                             + (f", other devices {d['other_devices_mib']}" if d["other_devices_mib"] else ""))
    return markdown_table(headers, rows) + "\n\n" + "\n".join(notes)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (>= 4; default 6)")
    parser.add_argument("--configs", default=",".join(KEYS.values()), help=f"comma-separated subset of {list(KEYS.values())}")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2000, help="GSM8K rows to use (default 2000)")
    parser.add_argument("--json", type=str, default=None, help="write every run's measurements here")
    parser.add_argument("--merge", type=str, default=None,
                        help="a --json file of an earlier run: its results are kept where this run has none")
    parser.add_argument("--verbose", action="store_true")
    opts = parser.parse_args(argv)
    names = {key: name for name, key in KEYS.items()}
    unknown = [c for c in opts.configs.split(",") if c not in names]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(names)}")
    if opts.steps < 4:
        parser.error("--steps must be at least 4 (step 2 is measured, steps 3+ are timed)")
    opts.config_names = [names[c] for c in opts.configs.split(",")]
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    quiet()
    tokenizer = load_tokenizer()
    dataset = gsm8k_prompt_completion(limit=opts.rows, tokenizer=tokenizer, max_tokens=opts.max_length)
    libraries = [lib for lib in LIBRARIES if lib in opts.libraries.split(",")]
    print(f"# memory benchmark: {machine_description()}")
    print(f"# {library_versions('transformers', 'trl', 'peft', 'datasets', 'accelerate')}; {source_state()}")
    print(f"# model: Llama hidden {opts.hidden}, {opts.layers} layers, vocab {len(tokenizer)} (or {BIG_VOCAB:,}), "
          f"fp32; data: {len(dataset)} GSM8K rows; batch {opts.batch_size}; max_length {opts.max_length}; "
          f"{opts.steps} steps", flush=True)
    results = []
    for index, name in enumerate(opts.config_names):
        for library in (libraries if index % 2 == 0 else libraries[::-1]):
            result = run_one(library, name, opts, dataset, tokenizer)
            results.append(result)
            if "error" in result:
                print(f"{name:38s} {library:9s} ERROR {result['error']}", flush=True)
            else:
                parts = " ".join(f"{p[:3]} {result['parts_mib'][p]:.0f}" for p in PARTS)
                print(f"{name:38s} {library:9s} peak {result['peak_mib']:8.1f} MiB ({parts})  "
                      f"{result['tokens_per_s']:8.1f} tok/s  loss {result['final_loss']:.4f}", flush=True)
    if opts.merge:
        earlier = json.loads(Path(opts.merge).read_text())["runs"]
        done = {(r["config"], r["library"]) for r in results}
        order = list(CONFIGS)
        results = sorted([r for r in earlier if (r["config"], r["library"]) not in done] + results,
                         key=lambda r: (order.index(r["config"]) if r["config"] in order else len(order),
                                        r["library"]))
    print()
    print(render(results))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": {k: v for k, v in vars(opts).items()},
                                               "machine": machine_description(), "source": source_state(),
                                               "runs": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
