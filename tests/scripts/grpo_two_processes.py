"""Run by tests/trainers/test_grpo.py under `torchrun --nproc_per_node 2` on CPU (gloo): a GRPO run whose groups span the
two processes. Writes what each process saw to <out>/rank<k>.json."""

import json
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from leantune import GRPOConfig, GRPOTrainer
from leantune.defaults import build_default_model_config, build_default_tokenizer

out = sys.argv[1]
torch.set_num_threads(1)
tokenizer = build_default_tokenizer()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(build_default_model_config(tokenizer))
data = Dataset.from_dict({"prompt": [f"reverse: {w} =" for w in ["cat", "dog", "bird", "fish"] * 4]})
seen = {"prompts": [], "rewards": [], "completions": []}


def length_reward(prompts, completions, **kwargs):
    seen["prompts"] += prompts
    seen["completions"] += completions
    values = [float(len(c)) for c in completions]
    seen["rewards"] += values
    return values


args = GRPOConfig(output_dir=f"{out}/run", use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                  per_device_train_batch_size=2, num_generations=4, max_completion_length=6, max_steps=2,
                  learning_rate=1e-2, logging_steps=1, memory_breakdown=False, seed=0, ddp_backend="gloo")
trainer = GRPOTrainer(model, length_reward, args=args, train_dataset=data, processing_class=tokenizer)
rounds = []
original = trainer.generation_round


def recording_round(prompt_rows):
    batches = original(prompt_rows)
    rounds.append([b["advantages"].tolist() for b in batches])
    return batches


trainer.generation_round = recording_round
trainer.train()
logged = [e for e in trainer.state.log_history if "reward" in e]
checksum = sum(float(p.detach().double().sum()) for p in trainer.model.parameters())
with open(f"{out}/rank{trainer.accelerator.process_index}.json", "w") as handle:
    json.dump({"prompts": seen["prompts"], "completions": seen["completions"], "rewards": seen["rewards"], "advantages": rounds,
               "logged_rewards": [e["reward"] for e in logged], "checksum": checksum,
               "world": trainer.accelerator.num_processes}, handle)
# leave the process group together: a rank that exits while the other still holds gloo connections can abort
trainer.accelerator.end_training()
