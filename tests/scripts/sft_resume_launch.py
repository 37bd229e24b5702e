"""Run by tests/trainers/test_resume.py under torchrun (2 processes, CPU, gloo): a few SFT steps through the API, three ways
in the same processes: uninterrupted; stopped after step STOP (its checkpoint written); resumed from that checkpoint.
Writes what its process saw to <out>/rank<process index>.json, and at exit (after leantune's exit handler) what was
left of the data-parallel wrappers and the process group to <out>/exit<process index>.json.

usage: sft_resume_launch.py OUT MODEL_DIR DATA_JSONL STOP"""

import atexit
import gc
import json
import sys

import torch
from datasets import load_dataset
from transformers import TrainerCallback

from leantune import SFTConfig, SFTTrainer

out, model_dir, data_file, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
STEPS = 4


def left_at_exit():
    """Registered before any trainer exists, so it runs after leantune's exit handler (atexit is last in, first
    out): a DDP wrapper alive here would free its process group only in the interpreter's teardown."""
    gc.collect()
    wrappers = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    with open(f"{out}/exit{whole.accelerator.process_index}.json", "w") as handle:
        json.dump({"ddp_wrappers": wrappers, "group_alive": torch.distributed.is_initialized()}, handle)


atexit.register(left_at_exit)


class StopAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == stop:
            control.should_training_stop = True
        return control


def run(folder: str, callbacks=(), resume=None):
    args = SFTConfig(output_dir=f"{out}/{folder}", report_to=[], save_steps=1, disable_tqdm=True, max_steps=STEPS,
                     per_device_train_batch_size=2, max_length=64, logging_steps=1, learning_rate=1e-3, seed=0,
                     memory_breakdown=False)
    trainer = SFTTrainer(model_dir, args=args, train_dataset=load_dataset("json", data_files=data_file)["train"],
                         callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


whole = run("whole")
stopped = run("stopped", [StopAt()])
resumed = run("stopped", resume=f"{out}/stopped/checkpoint-{stop}")


def losses(trainer):
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


state = whole.accelerator
with open(f"{out}/rank{state.process_index}.json", "w") as handle:
    json.dump({"whole": losses(whole), "resumed": losses(resumed), "stopped_at": stopped.state.global_step,
               "world": state.num_processes}, handle)
