"""Optimizer-state memory of a full fine-tune, planned and measured on CPU: AdamW, its step inside the backward
(`optimizer_in_backward`), bitsandbytes' 8-bit AdamW, and both together.

Each row trains a small real model (random weights) for two optimizer steps; the second is measured by leantune's
MemTracker breakdown and by the CPU allocator (devkit/allocator_meter.py), and `plan_memory` predicts it with fake
weights (bench/plan_accuracy.py's row runner). Gradient clipping is off in every row (`max_grad_norm=0`), so the
rows without the step inside the backward are the same training as those with it.

    PYTHONPATH=. OMP_NUM_THREADS=2 python bench/optimizer_states.py [--hidden 64] [--batch 1] [--max-length 32]

What to read: `gradients` (planned) falls to about the largest parameter's gradient with the step inside the
backward; `optimizer_states` (planned) falls from 8 bytes per parameter (AdamW's two fp32 moments) to ~2 bytes plus
bitsandbytes' per-block scales with 8-bit states (parameters under its 4,096-value minimum and Trainer's embeddings
keep fp32 states). Paged 8-bit AdamW (`paged_adamw_8bit`) pages to host memory on CUDA only: on CPU bitsandbytes warns
and runs it unpaged, the same as `adamw_bnb_8bit`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import TOKENIZER_DIR, quiet  # noqa: E402

MIB = 1024 * 1024
OFF = {"max_grad_norm": 0.0}
ROWS = [
    ("adamw", {**OFF}),
    ("adamw in backward", {**OFF, "optimizer_in_backward": True}),
    ("adamw 8-bit", {**OFF, "optim": "adamw_bnb_8bit"}),
    ("adamw 8-bit in backward", {**OFF, "optim": "adamw_bnb_8bit", "optimizer_in_backward": True}),
]


def model_config(opts):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=2 * opts.hidden,
                       num_hidden_layers=opts.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def run_row(fields: dict, opts, tokenizer) -> dict:
    """The plan of the row's second step and its measures in a real run (MemTracker, the CPU allocator)."""
    import contextlib
    import io

    import torch
    from transformers import AutoModelForCausalLM

    from bench.plan_accuracy import data
    from devkit.allocator_meter import AllocatorMeter
    from leantune import SFTConfig, SFTTrainer
    from leantune.planning import plan_memory

    fields = dict(per_device_train_batch_size=opts.batch, max_steps=2, seed=0, learning_rate=1e-4,
                  max_length=opts.max_length, loss_chunk_size=opts.loss_chunk_size, **fields)
    dataset = data("sft", 64)
    plan = plan_memory(model_config(opts), dataset, "sft", processing_class=tokenizer, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(opts))
    args = SFTConfig(output_dir="/tmp/leantune-optimizer-states", use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True, logging_steps=1, memory_breakdown=True, **fields)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    allocator = AllocatorMeter()
    with contextlib.redirect_stdout(io.StringIO()), allocator.profiling(trainer):
        trainer.train()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return {"planned": plan.measured_step.peak_bytes, "memtracker": trainer.memory_breakdown.peak_bytes,
            "allocator": allocator.peak_bytes, "parts": plan.measured_step.parts,
            "measured_parts": trainer.memory_breakdown.parts, "largest_parameter": largest,
            "parameters": sum(p.numel() for p in model.parameters()), "loss": trainer.state.log_history[-2]["loss"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--loss-chunk-size", type=int, default=8, help="small: the step peaks where gradients live")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--only", default=None, help="rows whose name holds this")
    opts = parser.parse_args(argv)
    quiet()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    print(f"llama, hidden {opts.hidden}, {opts.layers} layers, vocabulary {opts.vocab}, fp32, batch {opts.batch} x <={opts.max_length} tokens")
    print(f"{'row':<24} {'planned':>8} {'MemTracker':>10} {'allocator':>9} {'plan/alloc':>10} "
          f"{'grads':>7} {'states':>7} {'B/param':>7} {'loss':>10}  (MiB)")
    for name, fields in ROWS:
        if opts.only and opts.only not in name:
            continue
        row = run_row(fields, opts, tokenizer)
        parts = row["parts"]
        print(f"{name:<24} {row['planned'] / MIB:>8.2f} {row['memtracker'] / MIB:>10.2f} {row['allocator'] / MIB:>9.2f} "
              f"{row['planned'] / row['allocator'] - 1:>+10.2%} {parts.get('gradients', 0) / MIB:>7.2f} "
              f"{parts.get('optimizer_states', 0) / MIB:>7.2f} "
              f"{parts.get('optimizer_states', 0) / row['parameters']:>7.2f} {row['loss']:>10.6f}")
    print(f"largest parameter: {row['largest_parameter'] / MIB:.2f} MiB; parameters: {row['parameters']:,}")


if __name__ == "__main__":
    main()
