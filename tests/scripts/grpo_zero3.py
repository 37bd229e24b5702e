"""Run by tests/trainers/test_gpu_grpo.py under `accelerate launch` with DeepSpeed ZeRO-3 on one GPU: a GRPO run with
ds3_gather_for_generation on or off (argv[2]); writes the first round's completions and the peak memory of
generation to argv[1]."""

import json
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from leantune import GRPOConfig, GRPOTrainer
from leantune.defaults import build_default_model_config, build_default_tokenizer

out, gather = sys.argv[1], sys.argv[2] == "gather"
tokenizer = build_default_tokenizer()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(build_default_model_config(tokenizer))
data = Dataset.from_dict({"prompt": [f"reverse: {w} =" for w in ["cat", "dog", "bird", "fish"] * 4]})
completions = []


def length_reward(completions_, completion_ids, **kwargs):
    completions.append(completion_ids)
    return [float(len(c)) for c in completions_]


args = GRPOConfig(output_dir=f"{out}/run", report_to=[], save_strategy="no", disable_tqdm=True, bf16=False,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2,
                  learning_rate=1e-3, memory_breakdown=False, seed=0, ds3_gather_for_generation=gather)
trainer = GRPOTrainer(model, length_reward, args=args, train_dataset=data, processing_class=tokenizer)
result = trainer.train()
with open(f"{out}/{sys.argv[2]}.json", "w") as handle:
    json.dump({"completions": completions, "peak_memory_mb": result.metrics["peak_memory_mb"],
               "zero3": trainer.accelerator.state.deepspeed_plugin is not None}, handle)
