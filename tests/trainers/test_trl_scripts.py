"""TRL's own example scripts (trl/scripts/{sft,dpo,kto,reward,grpo,rloo}.py of the installed TRL) run against leantune
with only their config/trainer imports swapped, as a user moving over would; SFT and DPO give TRL's losses.

Each script is read from the installed package at test time, rewritten by text substitution and run as `__main__`
with its command line in a subprocess (leantune's six in one, TRL's two in another, side by side) on a tiny saved
model and local json data (the scripts' `load_dataset(--dataset_name)` reads a local folder of train.jsonl and
test.jsonl). Per-step losses come from the step-2 checkpoint's trainer_state.json (full precision)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from ..fixtures.data import gsm8k_rows, hh_rows  # noqa: E402
from ..fixtures.models import tiny_model  # noqa: E402
from ..fixtures.paths import REPO  # noqa: E402

SCRIPTS = Path(trl.__file__).parent / "scripts"
LEANTUNE_NAMES = {f"{method}{kind}" for method in ("SFT", "DPO", "KTO", "Reward", "GRPO", "RLOO")
                  for kind in ("Config", "Trainer")}
IMPORT = re.compile(r"(?m)^([ \t]*)from trl import ([\w, ]+)$")


def swap_imports(text: str) -> str:
    """`from trl import X, SFTTrainer` -> `from trl import X` + `from leantune import SFTTrainer`; nothing else."""
    def swap(match):
        indent, names = match.group(1), [name.strip() for name in match.group(2).split(",")]
        ours = [name for name in names if name in LEANTUNE_NAMES]
        lines = [f"from trl import {', '.join(n for n in names if n not in ours)}"] if len(ours) < len(names) else []
        lines += [f"from leantune import {', '.join(ours)}"] if ours else []
        return "\n".join(indent + line for line in lines)

    swapped = IMPORT.sub(swap, text)
    # The trainer (in main) and the config (in make_parser): anything else means TRL's script changed shape.
    assert swapped.count("from leantune import") == 2, "TRL's script no longer imports as expected"
    return swapped


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def _dataset(root: Path, name: str, rows: list[dict]) -> str:
    _jsonl(root / name / "train.jsonl", rows)
    _jsonl(root / name / "test.jsonl", rows[:4])
    return str(root / name)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tokenizer_dir):
    """A tiny llama with the shared tokenizer, saved; the data each script reads; a reward-function module."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("trl-scripts")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tiny_model().save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    gsm8k = gsm8k_rows(8)
    hh = hh_rows(200)

    def fits(pair):  # short (no truncation at max_length=128), and the implicit prompt ends at the last "Assistant:"
        shared = os.path.commonprefix([pair["chosen"], pair["rejected"]])
        return shared.endswith("\n\nAssistant: ") and max(
            len(tokenizer(pair[k]).input_ids) for k in ("chosen", "rejected")) <= 100

    data = {
        "sft": [{"prompt": r["question"], "completion": " " + r["answer"]} for r in gsm8k],
        "pairs": [pair for pair in hh if fits(pair)][:8],
        "kto": [{"prompt": r["question"], "completion": " " + r["answer"], "label": i % 2 == 0}
                for i, r in enumerate(gsm8k)],
        "prompts": [{"prompt": r["question"][:80]} for r in gsm8k],
        "chat": [{"messages": [{"role": "user", "content": r["question"]},
                               {"role": "assistant", "content": r["answer"][:120]}]} for r in gsm8k],
    }
    assert len(data["pairs"]) == 8
    paths = {name: _dataset(root, name, rows) for name, rows in data.items()}
    (root / "script_rewards.py").write_text(
        "def count_a(completions, **kwargs):\n    return [c.count('a') / max(len(c), 1) for c in completions]\n")
    # The shared tokenizer's template has {% generation %} markers (TRL's runs use it); leantune's chat run gets it
    # without them, so its assistant masks come from the template's prefixes (data/sft_tokenization.py).
    marked = tokenizer.chat_template
    assert "{% generation %}" in marked
    (root / "plain.jinja").write_text(marked.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    paths.update(root=root, model=str(root / "model"), plain_template=str(root / "plain.jinja"))
    return paths


COMMON = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--logging_steps", "1", "--report_to", "none",
          "--save_strategy", "steps", "--save_steps", "2", "--save_only_model", "true", "--use_cpu", "true",
          "--seed", "0", "--disable_tqdm", "true", "--dataloader_pin_memory", "false"]

