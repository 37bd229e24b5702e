"""Ops launched around the loss in one SFT and one DPO step, and the step's CPU time: the proxy for a GPU's launches.

    python bench/loss_launches.py [--layers 2] [--tokens 1024] [--repeats 3] [--tiny]

The ops are counted as torch dispatches them (devkit/loss_ops.py): everything of one `training_step` but the model's
decoder (the head, the loss, their backward, the metrics and the normalisation), views and allocations left out;
`syncs` counts the `.item()`-like host reads in that region (a GPU waits at each). The model is Qwen2.5-0.5B's shape
(hidden 896, vocabulary 151,936: the head's chunks are bench/real_shapes.py's, 110 rows on CPU) with `--layers`
decoder layers (the body is not what is counted; fewer layers keep the timing on the head), random fp32 weights; SFT
trains one row of `--tokens` random ids, DPO one pair of `--tokens` / 2 each. The time is the fastest of `--repeats`
`training_step` calls (forward, loss, backward; no optimizer step). `--tiny`: tests/fixtures' 2-layer, hidden-64,
32k-vocabulary model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import TOKENIZER_DIR  # noqa: E402
from devkit.loss_ops import loss_region_ops  # noqa: E402
from devkit.qwen2_shape import qwen2_config  # noqa: E402


def model_of(opts):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if opts.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.fixtures.models import tiny_model

        return tiny_model()
    return AutoModelForCausalLM.from_config(qwen2_config(layers=opts.layers)).float()


def rows(vocab: int, tokens: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (tokens,), generator=generator).tolist()


def trainers(opts, tokenizer, output_dir: str):
    from leantune import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    common = dict(output_dir=output_dir, report_to=[], save_strategy="no", use_cpu=True, max_steps=1,
                  per_device_train_batch_size=1, memory_breakdown=False, disable_tqdm=True, seed=0,
                  max_length=opts.tokens, gradient_checkpointing=False)
    model = model_of(opts)
    vocab = model.config.vocab_size
    sft_rows = Dataset.from_list([{"input_ids": rows(vocab, opts.tokens, 1)}])
    sft = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=sft_rows, args=SFTConfig(**common))
    half = opts.tokens // 2
    pairs = Dataset.from_list([{"prompt_input_ids": rows(vocab, 8, 2), "chosen_input_ids": rows(vocab, half - 8, 3),
                                "rejected_input_ids": rows(vocab, half - 8, 4)}])
    dpo = DPOTrainer(model=model_of(opts), processing_class=tokenizer, train_dataset=pairs,
                     args=DPOConfig(**common))
    return {"SFT": sft, "DPO": dpo}


def step_seconds(trainer, batch, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.training_step(trainer.model, batch)
        best = min(best, time.perf_counter() - start)
        trainer.model.zero_grad(set_to_none=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    opts = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    print("| step | ops around the loss | syncs | head chunks | step time (s, CPU) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as output_dir:
        for name, trainer in trainers(opts, tokenizer, output_dir).items():
            batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[0]]))
            counted = loss_region_ops(trainer, dict(batch))
            head = trainer.logprobs.head_of(trainer.model)
            seconds = step_seconds(trainer, dict(batch), opts.repeats)
            print(f"| {name} | {counted.count} | {counted.syncs} | {trainer.logprobs.chunk_rows[head.vocab_size]} rows "
                  f"a chunk | {seconds:.3f} |")
            print(f"<!-- {name} ops: {dict(counted.by_name.most_common())} -->")


if __name__ == "__main__":
    main()
