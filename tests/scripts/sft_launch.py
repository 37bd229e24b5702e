"""Run by tests/launch/test_launch.py, alone or under a multi-process launcher (torchrun, accelerate launch) on CPU: a few
SFT steps of a saved tiny model, through the API. Writes what its process saw to <out>/rank<process index>.json.

usage: sft_launch.py OUT MODEL_DIR DATA_JSONL PER_DEVICE_BATCH_SIZE"""

import json
import os
import sys

from datasets import load_dataset

from leantune import SFTConfig, SFTTrainer

out, model_dir, data_file, batch_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
args = SFTConfig(output_dir=f"{out}/run", report_to=[], save_strategy="no", disable_tqdm=True,
                 per_device_train_batch_size=batch_size, max_steps=3, max_length=64, logging_steps=1,
                 learning_rate=1e-3, seed=0, memory_breakdown=False)
trainer = SFTTrainer(model_dir, args=args, train_dataset=load_dataset("json", data_files=data_file)["train"])
trainer.train()
trainer.save_model()
state = trainer.accelerator
with open(f"{out}/rank{state.process_index}.json", "w") as handle:
    json.dump({"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e], "world": state.num_processes,
               "backend": str(state.state.backend), "should_save": args.should_save, "pid": os.getpid()}, handle)
