"""`leantune kto`: Kahneman-Tversky Optimization; with no model and no dataset, the built-in demo run.

Preference pairs given with --dataset_name are unpaired automatically (chosen: desirable, rejected: undesirable).
"""

from __future__ import annotations

import torch

from ..defaults.preferences import build_default_preference_dataset, unpaired
from ..trainers.kto_trainer import KTOTrainer
from ..trainers.parts.batches import placed
from .demos import apply_demo_settings, demo_model, sft_warm_up, train_and_save
from .dpo import DEMO_TRAINING as DPO_DEMO_TRAINING
from .dpo import print_summary as print_preference_summary

# The demo: 2,400 bundled pairs unpaired into 4,800 examples, 300 optimizer steps of 16 from the SFT warm-up of a
# random-init 0.54M-parameter Llama: DPO's demo settings, logged every 25 steps.
DEMO_TRAINING = {**DPO_DEMO_TRAINING, "logging_steps": 25}
DEMO_PAIRS = {"train": 2400, "eval": 200}


def run_demo(args, model_args, explicit: set[str]) -> int:
    """Held-out reward margin and pairwise reward accuracy before and after KTO on bundled examples (right vs wrong
    reversals, unpaired)."""
    print("leantune kto: no model or dataset given, so running the built-in demo (bundled examples, small model).")
    apply_demo_settings(args, explicit, DEMO_TRAINING)
    data = build_default_preference_dataset(DEMO_PAIRS["train"], DEMO_PAIRS["eval"], seed=args.seed)
    train = unpaired(data["train"], seed=args.seed)
    tokenizer, model, peft_config = demo_model(model_args)
    print("stage 1: a short SFT warm-up on the desirable completions (150 steps); stage 2: KTO against it.")
    model = sft_warm_up(model, tokenizer, data["train"], args.seed)
    example = train[0]
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; data: {len(train)} unpaired "
          f"train examples, {len(data['test'])} held-out pairs (unpaired automatically), e.g. {example['prompt']!r} "
          f"-> {example['completion']!r}: {'desirable' if example['label'] else 'undesirable'}")
    trainer = KTOTrainer(model=model, args=args, train_dataset=train, eval_dataset=data["test"],
                         processing_class=tokenizer, peft_config=peft_config)
    before = evaluate_pairs(trainer)
    after = train_and_save(trainer, print_summary, evaluate_pairs)
    print(f"held-out pairs ({len(data['test'])}): reward accuracy {before['accuracy']:.1%} -> "
          f"{after['accuracy']:.1%}, reward margin (desirable - undesirable) {before['eval_rewards/margins']:.3f} -> "
          f"{after['eval_rewards/margins']:.3f}, desirable log-prob {before['eval_logps/chosen']:.2f} -> "
          f"{after['eval_logps/chosen']:.2f}, undesirable log-prob {before['eval_logps/rejected']:.2f} -> "
          f"{after['eval_logps/rejected']:.2f}")
    return 0


def evaluate_pairs(trainer) -> dict:
    return {**trainer.evaluate(), "accuracy": held_out_pair_accuracy(trainer)}


@torch.no_grad()
def held_out_pair_accuracy(trainer) -> float:
    """Share of held-out pairs whose desirable completion gets the higher implicit reward beta * (log pi - log ref).

    The eval set holds pairs unpaired in order (chosen then rejected, side by side); ties (policy == reference)
    count as wrong.
    """
    dataset = trainer.eval_dataset
    labels = dataset["label"]
    if len(labels) % 2 or any(bool(labels[i]) != (i % 2 == 0) for i in range(len(labels))):
        raise ValueError("held-out pair accuracy needs the held-out pairs side by side (none dropped).")
    model = trainer.model
    was_training = model.training
    model.eval()
    rewards = []
    try:
        size = trainer.args.per_device_eval_batch_size
        for start in range(0, len(dataset), size):
            batch = placed(trainer, trainer.data_collator([dataset[i] for i in range(start,
                                                                     min(start + size, len(dataset)))]))
            ref_logps, _ = trainer.reference_logps(batch)
            policy = trainer.sequence_logps(model, batch)
            rewards.append(trainer.args.beta * (policy - ref_logps.to(policy.device)))
    finally:
        model.train(was_training)
    rewards = torch.cat(rewards).view(-1, 2)
    return float((rewards[:, 0] > rewards[:, 1]).float().mean())


def print_summary(trainer, result, seconds: float) -> None:
    print_preference_summary(trainer, result, seconds)
    history = [entry for entry in trainer.state.log_history if "loss" in entry and "rewards/margins" in entry]
    if history:
        first, last = history[0], history[-1]
        print(f"train reward margin (desirable - undesirable): {first['rewards/margins']:.3f} -> "
              f"{last['rewards/margins']:.3f}; KL reference point {first.get('kl', 0.0):.3f} -> "
              f"{last.get('kl', 0.0):.3f}")
