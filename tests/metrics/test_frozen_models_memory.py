"""Frozen models (a reference copy, reward models, a distillation teacher) in the memory breakdown and in the plan.

Their weights are resident through the whole step, so they are a part of their own, `frozen_models`, counted once per
storage and included in the peak; a PEFT base that serves as the reference (adapter disabled) is the trained model's
and is not counted again. Every number compared here is a sum of byte sizes of tensors (integers, no rounding): the
frozen part must equal the frozen models' weight bytes exactly, and two runs that differ only by holding a frozen model
must differ by exactly those bytes. The plan runs the same trainer with fake weights, so it must report the same
bytes as the real run's breakdown.
"""

from __future__ import annotations

import contextlib
import io

import torch
from datasets import Dataset

from leantune import (
    DPOConfig,
    DPOTrainer,
    GKDConfig,
    GKDTrainer,
    GRPOConfig,
    GRPOTrainer,
    OnlineDPOConfig,
    OnlineDPOTrainer,
    PPOConfig,
    PPOTrainer,
)
from leantune.defaults import build_default_model_config
from leantune.planning import plan_memory

WORDS = ["cat", "dog", "bird", "fish", "tree", "lake", "road", "moon"]
RUN = dict(output_dir="/tmp/leantune-test-frozen", use_cpu=True, report_to=[], save_strategy="no", max_steps=2,
           per_device_train_batch_size=4, disable_tqdm=True, memory_breakdown=True, seed=0)


def config_of(tokenizer, layers: int = 2, labels: int | None = None):
    """The demo's Llama shape (~100-token vocabulary), hidden 64: a few hundred KiB of weights."""
    config = build_default_model_config(tokenizer)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 64, 128, layers
    if labels is not None:
        config.num_labels = labels
    return config


