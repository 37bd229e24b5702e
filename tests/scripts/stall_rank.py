"""Run by tests/launch/test_faults_launch.py under torchrun on CPU: SFT of a saved tiny model in which one process stops
answering (sleeps) at a given step, the test-only stand-in for a stuck rank. The other process must fail after
`ddp_timeout` seconds with a clear error, not wait for torch's default 30 minutes.

usage: stall_rank.py OUT MODEL_DIR DATA_JSONL STALLED_RANK STALL_AT_STEP DDP_TIMEOUT"""

import os
import sys
import time

from datasets import load_dataset
from transformers import TrainerCallback

from leantune import SFTConfig, SFTTrainer

out, model_dir, data_file = sys.argv[1:4]
stalled_rank, stall_at, timeout = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])


class Stall(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if args.process_index == stalled_rank and state.global_step == stall_at:
            with open(f"{out}/stalled_at", "w") as handle:
                handle.write(str(time.time()))
            time.sleep(600)


args = SFTConfig(output_dir=f"{out}/run", report_to=[], save_strategy="no", disable_tqdm=True,
                 per_device_train_batch_size=2, max_steps=6, max_length=64, logging_steps=1, learning_rate=1e-3,
                 seed=0, memory_breakdown=False, ddp_timeout=timeout)
trainer = SFTTrainer(model_dir, args=args, train_dataset=load_dataset("json", data_files=data_file)["train"])
os.makedirs(out, exist_ok=True)
trainer.add_callback(Stall())
trainer.train()
