"""PPO's four networks (policy, value, reference, reward), measured: leantune's layouts side by side in one process.

    python bench/ppo.py [--steps 3] [--json ppo.json]

TRL 1.16 (installed) has no PPO; its last PPOTrainer (trl 0.19-0.2x) cannot be imported beside it under the same
package name, and a separate environment would not be "one process, same settings", so TRL's side is computed on
paper from the same settings (docs/ppo.md, docs/benchmarks.md).

Model: a small Llama (hidden 256, 4 layers, the Mistral tokenizer's 32,000 vocabulary; bench/common.py tiny_llama),
fp32, random init from a fixed seed; the reward model and the separate value model are sequence-classification
models of the same shape. Prompts: GSM8K questions in order; every completion has exactly 64 tokens
(min_new_tokens), 8 completions per optimizer step, one PPO epoch per round (each step generates), use_cpu.

Per layout: the bytes of each network's parameters, the trainable ones' gradients and AdamW states; the memory meter
(leantune.metrics.memory_breakdown.StepMemoryMeter, PyTorch's MemTracker) over the rollout's scoring of the second
round (generation-time log-probs and values, reference log-probs, reward model: `scored_batches`) and over the
second optimizer step (MemoryBreakdownCallback); peak RSS of the whole train() call.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    MIB,
    gsm8k_prompt_completion,
    library_versions,
    load_tokenizer,
    machine_description,
    markdown_table,
    peak_rss_bytes,
    quiet,
    release_memory,
    reset_peak_rss,
    tiny_llama,
)

COMPLETION_TOKENS = 64
BATCH = 8


def reward_like(policy):
    """A sequence-classification model of the policy's shape (score head: 1 output)."""
    from transformers import LlamaForSequenceClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    import torch

    torch.manual_seed(7)
    return LlamaForSequenceClassification(config)


def layouts(policy_dir: str, policy):
    from peft import LoraConfig

    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    return {
        "value head on the policy's body, frozen reference copy": {},
        "separate value model (TRL's layout), frozen reference copy": {"value_model": reward_like(policy)},
        "LoRA: one frozen base, adapter + value head, reference = adapter off": {"peft_config": lora},
        "value head on the body, full logits (chunked_loss=False)": {"config": {"chunked_loss": False}},
    }


def parameter_bytes(module, trainable: bool | None = None) -> int:
    if module is None:
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if trainable is None or p.requires_grad == trainable)


def run_layout(name: str, spec: dict, policy_dir: str, reward_dir: str, prompts, steps: int) -> dict:
    from leantune import PPOConfig, PPOTrainer
    from leantune.metrics.memory_breakdown import StepMemoryMeter
    from leantune.models.output_head import unwrap_model

    settings = dict(output_dir=tempfile.mkdtemp(), report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                    per_device_train_batch_size=BATCH, max_completion_length=COMPLETION_TOKENS, max_steps=steps,
                    num_ppo_epochs=1, temperature=1.0, learning_rate=1e-5, seed=42, shuffle_dataset=False,
                    logging_steps=1, memory_breakdown=True,
                    generation_kwargs={"min_new_tokens": COMPLETION_TOKENS})
    settings.update(spec.get("config", {}))
    trainer = PPOTrainer(args=PPOConfig(**settings), model=policy_dir, reward_model=reward_dir,
                         train_dataset=prompts, value_model=spec.get("value_model"),
                         peft_config=spec.get("peft_config"))
    meter, rollout = StepMemoryMeter("cpu"), {}
    original = trainer.rounds.scored_batches

    def measured(*args, **kwargs):
        watch = trainer.generation.rounds_generated == 2
        if watch:
            meter.start(trainer.model, trainer.optimizer)
        try:
            return original(*args, **kwargs)
        finally:
            if watch:
                rollout["breakdown"] = meter.stop(trainer.state.global_step)

    trainer.rounds.scored_batches = measured
    release_memory()
    reset_peak_rss()
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    value = trainer.value_function
    policy = unwrap_model(trainer.model)
    reward = trainer.rewards.funcs[0]
    value_bytes = parameter_bytes(value)
    policy_total = parameter_bytes(trainer.model) - value_bytes
    trainable = parameter_bytes(trainer.model, True)
    metrics = result.metrics
    row = {
        "layout": name,
        "policy_mib": policy_total / MIB,
        "value_mib": value_bytes / MIB,
        "reference_mib": parameter_bytes(trainer.ref_model) / MIB,
        "reward_mib": parameter_bytes(reward) / MIB,
        "trainable_mib": trainable / MIB,
        "grads_and_adam_mib": 3 * trainable / MIB,  # fp32 gradient + AdamW's two moments
        "rollout_scoring_peak_mib": rollout["breakdown"].peak_bytes / MIB,
        "update_peak_mib": metrics["memory_step_peak_mb"],
        "update_activations_mib": metrics["memory_activations_mb"],
        "update_temporaries_mib": metrics["memory_temporaries_mb"],
        "peak_rss_mib": peak_rss_bytes() / MIB,
        "seconds": seconds,
        "adapter_reference": trainer.uses_adapter_as_reference,
        "policy_body_shared": trainer.reads_hidden_states and policy is not None,
    }
    trainer = None  # noqa: F841 (released before the next layout)
    release_memory()
    return row