def model_of(config, seed: int = 0, classifier: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    return (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(config)


def weight_bytes(model) -> int:
    """Bytes of a model's weights and buffers, each storage once (a tied head shares the embedding's)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def pairs():
    return Dataset.from_dict({"prompt": [f"reverse: {w} =" for w in WORDS], "chosen": [f" {w[::-1]}" for w in WORDS],
                              "rejected": [f" {w}" for w in WORDS]})


def prompts():
    return Dataset.from_dict({"prompt": [f"reverse: {w} =" for w in WORDS]})


def completions():
    return Dataset.from_dict({"prompt": [f"reverse: {w} =" for w in WORDS], "completion": [f" {w[::-1]}" for w in WORDS]})


def length_reward(completions, **kwargs):
    return [float(len(text) % 5) for text in completions]


def trained(trainer):
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    breakdown = trainer.memory_breakdown
    assert breakdown.peak_bytes == sum(breakdown.parts.values())  # the peak is the sum of its parts, frozen included
    return breakdown


def test_frozen_models_are_their_own_part_of_the_measured_peak(char_tokenizer):
    from peft import LoraConfig

    config = config_of(char_tokenizer)
    policy_bytes = weight_bytes(model_of(config))
    dpo = {}
    for label, fields, peft in [("copy", {}, None), ("precomputed", {"precompute_ref_log_probs": True}, None),
                                ("peft", {}, LoraConfig(r=4, task_type="CAUSAL_LM"))]:
        trainer = DPOTrainer(model=model_of(config), args=DPOConfig(**RUN, max_length=64, **fields),
                             train_dataset=pairs(), processing_class=char_tokenizer, peft_config=peft)
        dpo[label] = trained(trainer)
    # the reference copy is the initial policy: its bytes exactly; precomputed log-probs and a disabled adapter hold
    # no second copy (the PEFT base is the trained model's parameters, not counted twice)
    assert dpo["copy"].parts["frozen_models"] == policy_bytes
    assert dpo["precomputed"].parts.get("frozen_models", 0) == 0 and dpo["peft"].parts.get("frozen_models", 0) == 0
    assert dpo["copy"].parts["parameters"] == dpo["precomputed"].parts["parameters"]
    assert dpo["peft"].parts["parameters"] >= policy_bytes - 1024  # the base (minus its buffers) plus adapters
    # same data, same steps: everything else is identical, and the peak is higher by exactly the reference's weights
    assert dpo["copy"].peak_bytes - dpo["precomputed"].peak_bytes == policy_bytes

    grpo = {}
    for beta in (0.04, 0.0):
        trainer = GRPOTrainer(model=model_of(config), reward_funcs=length_reward, train_dataset=prompts(),
                              args=GRPOConfig(**RUN, beta=beta, num_generations=4, max_completion_length=8,
                                              shared_prompt=False),  # the peak at the same moment in both runs
                              processing_class=char_tokenizer)
        grpo[beta] = trained(trainer)
    assert grpo[0.04].parts["frozen_models"] == policy_bytes and grpo[0.0].parts.get("frozen_models", 0) == 0
    assert grpo[0.04].peak_bytes - grpo[0.0].peak_bytes == policy_bytes

    teacher = model_of(config_of(char_tokenizer, layers=3), seed=1)
    trainer = GKDTrainer(model=model_of(config), teacher_model=teacher, train_dataset=completions(),
                         args=GKDConfig(**RUN, max_length=64, lmbda=0.0), processing_class=char_tokenizer)
    gkd = trained(trainer)
    assert gkd.parts["frozen_models"] == weight_bytes(teacher) != policy_bytes
    assert "frozen models" in gkd.line() and gkd.as_metrics()["memory_frozen_models_mb"] > 0


def _measured(trainer_class, config_class, tokenizer, dataset, fields, **models):
    args = config_class(**{**RUN, **fields})
    return trained(trainer_class(args=args, train_dataset=dataset, processing_class=tokenizer, **models))


def test_plan_of_online_dpo_ppo_and_gkd_equals_their_measured_step(char_tokenizer, tmp_path):
    """The reference copy appears in the plan with its exact weight bytes; a reward model given by folder and a teacher
    given by config are built fake (config only) and counted as the real run counts them. (GRPO's beta 0.04 vs 0 in the
    plan: bench/plan_accuracy.py, docs/benchmarks.md.)"""
    config = config_of(char_tokenizer)
    reward_dir = tmp_path / "reward"
    reward = model_of(config_of(char_tokenizer, labels=1), seed=2, classifier=True)
    reward.save_pretrained(reward_dir)
    char_tokenizer.save_pretrained(reward_dir)
    policy_bytes, reward_bytes = weight_bytes(model_of(config)), weight_bytes(reward)
    teacher_config = config_of(char_tokenizer, layers=3)
    cases = [
        ("online-dpo", OnlineDPOTrainer, OnlineDPOConfig, prompts(), dict(max_new_tokens=8, max_length=48),
         {"reward_funcs": length_reward}, policy_bytes),  # the reference copy alone, its exact weight bytes
        ("ppo", PPOTrainer, PPOConfig, prompts(), dict(max_completion_length=8),
         {"reward_funcs": [str(reward_dir)]}, policy_bytes + reward_bytes),
        ("gkd", GKDTrainer, GKDConfig, completions(), dict(max_length=64, max_new_tokens=8, lmbda=1.0),
         {"teacher_model": teacher_config}, weight_bytes(model_of(teacher_config))),
    ]
    for method, trainer_class, config_class, dataset, fields, frozen, frozen_bytes in cases:
        plan = plan_memory(config, dataset, method, processing_class=char_tokenizer, max_batches=1, **fields,
                           **frozen, per_device_train_batch_size=4)
        models = {"teacher_model": model_of(teacher_config)} if method == "gkd" else frozen
        measured = _measured(trainer_class, config_class, char_tokenizer, dataset, fields, model=model_of(config),
                             **models)
        predicted = plan.measured_step
        assert measured.parts["frozen_models"] == frozen_bytes, method
        # byte sums of the same tensors (real in the run, fake in the plan): equal to the byte, part by part
        assert predicted.parts == measured.parts, method
        assert predicted.peak_bytes == measured.peak_bytes, method
        assert plan.worst.peak_bytes >= predicted.peak_bytes


def test_frozen_storages_are_counted_once_and_by_their_partition():
    """A frozen model sharing the trained model's storage (PEFT's base behind a disabled adapter) adds nothing; a ZeRO-3
    engine's placeholder parameter counts by the partition it holds; the part survives the frozen model's forward."""
    from leantune.metrics.memory_breakdown import StepMemoryMeter

    policy = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of fp32 weights
    frozen = torch.nn.Linear(256, 256, bias=False).requires_grad_(False)
    partitioned = torch.nn.Linear(256, 256, bias=False).requires_grad_(False)
    partitioned.weight.ds_tensor = torch.zeros(256 * 128)  # this process's half, the parameter itself a placeholder
    partitioned.weight.data = torch.empty(0)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    meter = StepMemoryMeter("cpu")
    meter.start(policy, optimizer, frozen_models=[frozen, policy, partitioned])
    with torch.no_grad():
        target = frozen(torch.ones(1, 256))  # its forward: MemTracker meets the frozen weights as module parameters
    (policy(torch.ones(1, 256)) - target).square().sum().backward()
    optimizer.step()
    breakdown = meter.stop(1)
    assert breakdown.parts["parameters"] == 256 * 256 * 4
    assert breakdown.parts["frozen_models"] == 256 * 256 * 4 + 256 * 128 * 4
    assert breakdown.peak_bytes == sum(breakdown.parts.values())


def test_plan_help_lists_the_planned_methods_fields(tmp_path, monkeypatch):
    """`leantune plan --method X --help` has an entry of its own with X's config fields, kept in the user's cache as
    it was rendered."""
    from leantune.cli.help_cache import cached_help, help_entry
    from leantune.cli.help_render import help_text, render_help

    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(tmp_path))
    for method, title in [("dpo", "DPOConfig"), ("online_dpo", "OnlineDPOConfig"), ("ppo", "PPOConfig"),
                          ("gkd", "GKDConfig"), ("sft", "SFTConfig")]:
        entry = help_entry("plan", ["--model_name_or_path", "m", "--method", method])
        text = help_text(entry)
        assert f"{title} (the method's own fields)" in text, method
        assert cached_help(entry) == text == render_help(entry), entry
    assert "--reward_funcs" in help_text(help_entry("plan", ["--method=ppo"]))
    assert "--reward_funcs" not in help_text(help_entry("plan", []))


def test_plan_command_plans_ppo_and_gkd_with_their_frozen_models(char_tokenizer, tmp_path, capsys):
    """`leantune plan --method ppo --reward_funcs FOLDER` and `--method gkd --teacher_model_name_or_path FOLDER`: the
    folders hold config.json and a tokenizer only (no weights), and the frozen models are a line of the plan."""
    import json

    from leantune.cli.main import main

    for name, config in [("policy", config_of(char_tokenizer)), ("teacher", config_of(char_tokenizer, layers=3)),
                         ("reward", config_of(char_tokenizer, labels=1))]:
        config.save_pretrained(tmp_path / name)
        char_tokenizer.save_pretrained(tmp_path / name)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in completions()))
    common = ["--model_name_or_path", str(tmp_path / "policy"), "--dataset_name", str(data),
              "--per_device_train_batch_size", "4"]
    for method, extra in [("ppo", ["--reward_funcs", str(tmp_path / "reward"), "--max_completion_length", "8"]),
                          ("gkd", ["--teacher_model_name_or_path", str(tmp_path / "teacher"), "--max_length", "64",
                                   "--plan_json", str(tmp_path / "gkd.json")])]:
        assert main(["plan", "--method", method, *common, *extra]) == 0, method
        assert "frozen models" in capsys.readouterr().out, method
    plan = json.loads((tmp_path / "gkd.json").read_text())
    teacher = model_of(config_of(char_tokenizer, layers=3))
    assert plan["measured_step"]["parts"]["frozen_models"] == weight_bytes(teacher)
    assert not any(tmp_path.glob("*/*.safetensors"))  # nothing to read but configs
