"""The step peak with and without the sequence-tiled MLP (`tiled_mlp`), measured at the CPU allocator
(devkit/allocator_meter.py: torch.profiler's memory events, no code shared with memory/tiled_mlp.py or MemTracker).

Qwen2.5-0.5B's real shape (hidden 896, intermediate 4,864, 14/2 heads, vocabulary 151,936; random weights) with a
few of its layers, LoRA r=16 on every linear layer, gradient checkpointing on, one row of 8,192 tokens, fp32 on CPU.
The untiled backward holds a layer's recompute with several [8,192, 4,864] fp32 intermediates (152 MiB each); tiled,
one tile's. The first optimizer step is measured; each run is one SFT step in its own trainer, same data and seed.

    PYTHONPATH=. python bench/tiled_mlp.py [--tokens 8192] [--layers 2] [--tiles 0,1024]   (0: untiled)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20


def step_peak(tokens: int, layers: int, tile: int) -> tuple[int, float, float]:
    """(the measured step's peak bytes, its train loss, seconds) of one SFT step; `tile` 0: untiled."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import Qwen2ForCausalLM

    import leantune
    from devkit.allocator_meter import AllocatorMeter
    from devkit.qwen2_shape import QWEN25_05B, qwen2_config
    from leantune.defaults import build_default_tokenizer

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(layers=layers))
    ids = torch.randint(3, QWEN25_05B["vocab"], (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    tiling = dict(tiled_mlp=True, tiled_mlp_tile_size=tile) if tile else {}
    args = leantune.SFTConfig(output_dir="/tmp/leantune-bench-tiled-mlp", per_device_train_batch_size=1, max_steps=1,
                              use_cpu=True, report_to=[], save_strategy="no", learning_rate=1e-4, max_length=tokens,
                              memory_breakdown=False, disable_tqdm=True, max_grad_norm=0.0, seed=0, **tiling)
    trainer = leantune.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"input_ids": ids}]),
                                  processing_class=build_default_tokenizer(),
                                  peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    meter = AllocatorMeter(step=0)
    start = time.perf_counter()
    with meter.profiling(trainer):
        trainer.train()
    seconds = time.perf_counter() - start
    return meter.peak_bytes, trainer.state.log_history[-1]["train_loss"], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tiles", default="0,1024", help="tile sizes to run, comma-separated; 0 = untiled")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from leantune.memory.tiled_mlp import MIN_TILE_TOKENS

    rows = [(tile, *step_peak(options.tokens, options.layers, tile)) for tile in map(int, options.tiles.split(","))]
    untiled = next((peak for tile, peak, _, _ in rows if tile == 0), None)
    print(f"Qwen2.5-0.5B shape, {options.layers} layers, LoRA r=16, {options.tokens:,} tokens, fp32 CPU "
          f"(the rule's CPU floor: {MIN_TILE_TOKENS['cpu']} tokens)")
    print("| tiled_mlp_tile_size | step peak (MiB) | vs untiled | train loss | seconds |")
    print("|---|---|---|---|---|")
    for tile, peak, loss, seconds in rows:
        ratio = f"{peak / untiled:.3f}x" if untiled else "-"
        print(f"| {tile or 'untiled'} | {peak / MIB:,.1f} | {ratio} | {loss:.6f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
