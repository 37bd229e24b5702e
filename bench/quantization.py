"""Memory of one LoRA training step with the base weights in fp32, bf16, 8-bit and 4-bit (bitsandbytes).

    python bench/quantization.py [--configs fp32,bf16,8bit,4bit] [--json out.json] [--layers 16]

One model from a Llama config (random weights, saved once to a temporary folder, since a quantised model loads
through `from_pretrained`), trained by `leantune.SFTTrainer` with LoRA on GSM8K prompt-completion rows (real Mistral
tokenizer), gradient checkpointing on, chunked loss on (leantune's defaults). Each configuration runs in a fresh
process. The second optimizer step (the first that holds optimizer states) is watched by leantune's meter
(`memory_breakdown=True`: PyTorch's dispatch-based MemTracker): its peak of live tensor memory and the parts at that
moment, P/G/O/A/T = parameters / gradients / optimizer states / activations saved for backward / temporaries.

The quantised rows keep every weight that is not a quantised linear layer (embeddings, norms, output head) and the
compute in fp32: PEFT's `prepare_model_for_kbit_training`, which leantune runs for every quantised model as TRL
does, casts those to fp32 whatever `dtype` says.

bitsandbytes keeps the per-block scales of a 4-bit weight (`quant_state.absmax`, 4 bytes per 64 weights, or about 1
byte per 256 with nested quantisation) and the row scales of an 8-bit one (`SCB`) beside the parameter, where
MemTracker does not look; leantune's meter hands them to it as parameters (metrics/quantized_weights.py), so the step
peak includes them; they are also shown alone ("quant. constants", part of the peak). The process's peak RSS is shown too (it includes Python, torch and the dataset).

Memory numbers do not depend on the machine's load; the step time is printed but is not a benchmark here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    MIB,
    gsm8k_prompt_completion,
    library_versions,
    load_tokenizer,
    machine_description,
    markdown_table,
    peak_rss_bytes,
    quiet,
    source_state,
    tiny_llama,
)

MODEL = dict(vocab_size=32_000, hidden=1024, layers=16, heads=16, intermediate=2816)  # ~250M parameters

CONFIGS = {
    "fp32": ("fp32 LoRA", {"dtype": "float32"}, {}),
    "bf16": ("bf16 LoRA (bf16 weights, bf16=True)", {"dtype": "bfloat16"}, {"bf16": True}),
    "8bit": ("8-bit LoRA (LLM.int8 base)", {"quantization_config": {"load_in_8bit": True}}, {}),
    "4bit": ("4-bit LoRA (nf4 base, fp32 compute)",
             {"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}}, {}),
}

SETTINGS = dict(per_device_train_batch_size=4, max_length=256, max_steps=2, learning_rate=1e-4, seed=0,
                gradient_checkpointing=True, memory_breakdown=True, report_to=[], save_strategy="no",
                logging_steps=1, disable_tqdm=True, use_cpu=True)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def quantisation_constants_bytes(model) -> int:
    """Bytes of bitsandbytes' scales kept beside the quantised parameters (not seen by MemTracker)."""
    import torch

    seen: dict[int, int] = {}  # a PEFT wrapper shows its base layer's weight too: count each tensor once
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        tensors = []
        if state is not None:
            tensors += [state.absmax, getattr(state, "code", None), getattr(state, "offset", None)]
            nested = getattr(state, "state2", None)
            if nested is not None:
                tensors += [nested.absmax, nested.code]
        tensors.append(getattr(weight, "SCB", None))
        for t in tensors:
            if isinstance(t, torch.Tensor):
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def run_one(name: str, model_dir: str) -> dict:
    import torch

    from leantune import SFTConfig, SFTTrainer

    quiet()
    label, init_kwargs, extra = CONFIGS[name]
    tokenizer = load_tokenizer()
    data = gsm8k_prompt_completion(limit=64, tokenizer=tokenizer, max_tokens=SETTINGS["max_length"])
    with tempfile.TemporaryDirectory() as out:
        trainer = SFTTrainer(model=model_dir, train_dataset=data, processing_class=tokenizer, peft_config=lora(),
                             args=SFTConfig(output_dir=out, model_init_kwargs=init_kwargs, **SETTINGS, **extra))
        constants = quantisation_constants_bytes(trainer.model)
        base_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if not p.requires_grad)
        start = time.perf_counter()
        metrics = trainer.train().metrics
        seconds = time.perf_counter() - start
    breakdown = trainer.memory_breakdown
    parts = {k: v / MIB for k, v in breakdown.parts.items()}
    return {
        "config": name, "label": label, "peak_mib": breakdown.peak_bytes / MIB, "parts_mib": parts,
        "constants_mib": constants / MIB, "frozen_params_mib": base_bytes / MIB,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "peak_rss_mib": peak_rss_bytes() / MIB, "train_loss": metrics["train_loss"], "seconds_2_steps": seconds,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json")
    parser.add_argument("--layers", type=int, default=MODEL["layers"], help="fewer layers for a quick check")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one config in this process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.model_dir)), flush=True)
        return
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        MODEL["layers"] = args.layers
        model = tiny_llama(seed=0, **MODEL)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        load_tokenizer().save_pretrained(folder)
        del model
        for name in names:
            proc = subprocess.run([sys.executable, __file__, "--one", name, "--model-dir", folder],
                                  capture_output=True, text=True, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{name} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print(f"{name}: peak {results[-1]['peak_mib']:.0f} MiB", file=sys.stderr, flush=True)
    rows = []
    for r in results:
        p = r["parts_mib"]
        split = "/".join(f"{p.get(k, 0):.0f}" for k in ("parameters", "gradients", "optimizer_states", "activations",
                                                          "temporaries"))
        rows.append([r["label"], f"{r['peak_mib']:,.0f}", f"{r['constants_mib']:.1f}", split,
                     f"{r['frozen_params_mib']:,.0f}",
                     f"{r['peak_rss_mib']:,.0f}", f"{r['train_loss']:.4f}"])
    print(f"Model: Llama {MODEL}, {n_params / 1e6:.0f}M parameters; LoRA r=16 on all linear layers; "
          f"batch {SETTINGS['per_device_train_batch_size']} x max_length {SETTINGS['max_length']}")
    print(f"{machine_description()}; {library_versions('transformers', 'peft', 'bitsandbytes', 'accelerate')}; "
          f"{source_state()}")
    print(markdown_table(["config", "step peak MiB (MemTracker)", "of it quant. constants MiB",
                          "parts P/G/O/A/T MiB", "frozen base MiB", "process peak RSS MiB", "train loss"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
