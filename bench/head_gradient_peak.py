"""The step peak of a full fine-tune whose tied head is large beside the rest (vocabulary 151,936 x hidden 256, two
layers, fp32), measured at the CPU allocator (devkit/allocator_meter.py: torch.profiler's memory events, no code
shared with the chunked head or MemTracker). Run it at two commits to compare what the head's backward holds.

    PYTHONPATH=. python bench/head_gradient_peak.py
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    import leantune
    from devkit.allocator_meter import AllocatorMeter
    from leantune.defaults import build_default_tokenizer

    torch.manual_seed(0)
    vocab, hidden = 151936, 256
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    ids = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, vocab, (256,), generator=ids).tolist()} for _ in range(4)]
    args = leantune.SFTConfig(output_dir="/tmp/leantune-head-gradient-peak", per_device_train_batch_size=2,
                              max_steps=2, use_cpu=True, report_to=[], save_strategy="no", learning_rate=1e-5,
                              max_length=256, memory_breakdown=False, disable_tqdm=True)
    trainer = leantune.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                  processing_class=build_default_tokenizer())
    meter = AllocatorMeter(step=1)
    with meter.profiling(trainer):
        trainer.train()
    print(f"step peak {meter.peak_bytes / 2**20:.1f} MiB (the head's weight: {vocab * hidden * 4 / 2**20:.1f} MiB); "
          f"train_loss {trainer.state.log_history[-1]['train_loss']:.6f}")


if __name__ == "__main__":
    main()
