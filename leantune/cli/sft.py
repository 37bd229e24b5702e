"""`leantune sft`: fine-tune a model on a dataset; with no model and no dataset, the built-in demo run."""

from __future__ import annotations

import logging
import os
import time

from .arguments import peft_config_from
from .runner import run_method

logger = logging.getLogger("leantune.cli")

DEMO_OUTPUT_DIR = "leantune-output/sft-demo"


def run(argv: list[str]) -> int:
    return run_method("sft", argv)


def run_demo(sft_args, model_args, explicit: set[str]) -> int:
    """Train a small model from scratch on bundled data, and show it learned: exact match before vs after."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..defaults import (
        DEFAULT_TRAINING,
        build_default_dataset,
        build_default_model_config,
        build_default_tokenizer,
        evaluate_exact_match,
    )
    from ..trainers.sft_trainer import SFTTrainer

    print("leantune sft: no model or dataset given, so running the built-in demo (bundled data, small model).")
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # A model this small gains little from a second thread, and OpenMP threads that spin-wait on cores
        # shared with other work can make a step ten times slower.
        torch.set_num_threads(1)
    settings = dict(DEFAULT_TRAINING)
    num_train, num_eval = settings.pop("num_train"), settings.pop("num_eval")
    settings.setdefault("output_dir", DEMO_OUTPUT_DIR)
    settings.setdefault("save_strategy", "no")
    settings.setdefault("logging_first_step", True)
    for name, value in settings.items():
        if name not in explicit:
            setattr(sft_args, name, value)
    sft_args.__post_init__()  # re-derive settings that depend on the fields set above
    torch.manual_seed(sft_args.seed)

    tokenizer = build_default_tokenizer()
    data = build_default_dataset(num_train, num_eval, seed=sft_args.seed)
    model = AutoModelForCausalLM.from_config(build_default_model_config(tokenizer))
    peft_config = peft_config_from(model_args)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"data: {len(data['train'])} train / {len(data['test'])} held-out examples, e.g. "
          f"{data['test'][0]['prompt']!r} -> {data['test'][0]['completion']!r}")

    before = evaluate_exact_match(model, tokenizer, data["test"])
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=data["train"], processing_class=tokenizer,
                         peft_config=peft_config)
    started = time.perf_counter()
    result = trainer.train()
    trainer.save_model(sft_args.output_dir)
    after = evaluate_exact_match(trainer.model, tokenizer, data["test"])
    print_summary(trainer, result, time.perf_counter() - started)
    print(f"held-out exact match: {before['exact_match']:.1%} before -> {after['exact_match']:.1%} after "
          f"({after['num_examples']} examples)")
    for prompt, expected, got in after["examples"][:3]:
        print(f"  {prompt!r}: expected {expected!r}, got {got!r}")
    return 0


def print_summary(trainer, result, seconds: float) -> None:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    metrics = result.metrics
    lines = [
        "",
        "=== leantune sft summary ===",
        f"steps: {trainer.state.global_step} in {seconds:.1f} s",
        f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "loss: (not logged)",
        f"real tokens/s: {metrics['real_tokens_per_second']:.1f} ({metrics['real_tokens']} real tokens)",
        f"padding fraction: {metrics['padding_fraction']:.1%}",
        f"peak memory: {metrics['peak_memory_mb']:.0f} MiB ({metrics['peak_memory_kind']})",
        f"model saved to: {trainer.args.output_dir}",
    ]
    print("\n".join(lines))
