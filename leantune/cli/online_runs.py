"""What the online commands (`leantune grpo`, `rloo`, `online-dpo`, `ppo`) share: the built-in demo (an SFT warm-up,
then online RL with a checked answer as the reward) and the summary. Their --reward_funcs flag (reward functions or
reward models; PPO's stands for TRL's `reward_model`) is arguments.RewardArguments."""

from __future__ import annotations

import time

from ..defaults import as_prompts_with_answers, build_default_dataset, evaluate_exact_match
from ..rewards import resolve_reward_funcs
from .demos import apply_demo_settings, demo_model, supervised_warm_up
from .runner import print_run_summary

DEMO_TASK = "reverse"
DEMO_EXAMPLES = {"train": 3200, "eval": 200}
DEMO_WARM_UP = {"target_exact_match": 0.4, "max_steps": 400}
DEMO_REWARDS = ("correct_answer", "characters_in_place")
# From the warm-up of a random-init 0.54M-parameter Llama: 200 optimizer steps of 16 prompts x 8 completions (one
# epoch of the 3,200 bundled prompts). The method's own defaults stay (RLOO: beta 0.05, a frozen reference copy).
DEMO_TRAINING = {
    "learning_rate": 3e-4,
    "lr_scheduler_type": "constant",
    "per_device_train_batch_size": 128,
    "per_device_eval_batch_size": 64,
    "num_generations": 8,
    "max_completion_length": 8,
    "temperature": 1.0,
    "num_train_epochs": 1,
    "max_steps": -1,
    "logging_steps": 10,
}
# Each method's own demo settings over those.
# Online DPO: a batch counts prompts, each with a pair of completions (TRL's meaning): 100 steps of 32 pairs, TRL's
# beta 0.1; of learning rates 3e-4, 1e-4 and 3e-5 on this warm-up, 1e-4 raised held-out greedy exact match the most.
# PPO: one completion per prompt (the value function is the baseline), each round trained num_ppo_epochs times.
DEMO_METHOD_TRAINING = {
    "online-dpo": {"learning_rate": 1e-4, "per_device_train_batch_size": 32, "num_generations": 2,
                   "max_new_tokens": 8},
    "ppo": {"num_generations": 1, "num_ppo_epochs": 2, "learning_rate": 3e-4, "vf_coef": 0.5, "kl_coef": 0.02},
}
# Fields of the shared settings a method does not take under that name (Online DPO's is max_new_tokens).
DEMO_FIELDS_LEFT_OUT = {"online-dpo": ("max_completion_length",)}


def demo_training(command: str) -> dict:
    shared = {k: v for k, v in DEMO_TRAINING.items() if k not in DEMO_FIELDS_LEFT_OUT.get(command, ())}
    return {**shared, **DEMO_METHOD_TRAINING.get(command, {})}


def run_demo(method, args, model_args, reward_args, explicit) -> int:
    """Held-out exact match (greedy) and sampled reward before and after online RL on a bundled task."""
    command = method.command

    print(f"leantune {command}: no model or dataset given, so running the built-in demo (bundled task with a checked "
          "answer, small model).")
    apply_demo_settings(args, explicit, demo_training(command))
    reward_funcs = resolve_reward_funcs(reward_args.reward_funcs or list(DEMO_REWARDS))
    data = build_default_dataset(DEMO_EXAMPLES["train"], DEMO_EXAMPLES["eval"], seed=args.seed, task=DEMO_TASK)
    tokenizer, model, peft_config = demo_model(model_args)
    target = DEMO_WARM_UP["target_exact_match"]
    print(f"stage 1: SFT warm-up until held-out exact match reaches {target:.0%} (at most "
          f"{DEMO_WARM_UP['max_steps']} steps), so that some sampled answers are right; stage 2: "
          f"{command.upper()} with the answer checked as the reward.")
    model = supervised_warm_up(model, tokenizer, data["train"], args.seed, max_steps=DEMO_WARM_UP["max_steps"],
                               held_out=data["test"], target_exact_match=target)
    example = data["test"][0]
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; prompts: "
          f"{len(data['train'])} train / {len(data['test'])} held-out, e.g. {example['prompt']!r} -> answer "
          f"{example['completion'].strip()!r}; rewards: {', '.join(getattr(f, '__name__', str(f)) for f in reward_funcs)}")
    trainer = method.trainer_class(model=model, reward_funcs=reward_funcs, args=args,
                            train_dataset=as_prompts_with_answers(data["train"]),
                            eval_dataset=as_prompts_with_answers(data["test"]), processing_class=tokenizer,
                            peft_config=peft_config)
    greedy_before = evaluate_exact_match(trainer.model, tokenizer, data["test"])["exact_match"]
    sampled_before = trainer.evaluate()["eval_reward"]
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    sampled_after = trainer.evaluate()["eval_reward"]
    after = evaluate_exact_match(trainer.model, tokenizer, data["test"])
    trainer.save_model(args.output_dir)
    print_summary(trainer, result, seconds)
    print(f"held-out prompts ({len(data['test'])}): sampled reward (x{args.eval_num_generations}, temperature "
          f"{args.temperature}) {sampled_before:.3f} -> {sampled_after:.3f}; greedy exact match "
          f"{greedy_before:.1%} -> {after['exact_match']:.1%}")
    for prompt, expected, got in after["examples"][:3]:
        print(f"  {prompt!r}: expected {expected!r}, got {got!r}")
    return 0


def print_summary(trainer, result, seconds: float) -> None:
    history = [entry for entry in trainer.state.log_history if "reward" in entry and "eval_reward" not in entry]
    lines = []
    if history:
        first, last = history[0], history[-1]
        lines.append(f"train reward (logged mean): {first['reward']:.3f} at step {first['step']} -> "
                     f"{last['reward']:.3f} at step {last['step']}")
        for name in trainer.rewards.names:
            key = f"rewards/{name}/mean"
            if key in first and key in last:
                lines.append(f"  {name}: {first[key]:.3f} -> {last[key]:.3f}")
        lines.append(f"completion length (mean tokens): {first['completions/mean_length']:.1f} -> "
                     f"{last['completions/mean_length']:.1f}")
        if "rewards/accuracies" in first:  # Online DPO: the implicit rewards beta x log(pi / ref) of each pair
            lines.append(f"chosen over rejected (implicit reward): accuracy {first['rewards/accuracies']:.3f} -> "
                         f"{last['rewards/accuracies']:.3f}, margin {first['rewards/margins']:.3f} -> "
                         f"{last['rewards/margins']:.3f}")
    counts = {k: v for k, v in result.metrics.items() if k.startswith("count/")}
    if counts:
        lines.append(f"counted decisions: {counts}")
    print_run_summary(trainer, result, seconds, lines)
