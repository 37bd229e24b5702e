"""`leantune plan` against real runs: predicted vs measured step peak, on CPU, for many configurations.

Each configuration trains a tiny real model (random weights, built from a config) for two optimizer steps with
`memory_breakdown` on, which measures the second step with MemTracker; `plan_memory` predicts that step without any
weight (fake parameters, the same trainer and data). Printed: every row, its error, the worst error.

    PYTHONPATH=. OMP_NUM_THREADS=2 python bench/plan_accuracy.py [--only NAME_SUBSTRING]
    for i in $(seq 0 39); do PYTHONPATH=. OMP_NUM_THREADS=2 python bench/plan_accuracy.py --row $i; done
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import GSM8K_TRAIN, SHARED, TOKENIZER_DIR, quiet  # noqa: E402

HH_PAIRS = SHARED / "data" / "hh-rlhf-harmless" / "test.jsonl.gz"
MIB = 1024 * 1024


def tiny_config(arch: str, vocab: int, layers: int = 2):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    return (LlamaConfig if arch == "llama" else Qwen2Config)(**common)


def data(kind: str, rows: int):
    from datasets import Dataset

    if kind in ("sft", "prompt"):
        with open(GSM8K_TRAIN, encoding="utf-8") as handle:
            lines = [json.loads(line) for _, line in zip(range(rows), handle)]
        if kind == "prompt":
            return Dataset.from_list([{"prompt": r["question"]} for r in lines])
        return Dataset.from_list([{"prompt": r["question"], "completion": " " + r["answer"]} for r in lines])
    with gzip.open(HH_PAIRS, "rt", encoding="utf-8") as handle:
        lines = [json.loads(line) for _, line in zip(range(rows), handle)]
    return Dataset.from_list(lines)


METHOD_DATA = {"sft": "sft", "dpo": "pairs", "kto": "pairs", "reward": "pairs", "grpo": "prompt", "rloo": "prompt",
               "online-dpo": "prompt", "ppo": "prompt", "gkd": "sft"}
ONLINE = ("grpo", "rloo", "online-dpo", "ppo")

# (name, method, arch, vocab, layers, fields)
CONFIGS = [
    ("sft default", "sft", "llama", 32000, 2, {}),
    ("sft no checkpointing", "sft", "llama", 32000, 2, {"gradient_checkpointing": False}),
    ("sft full logits", "sft", "llama", 32000, 2, {"chunked_loss": False}),
    ("sft packing", "sft", "llama", 32000, 2, {"packing": True}),
    ("sft padding-free", "sft", "llama", 32000, 2, {"padding_free": True}),
    ("sft offloading", "sft", "llama", 32000, 2, {"activation_offloading": True,
                                                   "activation_offloading_min_bytes": 0}),
    ("sft chunk 64", "sft", "llama", 32000, 2, {"loss_chunk_size": 64}),
    ("sft LoRA", "sft", "llama", 32000, 2, {"peft": True}),
    ("sft accumulation 2", "sft", "llama", 32000, 2, {"per_device_train_batch_size": 2,
                                                       "gradient_accumulation_steps": 2}),
    ("sft packing+no ckpt+LoRA", "sft", "llama", 32000, 2, {"packing": True, "gradient_checkpointing": False,
                                                             "peft": True}),
    ("sft qwen2", "sft", "qwen2", 32000, 2, {}),
    ("sft qwen2 128k", "sft", "qwen2", 128256, 2, {}),
    ("sft llama 128k full logits", "sft", "llama", 128256, 2, {"chunked_loss": False}),
    ("sft llama 128k padding-free", "sft", "llama", 128256, 2, {"padding_free": True}),
    ("sft llama 6 layers (extrapolated)", "sft", "llama", 32000, 6, {}),
    ("sft qwen2 6 layers packing (extrapolated)", "sft", "qwen2", 32000, 6, {"packing": True}),
    ("dpo default", "dpo", "llama", 32000, 2, {}),
    ("dpo padding-free", "dpo", "llama", 32000, 2, {"padding_free": True}),
    ("dpo no checkpointing", "dpo", "llama", 32000, 2, {"gradient_checkpointing": False}),
    ("dpo LoRA", "dpo", "llama", 32000, 2, {"peft": True}),
    ("dpo qwen2 128k", "dpo", "qwen2", 128256, 2, {}),
    ("kto default", "kto", "llama", 32000, 2, {}),
    ("kto qwen2 no ckpt", "kto", "qwen2", 32000, 2, {"gradient_checkpointing": False}),
    ("reward default", "reward", "llama", 32000, 2, {}),
    ("reward padding-free", "reward", "qwen2", 32000, 2, {"padding_free": True}),
    ("grpo default", "grpo", "llama", 32000, 2, {"beta": 0.04}),
    ("grpo beta 0", "grpo", "llama", 32000, 2, {"beta": 0.0}),
    ("grpo qwen2 128k padding-free", "grpo", "qwen2", 128256, 2, {"padding_free": True}),
    ("rloo default", "rloo", "llama", 32000, 2, {}),
    ("rloo LoRA no ckpt", "rloo", "qwen2", 32000, 2, {"peft": True, "gradient_checkpointing": False}),
    # frozen models' weights (reference copy, reward model, teacher) are the breakdown's and the plan's frozen_models
    ("dpo precomputed reference (none held)", "dpo", "llama", 32000, 2, {"precompute_ref_log_probs": True}),
    ("grpo beta 0.04 reward model", "grpo", "llama", 32000, 2, {"beta": 0.04, "reward_model": True}),
    ("online-dpo default (reference copy)", "online-dpo", "llama", 32000, 2, {}),
    ("online-dpo LoRA (adapter off = reference)", "online-dpo", "llama", 32000, 2, {"peft": True}),
    ("online-dpo reward model, padding-free", "online-dpo", "qwen2", 32000, 2, {"reward_model": True,
                                                                             "padding_free": True}),
    ("ppo default (reward model)", "ppo", "llama", 32000, 2, {"reward_model": True}),
    ("ppo LoRA", "ppo", "llama", 32000, 2, {"reward_model": True, "peft": True}),
    ("gkd off-policy (lmbda 0)", "gkd", "llama", 32000, 2, {"lmbda": 0.0}),
    ("gkd on-policy (lmbda 1)", "gkd", "llama", 32000, 2, {"lmbda": 1.0}),
    ("gkd qwen2 padding-free, lmbda 0.5", "gkd", "qwen2", 32000, 2, {"lmbda": 0.5, "padding_free": True}),
]
NOT_FIELDS = ("peft", "reward_model")  # row settings that are not config fields
TEACHER_LAYERS = 3  # GKD's teacher: the student's shape with one more layer


def fields_for(method: str, extra: dict) -> dict:
    base = dict(per_device_train_batch_size=4, max_steps=2, seed=0, learning_rate=1e-4)
    if method in ("sft", "dpo", "kto", "reward", "gkd"):
        base["max_length"] = 256
    if method in ("grpo", "rloo"):
        base.update(num_generations=4, max_completion_length=24, max_prompt_length=96)
    if method == "online-dpo":
        base.update(per_device_train_batch_size=2, max_new_tokens=24, max_length=128)
    if method == "ppo":
        base.update(max_completion_length=24, max_prompt_length=96)
    if method == "gkd":
        base.update(max_new_tokens=24)
    base.update({k: v for k, v in extra.items() if k not in NOT_FIELDS})
    return base


def reward_len(completions, **kwargs):
    return [float(len(text) % 7) for text in completions]


def reward_model_path(arch: str, vocab: int, tokenizer) -> str:
    """A tiny reward model and its tokenizer saved once (a real run loads it from the folder; the plan reads its
    config.json and tokenizer only)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    path = Path("/tmp/leantune-plan-bench-reward") / f"{arch}-{vocab}"
    if not (path / "config.json").exists():
        config = tiny_config(arch, vocab, 2)
        config.num_labels = 1
        torch.manual_seed(1)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def run_one(name, method, arch, vocab, layers, extra, tokenizer):
    import torch
    from peft import LoraConfig

    from leantune.planning import plan_memory
    from leantune.planning.planner import method_classes

    trainer_class, config_class = method_classes(method)
    fields = fields_for(method, extra)
    peft = LoraConfig(r=8, lora_alpha=16, task_type="SEQ_CLS" if method == "reward" else "CAUSAL_LM") \
        if extra.get("peft") else None
    dataset = data(METHOD_DATA[method], 48 if method in ONLINE else 64)
    kwargs = {"reward_funcs": reward_len} if method in ONLINE else {}
    if extra.get("reward_model"):
        kwargs["reward_funcs"] = [reward_model_path(arch, vocab, tokenizer)]
    started = time.perf_counter()
    teacher = {"teacher_model_name_or_path": tiny_config(arch, vocab, TEACHER_LAYERS)} if method == "gkd" else {}
    plan = plan_memory(tiny_config(arch, vocab, layers), dataset, method, processing_class=tokenizer,
                       peft_config=peft, **kwargs, **teacher, **fields)
    plan_seconds = time.perf_counter() - started
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = tiny_config(arch, vocab, layers)
    if method == "reward":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    if method == "gkd":
        kwargs["teacher_model"] = AutoModelForCausalLM.from_config(tiny_config(arch, vocab, TEACHER_LAYERS))
    args = config_class(output_dir="/tmp/leantune-plan-bench", use_cpu=True, report_to=[], save_strategy="no",
                        disable_tqdm=True, logging_steps=1, memory_breakdown=True, **fields)
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                            peft_config=peft, **kwargs)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    measured = trainer.memory_breakdown.peak_bytes
    predicted = plan.measured_step.peak_bytes
    return predicted, measured, plan.worst.peak_bytes, plan_seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None)
    parser.add_argument("--row", type=int, default=None, help="only CONFIGS[ROW], without the table's header (each "
                        "row in a process of its own)")
    options = parser.parse_args()
    quiet()
    import logging

    logging.getLogger("leantune").setLevel(logging.ERROR)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    rows, errors = [], []
    if options.row is None:
        print(f"| configuration | method | arch | vocab | layers | predicted MiB | measured MiB | error | "
              f"worst batch MiB | plan s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for name, method, arch, vocab, layers, extra in CONFIGS if options.row is None else CONFIGS[options.row:][:1]:
        if options.only and not any(part in name for part in options.only.split(",")):
            continue
        try:
            predicted, measured, worst, seconds = run_one(name, method, arch, vocab, layers, extra, tokenizer)
        except Exception as error:  # a row that fails is reported, not hidden
            print(f"| {name} | {method} | {arch} | {vocab} | {layers} | failed: {type(error).__name__}: "
                  f"{str(error)[:80]} | | | | |", flush=True)
            continue
        error = (predicted - measured) / measured
        errors.append(abs(error))
        print(f"| {name} | {method} | {arch} | {vocab} | {layers} | {predicted / MIB:.2f} | {measured / MIB:.2f} | "
              f"{100 * error:+.2f}% | {worst / MIB:.2f} | {seconds:.1f} |", flush=True)
    if errors and options.row is None:
        print(f"\n{len(errors)} configurations: worst |error| {100 * max(errors):.2f}%, within 2%: "
              f"{sum(e <= 0.02 for e in errors)}, within 5%: {sum(e <= 0.05 for e in errors)}")


if __name__ == "__main__":
    main()