def trl_on_paper(prompt_tokens: int, vocab: int, policy_mib: float, scorer_mib: float, adapter_mib: float) -> dict:
    """What TRL's last PPO holds at the same settings (its code, read: trl 0.19.1 ppo_trainer.py): four separate
    models, the value and reward models sequence-classification models (as in its examples), policy and value
    trained with AdamW (with PEFT, only the policy gets the adapter: the value model stays a full trained copy, the
    reference is the adapter disabled); during the rollout `batch_generation` keeps the sampled steps' logits
    [B, T_resp, V] fp32 for the whole local batch while the reference's forward returns full logits [B, P + T, V];
    the update's forward returns full logits [mb, P + T, V], divides the response slice by the temperature (a new
    tensor), log-softmaxes it and, for the entropy metric, softmaxes it again."""
    total = prompt_tokens + COMPLETION_TOKENS
    logits = 4 * vocab / MIB  # one fp32 row of logits, MiB
    return {
        "networks_mib": 2 * policy_mib + 2 * scorer_mib,
        "trainable_mib": policy_mib + scorer_mib,
        "grads_and_adam_mib": 3 * (policy_mib + scorer_mib),
        "lora_networks_mib": policy_mib + adapter_mib + 2 * scorer_mib,
        "lora_grads_and_adam_mib": 3 * (adapter_mib + scorer_mib),
        "rollout_generation_logits_mib": BATCH * COMPLETION_TOKENS * logits,
        "rollout_reference_logits_mib": BATCH * total * logits,
        "update_logits_mib": BATCH * (total + 3 * COMPLETION_TOKENS) * logits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=str, default=None)
    options = parser.parse_args()
    quiet()
    import torch

    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    rows = gsm8k_prompt_completion(limit=BATCH * options.steps)
    prompts = rows.remove_columns("completion")
    folder = Path(tempfile.mkdtemp())
    policy = tiny_llama(0, len(tokenizer))
    policy.save_pretrained(folder / "policy")
    tokenizer.save_pretrained(folder / "policy")
    reward = reward_like(policy)
    reward.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    reward.save_pretrained(folder / "reward")
    tokenizer.save_pretrained(folder / "reward")
    prompt_tokens = max(len(tokenizer(p)["input_ids"]) for p in prompts["prompt"][:BATCH])
    results = []
    for name, spec in layouts(str(folder / "policy"), policy).items():
        results.append(run_layout(name, spec, str(folder / "policy"), str(folder / "reward"), prompts, options.steps))
        print(f"{name}: {json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in results[-1].items()})}",
              flush=True)
    paper = trl_on_paper(prompt_tokens, len(tokenizer), results[0]["policy_mib"], results[0]["reward_mib"],
                         results[2]["trainable_mib"])
    print(f"\n{machine_description()}; {library_versions('torch', 'transformers', 'peft', 'trl')}")
    print(f"longest prompt of a batch: {prompt_tokens} tokens; completions {COMPLETION_TOKENS}; batch {BATCH}\n")
    headers = ["layout", "policy", "value", "reference", "reward", "trainable", "grads + AdamW", "rollout scoring peak",
               "update peak", "update activations", "peak RSS"]
    print(markdown_table(headers, [[r["layout"], *(f"{r[k]:.1f}" for k in (
        "policy_mib", "value_mib", "reference_mib", "reward_mib", "trainable_mib", "grads_and_adam_mib",
        "rollout_scoring_peak_mib", "update_peak_mib", "update_activations_mib", "peak_rss_mib"))] for r in results]))
    print("\nTRL's last PPO on paper, same settings (MiB): " + json.dumps({k: round(v, 1) for k, v in paper.items()}))
    if options.json:
        Path(options.json).write_text(json.dumps({"leantune": results, "trl_on_paper": paper}, indent=1))


if __name__ == "__main__":
    main()