# SFT and DPO against TRL's own run of the unmodified script on the same model, data, seed and order. Plain SGD (not
# Adam, whose first step is about lr * sign(gradient) and turns float noise in tiny gradient entries into whole steps)
# makes step 2 depend linearly on step 1's gradient.
# Each run: (script, its arguments). "sft-chat" trains on assistant turns only, TRL with the template's generation
# markers, leantune with the markers removed (LEANTUNE_ONLY).
COMPARED = {
    "sft": ("sft", ["--dataset_name", "{sft}", "--max_length", "128", "--optim", "sgd", "--learning_rate", "0.5"]),
    "sft-chat": ("sft", ["--dataset_name", "{chat}", "--assistant_only_loss", "true", "--optim", "sgd",
                         "--learning_rate", "0.5"]),
    "dpo": ("dpo", ["--dataset_name", "{pairs}", "--max_length", "128", "--optim", "sgd", "--learning_rate", "0.5"]),
}
LEANTUNE_ONLY = {"sft-chat": ["--chat_template_path", "{plain_template}"]}
# The other four, each with some of the flags their docstrings use (LoRA, an eval split, a reference model, reward
# models by path and by dotted import); their losses must be finite and the model saved.
OTHERS = {
    "kto": ("kto", ["--dataset_name", "{kto}", "--max_length", "128", "--use_peft", "true", "--lora_r", "8",
                    "--lora_alpha", "16", "--lora_target_modules", "all-linear", "--eval_strategy", "steps",
                    "--eval_steps", "2", "--per_device_eval_batch_size", "2", "--lr_scheduler_type", "cosine",
                    "--learning_rate", "1e-3"]),
    "reward": ("reward", ["--dataset_name", "{pairs}", "--max_length", "128", "--eval_strategy", "steps",
                          "--eval_steps", "2", "--per_device_eval_batch_size", "2", "--learning_rate", "1e-3"]),
    "grpo": ("grpo", ["--dataset_name", "{prompts}", "--reward_funcs", "script_rewards.count_a", "--num_generations",
                      "2", "--max_completion_length", "8", "--beta", "0.04", "--learning_rate", "1e-3"]),
    "rloo": ("rloo", ["--dataset_name", "{prompts}", "--reward_model_name_or_path", "{model}", "--reward_funcs",
                      "script_rewards.count_a", "--num_generations", "2", "--max_completion_length", "8",
                      "--use_peft", "true", "--lora_r", "8", "--learning_rate", "1e-3"]),
}


# Runs scripts one after another in one interpreter, each as `__main__` with its own argv (what `python script.py
# ARGS` does), so the ~6 s of imports (torch, transformers, peft, trl) are paid once per group, not once per script.
# A failing script is recorded (its traceback) and the next one still runs.
RUNNER = """
import json, os, runpy, sys, traceback
for path, argv, result in json.loads(sys.argv[1]):
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
        status = "ok"
    except BaseException:
        status = traceback.format_exc()
    with open(result, "w") as handle:
        json.dump(status, handle)
"""


