"""`kill -9` at random points of an SFT run that saves every step, resumed each time: no step lost, none repeated.

A reference run trains STEPS steps uninterrupted. The killed run starts, is killed with SIGKILL at a random (seeded)
moment once training has begun (up to --max_delay times the reference's time per step and save; steps, saves and
renames each take part of that time, so kills land in saves too, counted by the staging folders they leave), and
resumes from the latest complete checkpoint, KILLS times; then it runs to the end. Checked: the final checkpoint's
history holds steps 1..STEPS once each, with the reference's losses (same float operations in the same order: 1e-6
relative, see tests/trainers/test_resume.py), and every step a killed attempt trained (a journal written at each log) had the
reference's loss too.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/kill_resume.py --kills 20 --steps 30 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import SHARED  # noqa: E402

SHARED = Path(os.environ.get("LEANTUNE_SHARED", SHARED))  # a worktree's own data folder, as the tests take it
GSM8K_TRAIN = SHARED / "data" / "gsm8k" / "train.jsonl"
TOKENIZER_DIR = SHARED / "tokenizers" / "mistral-7b-v0.1"

REL = 1e-6
CHILD = r'''
import json, os, sys
from datasets import load_dataset
from transformers import TrainerCallback
from leantune import SFTConfig, SFTTrainer
out, model_dir, data_file, steps, journal = sys.argv[1:6]

class Journal(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print("TRAINING", flush=True)
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            with open(journal, "a") as handle:
                handle.write(json.dumps([state.global_step, logs["loss"]]) + "\n")
                handle.flush(); os.fsync(handle.fileno())

complete = sorted((int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-")
                   and os.path.exists(os.path.join(out, n, "trainer_state.json")))) if os.path.isdir(out) else []
args = SFTConfig(output_dir=out, report_to=[], save_steps=1, save_total_limit=2, disable_tqdm=True,
                 max_steps=int(steps), per_device_train_batch_size=2, max_length=128, logging_steps=1,
                 learning_rate=1e-3, seed=0, memory_breakdown=False, use_cpu=True)
trainer = SFTTrainer(model_dir, args=args, train_dataset=load_dataset("json", data_files=data_file)["train"],
                     callbacks=[Journal()])
trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{complete[-1]}" if complete else None)
'''


def prepare(root: Path, rows: int) -> tuple[str, str]:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).float().save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)).save_pretrained(root / "model")
    with open(GSM8K_TRAIN, encoding="utf-8") as source, open(root / "data.jsonl", "w", encoding="utf-8") as target:
        for _, line in zip(range(rows), source):
            row = json.loads(line)
            target.write(json.dumps({"prompt": row["question"], "completion": " " + row["answer"]}) + "\n")
    return str(root / "model"), str(root / "data.jsonl")


def start(out: Path, model: str, data: str, steps: int, journal: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(out), model, data, str(steps), str(journal)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def staging_folders(out: Path) -> set[tuple[str, int]]:
    if not out.is_dir():
        return set()
    return {(p.name, p.stat().st_mtime_ns) for p in out.iterdir() if p.name.startswith("tmp-checkpoint-")}


def final_losses(out: Path, steps: int) -> list[tuple[int, float]]:
    state = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    return [(e["step"], e["loss"]) for e in state["log_history"] if "loss" in e]


def run(kills: int, steps: int, seed: int, max_delay: float, root: Path) -> dict:
    rng = random.Random(seed)
    model, data = prepare(root, 2 * steps)
    reference_journal = root / "reference.jsonl"
    child = start(root / "reference", model, data, steps, reference_journal)
    child.stdout.readline()
    began = time.perf_counter()
    child.communicate()
    assert child.returncode == 0, "the reference run failed"
    step_seconds = (time.perf_counter() - began) / steps  # a step and its save, on this machine now
    reference = dict(final_losses(root / "reference", steps))
    out, journal = root / "killed", root / "killed.jsonl"
    landed_in_save, attempts = 0, 0
    while attempts < kills:
        staged_before = staging_folders(out)
        child = start(out, model, data, steps, journal)
        child.stdout.readline()  # "TRAINING": the model loaded, the checkpoint (if any) restored
        time.sleep(rng.uniform(0.0, max_delay * step_seconds))
        if child.poll() is not None:
            break  # it finished first: the run is complete
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        attempts += 1
        in_save = bool(staging_folders(out) - staged_before)  # a save this attempt began, not renamed
        landed_in_save += in_save
        done = [int(p.name.split("-")[1]) for p in out.iterdir() if p.name.startswith("checkpoint-")]
        print(f"kill {attempts}: latest complete checkpoint {max(done, default=0)}"
              f"{' (killed during a save)' if in_save else ''}", flush=True)
        if steps in done:
            break
    if not (out / f"checkpoint-{steps}").exists():
        child = start(out, model, data, steps, journal)
        child.communicate()
        assert child.returncode == 0, "the last resume failed"
    got = final_losses(out, steps)
    assert [s for s, _ in got] == list(range(1, steps + 1)), f"steps lost or repeated: {[s for s, _ in got]}"
    worst = max(abs(loss - reference[s]) / abs(reference[s]) for s, loss in got)
    assert worst <= REL, f"losses differ from the uninterrupted run: worst relative {worst:.1e}"
    trained = [json.loads(line) for line in journal.read_text().splitlines()]
    worst_attempt = max(abs(loss - reference[s]) / abs(reference[s]) for s, loss in trained)
    assert worst_attempt <= REL, f"a killed attempt trained a step differently: {worst_attempt:.1e}"
    return {"seconds_per_step": round(step_seconds, 2), "kills": attempts, "kills_during_a_save": landed_in_save, "steps": steps,
            "steps_trained_in_all_attempts": len(trained), "worst_relative_difference": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_delay", type=float, default=3.0,
                        help="the kill comes at most this many steps' time (step and save) after training began")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        result = run(options.kills, options.steps, options.seed, options.max_delay, Path(folder))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
