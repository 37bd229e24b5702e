"""TRL's trainer-level behaviour in every trainer: named eval datasets (dict / DatasetDict) each prepared and reported
per name, `evaluate(raw_dataset)` preparing what it is given, `train_dataset` required at construction, float32 as
the default dtype of a model loaded by name or path, and TRL's script keywords (`quantization_config`, a plain
`TrainingArguments`) accepted."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import TrainingArguments

from leantune import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)
from leantune.defaults import build_default_model_config, build_default_tokenizer
from leantune.models.loading import load_causal_lm

from .conftest import HH_PAIRS, _require, gsm8k_prompt_completion, tiny_model
from .test_reward import tiny_reward_model

COMMON = dict(report_to=[], save_strategy="no", use_cpu=True, per_device_train_batch_size=4,
              per_device_eval_batch_size=4, max_steps=1, seed=0, logging_steps=1, learning_rate=1e-3,
              memory_breakdown=False, disable_tqdm=True)


@pytest.fixture(scope="module")
def hh_pairs() -> Dataset:
    with gzip.open(_require(HH_PAIRS), "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for _, line in zip(range(16), handle)]
    return Dataset.from_list(rows)


@pytest.fixture(scope="module")
def char_tokenizer():
    return build_default_tokenizer()


def char_model(tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_default_model_config(tokenizer))


def prompts(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"reverse: {w} =" for w in ["cat", "dog", "bird", "fish"] * (n // 4)]})


def count_a(completions, **kwargs):
    return [text.count("a") / max(len(text), 1) for text in completions]


# --- one builder per trainer: (trainer class, kwargs of a cheap trainer, its raw train data, raw eval data) ---------


def build(kind: str, tmp_path, tokenizer, char_tok, gsm8k_rows, hh_pairs, train="default", eval_dataset=None,
          **args_overrides):
    settings = dict(COMMON, output_dir=str(tmp_path / kind), **args_overrides)
    if kind == "sft":
        data = gsm8k_prompt_completion(gsm8k_rows, 8)
        kwargs = dict(model=tiny_model(), args=SFTConfig(max_length=128, **settings), processing_class=tokenizer)
        cls = SFTTrainer
    elif kind in ("dpo", "kto"):
        data = hh_pairs.select(range(8))
        cls, config = (DPOTrainer, DPOConfig) if kind == "dpo" else (KTOTrainer, KTOConfig)
        kwargs = dict(model=tiny_model(), args=config(max_length=128, **settings), processing_class=tokenizer)
    elif kind == "reward":
        data = hh_pairs.select(range(8))
        kwargs = dict(model=tiny_reward_model(), args=RewardConfig(max_length=128, **settings),
                      processing_class=tokenizer)
        cls = RewardTrainer
    else:
        data = prompts(8)
        cls, config = (GRPOTrainer, GRPOConfig) if kind == "grpo" else (RLOOTrainer, RLOOConfig)
        settings.update(per_device_train_batch_size=2, per_device_eval_batch_size=2)
        kwargs = dict(model=char_model(char_tok), reward_funcs=count_a, processing_class=char_tok,
                      args=config(num_generations=2, max_completion_length=4, **settings))
    train_dataset = data if train == "default" else train
    return cls(train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs), data


KINDS = ["sft", "dpo", "kto", "reward", "grpo", "rloo"]


@pytest.fixture
def make(tmp_path, tokenizer, char_tokenizer, gsm8k_rows, hh_pairs):
    def _make(kind, **kwargs):
        return build(kind, tmp_path, tokenizer, char_tokenizer, gsm8k_rows, hh_pairs, **kwargs)
    _make.data = {"sft": gsm8k_prompt_completion(gsm8k_rows, 8), "dpo": hh_pairs.select(range(8)),
                  "kto": hh_pairs.select(range(8)), "reward": hh_pairs.select(range(8)), "grpo": prompts(8),
                  "rloo": prompts(8)}
    return _make


def raw_data(kind, make) -> Dataset:
    return make.data[kind]


def metric_names(metrics: dict, prefix: str) -> set[str]:
    return {name for name in metrics if name.startswith(prefix)}


# --- 1. named eval datasets: each prepared, metrics per name; 2. evaluate(raw) prepares it -----------------------


@pytest.mark.parametrize("kind", KINDS)
def test_named_eval_datasets_and_raw_evaluate(kind, make):
    data = raw_data(kind, make)
    raw_a, raw_b = data.select(range(4)), data.select(range(4, 8))
    # A DatasetDict given at construction: every split prepared (the prepared columns are there), metrics per name.
    trainer, _ = make(kind, eval_dataset=DatasetDict({"a": raw_a, "b": raw_b}), eval_strategy="steps", eval_steps=1)
    assert set(trainer.eval_dataset) == {"a", "b"}
    assert all(trainer.is_prepared(split) for split in trainer.eval_dataset.values())
    output = trainer.train()  # one optimizer step, evaluated on both splits
    assert output.global_step == 1
    logged = {name for entry in trainer.state.log_history for name in entry}
    assert metric_names(logged, "eval_a_") and metric_names(logged, "eval_b_")
    metrics = trainer.evaluate()
    per_a = {name.removeprefix("eval_a_") for name in metric_names(metrics, "eval_a_")}
    per_b = {name.removeprefix("eval_b_") for name in metric_names(metrics, "eval_b_")}
    assert per_a and per_a == per_b
    # A raw dataset passed to evaluate() is prepared first (it crashed before); a dict of raw ones, per name.
    single = trainer.evaluate(eval_dataset=raw_a)
    assert {name.removeprefix("eval_") for name in single} >= per_a - {"runtime"}
    named = trainer.evaluate(eval_dataset={"x": raw_b})
    assert metric_names(named, "eval_x_")
    # Prepared data is recognised and not prepared again.
    assert trainer.is_prepared(trainer.eval_dataset["a"]) and not trainer.is_prepared(raw_a)


# --- 3. train_dataset is required at construction, as in TRL ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_train_dataset_is_required(kind, make):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        make(kind, train=None, eval_dataset=Dataset.from_dict({"prompt": ["x"]}))


@pytest.mark.parametrize("kind", KINDS)
def test_model_carries_trls_hub_tags_and_no_router_loss(kind, make):
    """The model is tagged as TRL's trainers tag it (`trl`, the method) plus `leantune`, so a pushed model is found by
    the same Hub filters; `aux_loss_enabled` says that no MoE router loss is added."""
    trainer, _ = make(kind)
    tags = trainer.accelerator.unwrap_model(trainer.model).model_tags
    assert {"trl", "leantune", kind} <= set(tags)
    if kind == "reward":
        assert "reward-trainer" in tags  # TRL's tag for reward models
    assert trainer.aux_loss_enabled is False


# --- 4. dtype: float32 unless model_init_kwargs says otherwise -----------------------------------------------------


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("bf16-model")
    tiny_model().to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(folder)
    return str(folder)


def dtype_of(model) -> torch.dtype:
    return next(model.parameters()).dtype


def test_model_by_path_loads_float32_unless_told(bf16_folder):
    assert dtype_of(load_causal_lm(bf16_folder)) == torch.float32
    assert dtype_of(load_causal_lm(bf16_folder, {"dtype": "bfloat16"})) == torch.bfloat16
    assert dtype_of(load_causal_lm(bf16_folder, {"dtype": "auto"})) == torch.bfloat16
    assert dtype_of(load_causal_lm(bf16_folder, {"torch_dtype": "bfloat16"})) == torch.bfloat16
    assert dtype_of(load_causal_lm(bf16_folder, '{"dtype": "auto"}')) == torch.bfloat16  # the CLI's JSON form


def test_trainers_follow_the_dtype_rule(bf16_folder, hh_pairs, gsm8k_rows, tmp_path):
    sft = SFTTrainer(model=bf16_folder, args=SFTConfig(output_dir=str(tmp_path / "s"), max_length=64, **COMMON),
                     train_dataset=gsm8k_prompt_completion(gsm8k_rows, 4))
    assert dtype_of(sft.model) == torch.float32
    dpo = DPOTrainer(model=bf16_folder, ref_model=bf16_folder, train_dataset=hh_pairs.select(range(4)),
                     args=DPOConfig(output_dir=str(tmp_path / "d"), max_length=512,
                                    model_init_kwargs={"dtype": "auto"}, **COMMON))
    assert dtype_of(dpo.model) == torch.bfloat16 and dtype_of(dpo.ref_model) == torch.float32
    reward = RewardTrainer(model=bf16_folder, train_dataset=hh_pairs.select(range(4)),
                           args=RewardConfig(output_dir=str(tmp_path / "r"), max_length=512, **COMMON))
    assert dtype_of(reward.model) == torch.float32


# --- 5. TRL's script keywords --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_trl_script_keywords_are_accepted(kind, make):
    import leantune.models.loading as loading

    trainer, _ = make(kind)
    cls = type(trainer)
    args = trainer.args
    model = trainer.model
    extra = {"reward_funcs": count_a} if kind in ("grpo", "rloo") else {}
    # As TRL's scripts pass them (quantization_config=None, peft_config=None).
    again = cls(model=model, args=args, train_dataset=trainer.train_dataset, processing_class=trainer.processing_class,
                quantization_config=None, peft_config=None, **extra)
    assert again.model is model
    # A quantization_config joins model_init_kwargs for a name or path; set twice it is refused.
    assert loading.with_quantization_config("some/model", {"dtype": "auto"}, {"load_in_4bit": True}) == {
        "dtype": "auto", "quantization_config": {"load_in_4bit": True}}
    with pytest.raises(ValueError, match="both"):
        loading.with_quantization_config("some/model", {"quantization_config": {}}, {"load_in_4bit": True})


def test_sft_converts_plain_training_arguments(tokenizer, gsm8k_rows, tmp_path):
    plain = TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, max_steps=1, report_to=[], use_cpu=True,
                              save_strategy="no", per_device_train_batch_size=4, disable_tqdm=True)
    trainer = SFTTrainer(model=tiny_model(), args=plain, train_dataset=gsm8k_prompt_completion(gsm8k_rows, 4),
                         processing_class=tokenizer)
    assert isinstance(trainer.args, SFTConfig)
    assert trainer.args.learning_rate == 3e-4 and trainer.args.max_steps == 1
    assert trainer.train().global_step == 1
