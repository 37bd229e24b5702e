"""`leantune reward`: train a reward model on preference pairs; with no model and no dataset, the built-in demo run."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from ..defaults import build_default_model_config, build_default_tokenizer
from ..defaults.preferences import build_default_preference_dataset
from ..models.checkpointing import set_checkpointing
from ..trainers.reward_trainer import RewardTrainer
from .arguments import peft_config_from
from .demos import apply_demo_settings, sft_warm_up, train_and_save
from .dpo import print_summary as print_preference_summary

# The demo: 2 epochs of 32-pair steps (300 optimizer steps) over 4,800 bundled pairs.
DEMO_TRAINING = {
    "learning_rate": 1e-3,
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 64,
    "num_train_epochs": 2,
    "max_steps": -1,
    "warmup_steps": 10,
    "lr_scheduler_type": "cosine",
    "max_length": 64,
    "logging_steps": 25,
}
DEMO_PAIRS = {"train": 4800, "eval": 400}
DEMO_WARM_UP_STEPS = 300
DEMO_NEW_LAYERS = 2


def run_demo(args, model_args, explicit: set[str]) -> int:
    """Held-out pairwise accuracy before (chance) and after training on bundled pairs (right vs wrong reversals)."""
    print("leantune reward: no model or dataset given, so running the built-in demo (bundled pairs, small model).")
    if not explicit & {"gradient_checkpointing", "activation_checkpointing"}:
        # a 1M-parameter model's activations are tiny: recomputing only costs time (the name this transformers reads)
        set_checkpointing(args, False)
    apply_demo_settings(args, explicit, DEMO_TRAINING)
    data = build_default_preference_dataset(DEMO_PAIRS["train"], DEMO_PAIRS["eval"], seed=args.seed)
    print(f"stage 1: a short SFT warm-up on the chosen completions ({DEMO_WARM_UP_STEPS} steps); stage 2: a reward "
          f"model on its frozen backbone, with {DEMO_NEW_LAYERS} new layers and a reward head trained on the pairs.")
    tokenizer, model = demo_reward_model(data["train"], args.seed)
    example = data["test"][0]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters ({trainable / 1e6:.2f}M "
          f"trained), one reward output; data: {len(data['train'])} train / {len(data['test'])} held-out pairs, e.g. "
          f"{example['prompt']!r}: chosen {example['chosen']!r}, rejected {example['rejected']!r}")
    trainer = RewardTrainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["test"],
                            processing_class=tokenizer, peft_config=peft_config_from(model_args))
    before = trainer.evaluate()
    after = train_and_save(trainer, print_summary, lambda trainer: trainer.evaluate())
    print(f"held-out pairs ({len(data['test'])}): pairwise accuracy {before['eval_accuracy']:.1%} -> "
          f"{after['eval_accuracy']:.1%}, reward margin {before['eval_margin']:.3f} -> {after['eval_margin']:.3f}")
    return 0


def demo_reward_model(pairs, seed: int):
    """The SFT demo's character tokenizer and small Llama, warmed up by SFT, as a reward model.

    Judging a reversal means comparing every answer letter with the prompt and then combining the comparisons at the
    last token; a random 2-layer model barely learns that from one bit per pair in a few minutes (~60% held-out). So
    the backbone first learns the task by SFT (which reads each letter of the prompt in the right place); it is then
    frozen, and new layers on top learn to compare and combine, with the reward head.
    """
    tokenizer = build_default_tokenizer()
    config = build_default_model_config(tokenizer)
    language_model = sft_warm_up(AutoModelForCausalLM.from_config(config), tokenizer, pairs, seed,
                                 steps=DEMO_WARM_UP_STEPS)
    warm_layers = config.num_hidden_layers
    config.num_labels = 1
    config.tie_word_embeddings = False  # a reward model has no output embeddings to tie
    config.num_hidden_layers = warm_layers + DEMO_NEW_LAYERS
    model = AutoModelForSequenceClassification.from_config(config)
    backbone = {k: v for k, v in language_model.model.state_dict().items() if not k.startswith("norm.")}
    model.model.load_state_dict(backbone, strict=False)
    for module in (model.model.embed_tokens, *model.model.layers[:warm_layers]):
        module.requires_grad_(False)
    return tokenizer, model


def print_summary(trainer, result, seconds: float) -> None:
    print_preference_summary(trainer, result, seconds)
    history = [entry for entry in trainer.state.log_history if "loss" in entry and "accuracy" in entry]
    if history:
        print(f"train pairwise accuracy (first -> last log): {history[0]['accuracy']:.1%} -> "
              f"{history[-1]['accuracy']:.1%}, margin {history[-1]['margin']:.3f}")
