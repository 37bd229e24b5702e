"""Saved artefacts load from anywhere and say what they are.

Runs train from a RELATIVE model folder ("tiny-llama", with the working directory set to the run folder) and save: a
full SFT model (with a checkpoint), an SFT LoRA adapter, a full reward model and a reward LoRA adapter. Then a fresh
Python process, in another directory and offline, runs the loading lines of each README.md exactly as written and
must reproduce the trained model's outputs on fixed inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import load_dataset

from leantune.models import model_card
from leantune.models.loading import resolve_source
from leantune.trainers.reward_config import RewardConfig
from leantune.trainers.reward_trainer import RewardTrainer
from leantune.trainers.sft_config import SFTConfig
from leantune.trainers.sft_trainer import SFTTrainer

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model
from ..fixtures.paths import HH_PAIRS, require
from ..fixtures.tokenizers import load_tokenizer

BASE = "tiny-llama"  # relative on purpose: the bug was an adapter recording this as its base
TEXTS = ["Natalia sold clips to 48 of her friends in April.", "The answer is 42."]
# Same weights, same fp32 ops on the same CPU in both processes: the outputs should agree to rounding (in practice
# exactly); 1e-5 leaves room for a different kernel choice while staying far below what a training step moves
# (learning rate 1e-2, checked below to change the outputs by much more than this).
ATOL = 1e-5

LOAD_SCRIPT = textwrap.dedent('''
    import json, re, sys, torch
    spec = json.load(open(sys.argv[1]))
    results = {}
    for name, item in spec.items():
        readme = open(item["folder"] + "/README.md", encoding="utf-8").read()
        code = re.search(r"```python\\n(.*?)```", readme, re.S).group(1)
        scope = {}
        exec(code, scope)  # the card's own loading lines, as a user would paste them
        model = scope["model"].eval()
        ids = torch.load(item["inputs"])
        with torch.no_grad():
            out = torch.cat([model(input_ids=row).logits.reshape(-1) for row in ids])
        expected = torch.load(item["expected"])
        same_ids = [scope["tokenizer"](t, return_tensors="pt").input_ids.tolist() == row.tolist()
                    for t, row in zip(item["texts"], ids)]
        results[name] = {"max_diff": (out - expected).abs().max().item(), "tokenizer_matches": all(same_ids),
                         "class": type(model).__name__}
    print(json.dumps(results))
''')


def outputs_of(model, ids: list[torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return torch.cat([model(input_ids=row).logits.reshape(-1) for row in ids])


def lora(task_type: str):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type=task_type)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir, gsm8k_rows):
    """Train and save every artefact from a relative base path; returns what the loading check needs."""

    workdir = tmp_path_factory.mktemp("run")
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = [tokenizer(text, return_tensors="pt").input_ids for text in TEXTS]
    sft_data = gsm8k_prompt_completion(gsm8k_rows, 8)
    pairs = load_dataset("json", data_files=str(require(HH_PAIRS)), split="train").select(range(8))
    common = dict(report_to=[], use_cpu=True, disable_tqdm=True, max_steps=2, per_device_train_batch_size=4,
                  learning_rate=1e-2, max_length=128, memory_breakdown=False, save_strategy="no")
    trained = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        tiny_model().save_pretrained(BASE)
        tokenizer.save_pretrained(BASE)
        base_outputs = outputs_of(tiny_model(), ids)
        built = {
            # a checkpoint at step 2 as well: checkpoints get their card too
            "sft_full": SFTTrainer(BASE, args=SFTConfig(output_dir="sft-full", **{
                **common, "save_strategy": "steps", "save_steps": 2, "save_only_model": True}),
                train_dataset=sft_data),
            "sft_lora": SFTTrainer(BASE, args=SFTConfig(output_dir="sft-lora", **common), train_dataset=sft_data,
                                   peft_config=lora("CAUSAL_LM")),
            "reward_full": RewardTrainer(BASE, args=RewardConfig(output_dir="reward-full", **common),
                                         train_dataset=pairs),
            "reward_lora": RewardTrainer(BASE, args=RewardConfig(output_dir="reward-lora", **common),
                                         train_dataset=pairs, peft_config=lora("SEQ_CLS")),
        }
        for name, trainer in built.items():
            trainer.train()
            trainer.save_model()
            expected = outputs_of(trainer.model, ids)
            torch.save(expected, workdir / f"{name}.expected.pt")
            trained[name] = {"folder": str(workdir / trainer.args.output_dir), "expected": str(workdir / f"{name}.expected.pt"),
                             "inputs": str(workdir / "inputs.pt"), "texts": TEXTS}
        torch.save(ids, workdir / "inputs.pt")
        # A README.md that is not leantune's is left alone.
        (workdir / "mine").mkdir()
        (workdir / "mine" / "README.md").write_text("my own notes\n")
        built["sft_full"].save_model("mine")
        built["sft_full"].create_model_card(tags=["extra-tag"], language="en")
    sft_change = (torch.load(workdir / "sft_full.expected.pt") - base_outputs).abs().max().item()
    lora_change = (torch.load(workdir / "sft_lora.expected.pt") - base_outputs).abs().max().item()
    return {"workdir": workdir, "trained": trained, "trainers": built, "changes": (sft_change, lora_change)}


def readme(runs, name: str) -> str:
    return (Path(runs["trained"][name]["folder"]) / "README.md").read_text()


def test_adapters_record_the_absolute_base_path(runs):
    base = str(runs["workdir"] / BASE)
    for name in ("sft_lora", "reward_lora"):
        config = json.loads((Path(runs["trained"][name]["folder"]) / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == base, name
    assert resolve_source("some-org/some-model") == "some-org/some-model"  # a Hub id stays as it is


def test_every_artefact_loads_elsewhere_offline_with_its_readme_lines(runs, tmp_path):
    # Training really moved the outputs, so a load that dropped the weights or the adapter could not pass.
    assert min(runs["changes"]) > 1000 * ATOL, runs["changes"]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(runs["trained"]))
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for item in runs["trained"].values():  # the cards name each folder by its name: put each (only) there
        (elsewhere / Path(item["folder"]).name).symlink_to(item["folder"])  # the base model is not: read from configs
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, str(script), str(spec)], cwd=elsewhere, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(loaded) == set(runs["trained"])
    for name, found in loaded.items():
        assert found["max_diff"] <= ATOL, (name, found)
        assert found["tokenizer_matches"], name
    assert loaded["sft_full"]["class"] == "LlamaForCausalLM"
    assert loaded["reward_full"]["class"] == "LlamaForSequenceClassification"


def test_readmes_say_what_they_hold(runs):
    full = readme(runs, "sft_full")
    assert "**full model**" in full and "`LlamaForCausalLM`" in full and "`SFTTrainer` (method: sft)" in full
    assert "tags:\n- leantune\n- sft" in full and "library_name: transformers" in full
    import leantune

    assert f"leantune {leantune.__version__}" in full
    adapter = readme(runs, "sft_lora")
    assert "**LoRA adapter**" in adapter and f"`{BASE}` (a local folder, its absolute path recorded in " \
        "adapter_config.json)" in adapter
    assert "AutoPeftModelForCausalLM.from_pretrained" in adapter and "library_name: peft" in adapter
    assert "base_model:" not in adapter  # a local folder is no Hub id
    assert "[More Information Needed]" not in adapter  # PEFT's template card was replaced
    reward = readme(runs, "reward_full")
    assert "**reward model**" in reward and "num_labels=1" in reward and "`RewardTrainer` (method: reward)" in reward
    assert "AutoModelForSequenceClassification.from_pretrained" in reward
    reward_adapter = readme(runs, "reward_lora")
    assert "**LoRA adapter**" in reward_adapter and "**reward model**" in reward_adapter
    assert "from_pretrained(base_path, num_labels=1" in reward_adapter
    checkpoint = Path(runs["trained"]["sft_full"]["folder"]) / "checkpoint-2" / "README.md"
    assert "optimizer step 2" in checkpoint.read_text() and "**full model**" in checkpoint.read_text()
    assert '"sft-full/checkpoint-2"' in checkpoint.read_text()  # a checkpoint is named with its run folder


def test_readmes_embed_no_absolute_local_path(runs):
    """push_to_hub publishes README.md: the cards name folders by their names, not by this machine's paths."""
    cards = [readme(runs, name) for name in runs["trained"]]
    cards.append((Path(runs["trained"]["sft_full"]["folder"]) / "checkpoint-2" / "README.md").read_text())
    for card in cards:
        assert str(runs["workdir"]) not in card and os.path.realpath(runs["workdir"]) not in card, card


def test_foreign_readme_is_kept_and_push_card_takes_tags(runs):
    workdir = runs["workdir"]
    assert (workdir / "mine" / "README.md").read_text() == "my own notes\n"
    assert (workdir / "mine" / "model.safetensors").exists()
    card = readme(runs, "sft_full")  # create_model_card (push_to_hub's) writes leantune's card with the extras
    assert "- extra-tag" in card and "language:\n- en" in card and model_card.MARKER in card


def test_hub_base_is_named_in_the_front_matter():
    facts = {"trainer": "SFTTrainer", "method": "sft", "folder": "/tmp/out", "leantune": "0", "transformers": "5",
             "step": 3, "tokenizer": False, "kind": "adapter", "peft_type": "LORA", "task_type": "CAUSAL_LM",
             "peft": "0.1", "base": "Qwen/Qwen2.5-0.5B", "model_class": "Qwen2ForCausalLM", "num_labels": 2,
             "reward": False}
    text = model_card.render(facts)
    assert "base_model: Qwen/Qwen2.5-0.5B" in text and "`Qwen/Qwen2.5-0.5B` (a Hub model id)" in text
