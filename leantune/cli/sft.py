"""`leantune sft`: fine-tune a model on a dataset; with no model and no dataset, the built-in demo run."""

from __future__ import annotations

from ..defaults import DEFAULT_TRAINING, RUN_ONLY_KEYS, build_default_dataset, evaluate_exact_match
from ..trainers.sft_trainer import SFTTrainer
from .demos import apply_demo_settings, demo_model, train_and_save
from .runner import print_run_summary


def run_demo(sft_args, model_args, explicit: set[str]) -> int:
    """Train a small model from scratch on bundled data, and show it learned: exact match before vs after."""
    print("leantune sft: no model or dataset given, so running the built-in demo (bundled data, small model).")
    training = {name: value for name, value in DEFAULT_TRAINING.items() if name not in RUN_ONLY_KEYS}
    apply_demo_settings(sft_args, explicit, training)
    data = build_default_dataset(DEFAULT_TRAINING["num_train"], DEFAULT_TRAINING["num_eval"], seed=sft_args.seed)
    tokenizer, model, peft_config = demo_model(model_args)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"data: {len(data['train'])} train / {len(data['test'])} held-out examples, e.g. "
          f"{data['test'][0]['prompt']!r} -> {data['test'][0]['completion']!r}")

    before = evaluate_exact_match(model, tokenizer, data["test"])
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=data["train"], processing_class=tokenizer,
                         peft_config=peft_config)
    after = train_and_save(trainer, print_summary,
                           lambda trainer: evaluate_exact_match(trainer.model, tokenizer, data["test"]))
    print(f"held-out exact match: {before['exact_match']:.1%} before -> {after['exact_match']:.1%} after "
          f"({after['num_examples']} examples)")
    for prompt, expected, got in after["examples"][:3]:
        print(f"  {prompt!r}: expected {expected!r}, got {got!r}")
    return 0


def print_summary(trainer, result, seconds: float) -> None:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    metrics = result.metrics
    print_run_summary(trainer, result, seconds, [
        f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "loss: (not logged)",
        f"real tokens/s: {metrics['real_tokens_per_second']:.1f} ({metrics['real_tokens']} real tokens)",
        f"padding fraction: {metrics['padding_fraction']:.1%}",
    ])
