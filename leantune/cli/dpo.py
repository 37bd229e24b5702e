"""`leantune dpo`: Direct Preference Optimization; with no model and no dataset, the built-in demo run."""

from __future__ import annotations

from ..defaults.preferences import build_default_preference_dataset
from ..trainers.dpo_trainer import DPOTrainer
from .demos import apply_demo_settings, demo_model, sft_warm_up, train_and_save
from .runner import print_run_summary

# The demo: 1,600 bundled pairs, 100 optimizer steps of 16 pairs from a random-init 0.54M-parameter Llama.
DEMO_TRAINING = {
    "learning_rate": 5e-4,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    "num_train_epochs": 1,
    "max_steps": -1,
    "warmup_steps": 5,
    "lr_scheduler_type": "cosine",
    "beta": 0.1,
    "max_length": 64,
    "logging_steps": 10,
}
DEMO_PAIRS = {"train": 4800, "eval": 200}


def run_demo(args, model_args, explicit: set[str]) -> int:
    """Held-out reward accuracy and margin before and after DPO on bundled pairs (right vs wrong reversals)."""
    print("leantune dpo: no model or dataset given, so running the built-in demo (bundled pairs, small model).")
    apply_demo_settings(args, explicit, DEMO_TRAINING)
    data = build_default_preference_dataset(DEMO_PAIRS["train"], DEMO_PAIRS["eval"], seed=args.seed)
    tokenizer, model, peft_config = demo_model(model_args)
    print("stage 1: a short SFT warm-up on the chosen completions (150 steps); stage 2: DPO against it.")
    model = sft_warm_up(model, tokenizer, data["train"], args.seed)
    example = data["test"][0]
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; data: {len(data['train'])} "
          f"train / {len(data['test'])} held-out pairs, e.g. {example['prompt']!r}: chosen {example['chosen']!r}, "
          f"rejected {example['rejected']!r}")
    trainer = DPOTrainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["test"],
                         processing_class=tokenizer, peft_config=peft_config)
    before = trainer.evaluate()
    after = train_and_save(trainer, print_summary, lambda trainer: trainer.evaluate())
    print(f"held-out pairs ({len(data['test'])}): reward accuracy {before['eval_rewards/accuracies']:.1%} -> "
          f"{after['eval_rewards/accuracies']:.1%}, reward margin {before['eval_rewards/margins']:.3f} -> "
          f"{after['eval_rewards/margins']:.3f}, chosen log-prob {before['eval_logps/chosen']:.2f} -> "
          f"{after['eval_logps/chosen']:.2f}")
    return 0


def print_summary(trainer, result, seconds: float) -> None:
    """DPO's summary, and the first lines of KTO's and the reward model's."""
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    metrics = result.metrics
    lines = []
    if history:
        lines.append(f"loss: {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
        if "rewards/accuracies" in history[-1]:
            lines.append(f"train reward accuracy (last log): {history[-1]['rewards/accuracies']:.1%}, "
                         f"margin {history[-1]['rewards/margins']:.3f}")
    lines.append(f"real tokens/s: {metrics['real_tokens_per_second']:.1f}, padding fraction "
                 f"{metrics['padding_fraction']:.1%}")
    print_run_summary(trainer, result, seconds, lines)
