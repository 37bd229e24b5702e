"""leantune vs TRL: supervised fine-tuning side by side, on the same model, data, order and settings.

    python bench/sft.py [--steps N] [--quick] [--configs padded,packed_bfd,padding_free,lora] [--repeats R]

For each configuration, in one process, it trains the same small Llama (same random init: a fixed seed) on GSM8K
prompt-completion data with the real Mistral tokenizer, once with `leantune.SFTTrainer` and once with
`trl.SFTTrainer`, the two runs of a configuration next to each other (the library that goes first alternates from
one configuration to the next). It measures:

- real tokens/s: non-padding tokens fed to the model, counted per batch the same way for both libraries (by a
  wrapper around each trainer's collator, see `bench.common.CountingCollator`), over the steps after the first
  `--warmup` ones (timed by a callback at the end of each step);
- peak memory: the peak RSS of the process during `trainer.train()` (Linux VmHWM, reset right before), and its
  increase over the RSS just before `train()`;
- the training loss of every step (the last one and the mean of the last 5 are shown).

Matching settings (set explicitly for both libraries, since their defaults differ on some):
fp32 (`bf16=False`: TRL's SFTConfig defaults to bf16=True, which on CPU means bf16 autocast), gradient checkpointing
on and non-reentrant, completion-only loss (the default of both for prompt-completion data), same learning rate,
seed, max_steps, linear schedule, no warm-up, no logging, no saving, `report_to=[]`, `use_cpu=True`, dataloader
defaults, no shuffling before packing.

Data: GSM8K train rows whose prompt + completion + EOS fit in `--max-length` tokens (a handful of longer rows are
left out), so no library truncates and TRL's padding-free mode (which refuses `max_length` without packing) sees the
same data as leantune's.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    peak_rss_bytes,
    quiet,
    release_memory,
    reset_peak_rss,
    rss_bytes,
    source_state,
    tiny_llama,
)

CONFIGS = {
    "padded": "per_device_train_batch_size=8, max_length=512, padded batches",
    "packed_bfd": "packing=True, packing_strategy='bfd', max_length=512",
    "padding_free": "padding_free=True (one flattened row per batch)",
    "lora": "LoRA r=16 on q/k/v/o_proj, padded",
}
LIBRARIES = ("leantune", "trl")


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )


def make_config(library: str, name: str, opts, output_dir: str):
    common = {
        "output_dir": output_dir,
        "per_device_train_batch_size": opts.batch_size,
        "gradient_accumulation_steps": 1,
        "max_length": opts.max_length,
        "learning_rate": opts.lr,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "seed": opts.seed,
        "max_steps": opts.steps,
        "gradient_checkpointing": True,
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
    }
    if name == "packed_bfd":
        common.update(packing=True, packing_strategy="bfd")
    elif name == "padding_free":
        common.update(padding_free=True)
        if library == "trl":
            # TRL refuses padding_free with max_length and no packing ("max_length is not enforced"); the data is
            # pre-filtered to rows <= max_length, so max_length=None changes nothing for it.
            common.update(max_length=None)
    if library == "leantune":
        from leantune import SFTConfig
    else:
        from trl import SFTConfig
    return SFTConfig(**common)


def build_trainer(library: str, name: str, opts, dataset, tokenizer, output_dir: str):
    from transformers import set_seed

    args = make_config(library, name, opts, output_dir)
    model = tiny_llama(opts.seed, vocab_size=len(tokenizer), hidden=opts.hidden, layers=opts.layers,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    peft_config = lora_config() if name == "lora" else None
    set_seed(opts.seed)  # the LoRA init happens inside the trainer's constructor
    if library == "leantune":
        from leantune import SFTTrainer
    else:
        from trl import SFTTrainer
    timer = make_step_timer(opts.warmup)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[timer],
    )
    log = BatchLog()
    trainer.data_collator = CountingCollator(trainer.data_collator, log)

    losses: list[float] = []
    training_step = trainer.training_step

    def recording_step(*a, **k):
        loss = training_step(*a, **k)
        losses.append(float(loss))
        return loss

    trainer.training_step = recording_step
    return trainer, timer, log, losses


def run_one(library: str, name: str, opts, dataset, tokenizer) -> dict:
    result = {"library": library, "config": name}
    release_memory()
    with tempfile.TemporaryDirectory(prefix=f"bench-sft-{library}-") as output_dir:
        try:
            t0 = time.perf_counter()
            trainer, timer, log, losses = build_trainer(library, name, opts, dataset, tokenizer, output_dir)
            result["setup_s"] = round(time.perf_counter() - t0, 2)
            result["train_rows"] = len(trainer.train_dataset)
            release_memory()
            rss_before = rss_bytes()
            reset_peak_rss()
            trainer.train()
            peak = peak_rss_bytes()
        except Exception as error:  # noqa: BLE001 - one broken configuration must not hide the others
            result["error"] = f"{type(error).__name__}: {error}"
            if opts.verbose:
                traceback.print_exc()
            return result
        steps = len(timer.step_ends)
        timed = slice(opts.warmup, steps)
        real_timed = sum(log.real[timed])
        seconds = timer.timed_seconds()
        result.update(
            steps=steps,
            tokens_per_s=real_timed / seconds,
            tokens_per_cpu_s=real_timed / timer.timed_cpu_seconds(),
            timed_seconds=round(seconds, 3),
            step_seconds=[round(s, 3) for s in timer.step_seconds()],
            real_tokens=log.real[:steps],
            token_slots=log.slots[:steps],
            batch_shapes=[(r, w) for r, w in zip(log.rows[:steps], log.widths[:steps])],
            padding_fraction=1 - sum(log.real[:steps]) / max(1, sum(log.slots[:steps])),
            rss_before_mib=rss_before / MIB,
            peak_rss_mib=peak / MIB,
            peak_increase_mib=(peak - rss_before) / MIB,
            losses=losses,
            final_loss=losses[-1] if losses else None,
            last5_loss=statistics.fmean(losses[-5:]) if losses else None,
        )
        del trainer, timer, log
    release_memory()
    return result


def summarise(results: list[dict]) -> list[dict]:
    """Median over repeats, per (config, library)."""
    rows = []
    for name in dict.fromkeys(r["config"] for r in results):
        row = {"config": name}
        for library in LIBRARIES:
            runs = [r for r in results if r["config"] == name and r["library"] == library]
            ok = [r for r in runs if "error" not in r]
            if not ok:
                row[library] = {"error": runs[0].get("error", "not run") if runs else "not run"}
                continue
            row[library] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
                "tokens_per_s_all": [round(r["tokens_per_s"], 1) for r in ok],
                "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in ok),
                "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in ok),
                "peak_increase_mib": statistics.median(r["peak_increase_mib"] for r in ok),
                "final_loss": ok[-1]["final_loss"],
                "last5_loss": ok[-1]["last5_loss"],
                "padding_fraction": ok[-1]["padding_fraction"],
                "real_tokens_per_step": statistics.fmean(ok[-1]["real_tokens"]),
                "batch_shape": ok[-1]["batch_shapes"][-1],
            }
        rows.append(row)
    return rows


def ratio(a, b):
    return a / b if a is not None and b else None


def render(rows: list[dict]) -> str:
    headers = ["config", "leantune tok/s", "TRL tok/s", "speed ratio", "leantune peak MiB (+train)",
               "TRL peak MiB (+train)", "mem ratio", "leantune loss last/last5", "TRL loss last/last5"]
    table = []
    notes = []
    for row in rows:
        lt, tr = row["leantune"], row["trl"]

        def get(d, key):
            return d.get(key) if "error" not in d else None

        def mem(d):
            if "error" in d:
                return None
            return f"{d['peak_rss_mib']:,.0f} (+{d['peak_increase_mib']:,.0f})"

        def loss(d):
            if "error" in d:
                return None
            return f"{d['final_loss']:.4f} / {d['last5_loss']:.4f}"

        table.append([
            row["config"],
            get(lt, "tokens_per_s"),
            get(tr, "tokens_per_s"),
            ratio(get(lt, "tokens_per_s"), get(tr, "tokens_per_s")),
            mem(lt),
            mem(tr),
            ratio(get(lt, "peak_rss_mib"), get(tr, "peak_rss_mib")),
            loss(lt),
            loss(tr),
        ])
        for library, d in (("leantune", lt), ("trl", tr)):
            if "error" in d:
                notes.append(f"- {row['config']} / {library}: {d['error']}")
            else:
                notes.append(
                    f"- {row['config']} / {library}: batch (rows, width) {tuple(d['batch_shape'])} at the last step, "
                    f"{d['real_tokens_per_step']:,.0f} real tokens/step, padding {d['padding_fraction']:.1%}, "
                    f"tok/s per repeat {d['tokens_per_s_all']}, real tokens per CPU-second {d['tokens_per_cpu_s']:.1f}"
                )
    return markdown_table(headers, table) + "\n\n" + "\n".join(notes)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="max_steps of every run (default 20; 6 with --quick)")
    parser.add_argument("--quick", action="store_true", help="sanity run: 6 steps on the first 1,000 rows")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated subset of leantune,trl")
    parser.add_argument("--repeats", type=int, default=1, help="run each (config, library) pair this many times")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default 2)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=None, help="use only the first N GSM8K rows")
    parser.add_argument("--json", type=str, default=None, help="write every run's measurements here")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failing runs")
    opts = parser.parse_args(argv)
    if opts.quick:
        if "--steps" not in (argv if argv is not None else sys.argv):
            opts.steps = 6
        opts.rows = opts.rows or 1000
    if opts.steps <= opts.warmup:
        parser.error(f"--steps must exceed --warmup ({opts.warmup}).")
    unknown = set(opts.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    quiet()
    tokenizer = load_tokenizer()
    dataset = gsm8k_prompt_completion(limit=opts.rows, tokenizer=tokenizer, max_tokens=opts.max_length)
    libraries = [lib for lib in LIBRARIES if lib in opts.libraries.split(",")]
    print(f"# SFT benchmark: {machine_description()}")
    print(f"# {library_versions('transformers', 'trl', 'peft', 'datasets', 'accelerate')}; {source_state()}")
    print(f"# model: Llama hidden {opts.hidden}, {opts.layers} layers, vocab {len(tokenizer)}, fp32, sdpa; "
          f"data: {len(dataset)} GSM8K rows; steps {opts.steps} (first {opts.warmup} untimed); "
          f"batch {opts.batch_size}; lr {opts.lr}; seed {opts.seed}", flush=True)

    results = []
    for index, name in enumerate(opts.configs.split(",")):
        for repeat in range(opts.repeats):
            order = libraries if (index + repeat) % 2 == 0 else libraries[::-1]
            for library in order:
                result = run_one(library, name, opts, dataset, tokenizer)
                result["repeat"] = repeat
                results.append(result)
                if "error" in result:
                    print(f"{name:13s} {library:9s} ERROR {result['error']}", flush=True)
                else:
                    print(
                        f"{name:13s} {library:9s} {result['tokens_per_s']:9.1f} real tok/s "
                        f"({result['tokens_per_cpu_s']:.1f} per CPU-s)  "
                        f"peak RSS {result['peak_rss_mib']:7.0f} MiB (+{result['peak_increase_mib']:.0f})  "
                        f"loss {result['final_loss']:.4f} (last5 {result['last5_loss']:.4f})  "
                        f"padding {result['padding_fraction']:.1%}  setup {result['setup_s']}s",
                        flush=True,
                    )
    rows = summarise(results)
    print()
    print(render(rows))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "machine": machine_description(),
                                               "source": source_state(),
                                               "runs": results, "summary": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