def start_group(workspace, names: list[str], leantune: bool):
    """Start one subprocess that runs TRL's scripts (imports swapped to leantune, or as shipped) in turn."""
    root, kind = workspace["root"], "leantune" if leantune else "trl"
    jobs = []
    for name in names:
        script, args = {**COMPARED, **OTHERS}[name]
        text = (SCRIPTS / f"{script}.py").read_text(encoding="utf-8")
        path = root / f"{kind}-{name}.py"
        path.write_text(swap_imports(text) if leantune else text, encoding="utf-8")
        args = [*args, *(LEANTUNE_ONLY.get(name, []) if leantune else [])]
        argv = ["--model_name_or_path", workspace["model"], "--output_dir", str(root / f"{kind}-{name}"), *COMMON,
                *(arg.format(**workspace) for arg in args)]
        jobs.append((str(path), argv, str(root / f"{kind}-{name}.result.json")))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=str(root / f"datasets-cache-{kind}"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = open(root / f"{kind}.log", "w")  # closed by the fixture once the group has finished
    process = subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(jobs)], cwd=root, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    return process, log


@pytest.fixture(scope="module")
def runs(workspace):
    """TRL's three runs and leantune's seven, the two groups side by side; returns a function giving one run's logged
    steps after checking that it succeeded with finite losses and saved its model."""
    groups = [start_group(workspace, list(COMPARED), leantune=False),
              start_group(workspace, [*COMPARED, *OTHERS], leantune=True)]
    try:
        for process, log in groups:
            process.wait(timeout=600)
            log.close()
    finally:
        for process, _ in groups:
            if process.poll() is None:
                process.kill()

    def steps(run: str, leantune: bool = True) -> list[dict]:
        name = f"{'leantune' if leantune else 'trl'}-{run}"
        result = workspace["root"] / f"{name}.result.json"
        assert result.exists(), f"{name}.py never finished; see {workspace['root']}"
        status = json.loads(result.read_text())
        assert status == "ok", f"{name}.py failed:\n{status[-4000:]}"
        output_dir = workspace["root"] / name
        logged = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
        logged = [entry for entry in logged if "loss" in entry]
        assert [entry["step"] for entry in logged] == [1, 2], name
        assert all(math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"]) for entry in logged), logged
        assert (output_dir / "model.safetensors").exists() or (output_dir / "adapter_model.safetensors").exists()
        return logged

    return steps


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# Tolerances, from measurements on this setup (SFT / SFT chat / DPO):
# - step 1 (same weights, same batch, fp32): loss within 1e-5 relative (measured 2e-7 / 1.6e-6; DPO's is ln 2), and
#   DPO's summed log-probs within 2e-5 (measured 3e-6: TRL's tiled output head sums ~100 fp32 terms per sequence);
#   the chat run's equal loss says leantune's prefix masks chose the tokens TRL's markers chose;
# - step 1's gradient norm within 1% (measured 0.18% / 0.3% / 0.09%): TRL's training gradient is 0.7% (relative
#   norm, every parameter) away from a float64 by-hand gradient of the same batch, leantune's 3e-7;
# - the loss change from step 1 to step 2 within 3% of TRL's (measured 0.05% / 0.14% / 0.9%, from that 0.7%).
#   A wrong learning rate, loss scale or normalisation moves it by far more.
@pytest.mark.parametrize("run", sorted(COMPARED))
def test_script_matches_trl(run, runs):
    ours, theirs = runs(run), runs(run, leantune=False)
    assert relative(ours[0]["loss"], theirs[0]["loss"]) < 1e-5
    if run == "dpo":
        assert ours[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # policy == reference at step 1
        for name in ("logps/chosen", "logps/rejected"):
            assert relative(ours[0][name], theirs[0][name]) < 2e-5, name
    assert relative(ours[0]["grad_norm"], theirs[0]["grad_norm"]) < 1e-2
    change, trl_change = ours[1]["loss"] - ours[0]["loss"], theirs[1]["loss"] - theirs[0]["loss"]
    assert abs(trl_change) > 1e-2  # the step moved the loss measurably
    assert relative(change, trl_change) < 3e-2, (ours, theirs)


@pytest.mark.parametrize("run", sorted(OTHERS))
def test_script_runs_with_leantune(run, runs):
    steps = runs(run)
    if run in ("grpo", "rloo"):
        rewards = [entry["reward"] for entry in steps if "reward" in entry]
        assert rewards and all(math.isfinite(reward) for reward in rewards)
