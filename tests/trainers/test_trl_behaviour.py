"""TRL's trainer-level behaviour in every trainer: named eval datasets (dict / DatasetDict) each prepared and reported
per name, `evaluate(raw_dataset)` preparing what it is given, `train_dataset` required at construction, float32 as
the default dtype of a model loaded by name or path, and TRL's script keywords (`quantization_config`, a plain
`TrainingArguments`) accepted."""

from __future__ import annotations

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
from leantune.models.loading import load_causal_lm

from ..fixtures.data import count_a, gsm8k_prompt_completion
from ..fixtures.models import char_model, tiny_model, tiny_reward_model

COMMON = dict(report_to=[], save_strategy="no", use_cpu=True, per_device_train_batch_size=4,
              per_device_eval_batch_size=4, max_steps=1, seed=0, logging_steps=1, learning_rate=1e-3,
              memory_breakdown=False, disable_tqdm=True)


def prompts(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"reverse: {w} =" for w in ["cat", "dog", "bird", "fish"] * (n // 4)]})


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
    online = kind in ("grpo", "rloo")
    if online:  # as TRL's online trainers: the eval datasets stay the objects given, prepared aside
        assert trainer.eval_dataset["a"] is raw_a and trainer.eval_dataset["b"] is raw_b
    else:
        assert all(trainer.is_prepared(split) for split in trainer.eval_dataset.values())
    output = trainer.train()  # one optimizer step, evaluated on both splits
    assert output.global_step == 1
    logged = {name for entry in trainer.state.log_history for name in entry}
    assert metric_names(logged, "eval_a_") and metric_names(logged, "eval_b_")
    metrics = trainer.evaluate()
    per_a = {name.removeprefix("eval_a_") for name in metric_names(metrics, "eval_a_")}
    per_b = {name.removeprefix("eval_b_") for name in metric_names(metrics, "eval_b_")}
    assert per_a and per_a == per_b and "loss" in per_a  # the online methods' loss on their eval completions too
    # A raw dataset passed to evaluate() is prepared first (it crashed before); a dict of raw ones, per name.
    single = trainer.evaluate(eval_dataset=raw_a)
    assert {name.removeprefix("eval_") for name in single} >= per_a - {"runtime"}
    named = trainer.evaluate(eval_dataset={"x": raw_b})
    assert metric_names(named, "eval_x_")
    # Prepared data is recognised and not prepared again.
    if not online:
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


# --- the online trainers' reward-function callbacks, unscored warning and closing log -----------------------------


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_reward_functions_log_through_trls_callbacks(kind, make, caplog):
    """TRL hands reward functions `log_extra(column, values)` and `log_metric(name, value)`; a completion no function
    scores is named in a warning; values recorded after the last step's log reach the run's closing summary."""
    calls = []

    def judged(completions, log_extra=None, log_metric=None, **kwargs):
        log_extra("first_letter", [text[:1] for text in completions])
        log_metric("judge_calls", float(len(calls) + 1))
        calls.append(len(completions))
        return [None] * len(completions) if len(calls) == 1 else [1.0] * len(completions)

    trainer, _ = make(kind, max_steps=2, logging_steps=5)  # no step log: only the closing summary
    trainer.rewards.funcs[0] = judged
    with caplog.at_level("WARNING", logger="leantune"):
        trainer.train()
    assert "All reward functions returned None for the following kwargs" in caplog.text
    assert list(trainer._logs["extra"]["first_letter"])[-calls[-1]:] and len(calls) == 2
    summary = trainer.state.log_history[-1]
    assert "train_loss" in summary and summary["judge_calls"] == pytest.approx(1.5)  # the mean of 1 and 2
    assert summary["reward"] == pytest.approx(1.0)  # the unscored round has no reward to average


# --- TR-DPO's reference sync (sync_ref_model) ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo", "rloo"])
def test_sync_ref_model_mixes_the_policy_into_the_reference(kind, make):
    """After each optimizer step (ref_model_sync_steps=1): ref = (1 - alpha) ref + alpha policy, per parameter
    (fp32: one multiply-add per entry, so rel 1e-6)."""
    beta = {"grpo": dict(beta=0.04), "rloo": dict(beta=0.05)}.get(kind, {})
    trainer, _ = make(kind, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.25, **beta)
    if kind in ("grpo", "rloo"):  # rewards that tell completions apart, so that the first step has a gradient
        trainer.rewards.funcs[0] = lambda completions, **kwargs: [float(sum(map(ord, c)) % 7) for c in completions]
    before = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()  # one step
    policy = dict(trainer.model.named_parameters())
    moved = 0
    for name, parameter in trainer.ref_model.named_parameters():
        expected = 0.75 * before[name] + 0.25 * policy[name].detach()
        torch.testing.assert_close(parameter.detach(), expected, rtol=1e-6, atol=1e-7)
        moved += not torch.equal(parameter, before[name])
    assert moved  # the step changed the policy, and the reference followed it


def test_sync_ref_model_refuses_what_cannot_sync(make):
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        make("dpo", sync_ref_model=True, precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="beta=0.0"):
        make("grpo", sync_ref_model=True, beta=0.0)


# --- Mixture-of-Experts: the router's load-balancing loss ---------------------------------------------------------


def moe_model(tokenizer, output_router_logits: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, output_router_logits=output_router_logits,
                            router_aux_loss_coef=0.5, pad_token_id=tokenizer.pad_token_id)
    return Qwen3MoeForCausalLM(config)


@pytest.mark.parametrize("padding_free", [False, True])
def test_moe_router_loss_is_added_and_logged(padding_free, tokenizer, gsm8k_rows, tmp_path):
    """With output_router_logits=True the model's load-balancing loss, times router_aux_loss_coef (the config's 0.5
    unless set), is added to the method's loss and logged as aux_loss (TRL's rule); without it, nothing is added.
    The total equals the plain loss + coef x the model's own aux_loss (fp32, a handful of ops: rel 1e-5)."""
    from leantune.losses.token_logprobs import count_targets

    data = gsm8k_prompt_completion(gsm8k_rows, 4)
    results = {}
    for with_router in (False, True):
        args = SFTConfig(output_dir=str(tmp_path / str(with_router)), max_length=256, padding_free=padding_free,
                         **dict(COMMON, learning_rate=0.0))
        trainer = SFTTrainer(moe_model(tokenizer, with_router), args=args, train_dataset=data,
                             processing_class=tokenizer)
        assert trainer.aux_loss_enabled is with_router and trainer.router_aux_loss_coef == 0.5
        batch = trainer._prepare_inputs(trainer.data_collator(list(trainer.train_dataset)))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=count_targets(batch["labels"]))
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_real_tokens")}
        results[with_router] = (loss.item(), trainer.model(**inputs).aux_loss)
        trainer.train()
        logged = trainer.state.log_history[0]
        assert ("aux_loss" in logged) is with_router
    (plain, none), (total, aux) = results[False], results[True]
    assert none is None and aux is not None
    assert total == pytest.approx(plain + 0.5 * aux.item(), rel=1e-5)


@pytest.mark.parametrize("cls,config", [(DPOTrainer, DPOConfig), (KTOTrainer, KTOConfig)])
def test_the_policy_itself_is_refused_as_its_reference(cls, config, tokenizer, hh_pairs, tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match="ref_model"):
        cls(model=model, ref_model=model, args=config(output_dir=str(tmp_path), **COMMON),
            train_dataset=hh_pairs.select(range(8)), processing_class=tokenizer)


# --- a row's own chat-template arguments (TRL's `chat_template_kwargs` and `tools` columns) -----------------------

SHOUTING_TEMPLATE = ("{% if tools %}{{ '<tools:' + tools | length | string + '>' }}{% endif %}"
                     "{% for m in messages %}{{ '<' + (m['role'].upper() if shout else m['role']) + '>' + m['content'] }}"
                     "{% endfor %}{% if add_generation_prompt %}{{ '<ASSISTANT>' if shout else '<assistant>' }}"
                     "{% endif %}")


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto", "grpo"])
def test_rows_chat_template_kwargs_and_tools_reach_the_template(kind, char_tokenizer, tmp_path):
    import copy

    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = SHOUTING_TEMPLATE
    user = [{"role": "user", "content": "hi"}]
    answer = [{"role": "assistant", "content": "yo"}]
    rows = [{"chat_template_kwargs": {"shout": bool(i % 2)}, "tools": '[{"name": "f"}]' if i == 3 else None}
            for i in range(4)]
    if kind == "sft":
        data = [dict(row, messages=user + answer) for row in rows]
    elif kind == "dpo":
        data = [dict(row, prompt=user, chosen=answer, rejected=[{"role": "assistant", "content": "no"}])
                for row in rows]
    elif kind == "kto":
        data = [dict(row, prompt=user, completion=answer, label=i % 2 == 0) for i, row in enumerate(rows)]
    else:
        data = [dict(row, prompt=user) for row in rows]
    cls, config = {"sft": (SFTTrainer, SFTConfig), "dpo": (DPOTrainer, DPOConfig), "kto": (KTOTrainer, KTOConfig),
                   "grpo": (GRPOTrainer, GRPOConfig)}[kind]
    settings = dict(COMMON, output_dir=str(tmp_path))
    extra = dict(reward_funcs=count_a) if kind == "grpo" else {}
    if kind == "grpo":
        settings.update(num_generations=2, per_device_train_batch_size=2, max_completion_length=4)
    trainer = cls(char_model(tok), args=config(**settings), train_dataset=Dataset.from_list(data),
                  processing_class=tok, **extra)
    prepared = trainer.train_dataset
    column = {"sft": "input_ids", "grpo": "prompt_ids"}.get(kind, "prompt_ids")
    texts = [tok.decode(row[column]) for row in prepared]
    assert sum("<USER>hi" in text for text in texts) == 2 and sum("<user>hi" in text for text in texts) == 2
    assert sum("<tools:1>" in text for text in texts) == 1


def test_grpo_takes_trls_keywords_and_names_what_it_lacks(char_tokenizer, tmp_path):
    args = GRPOConfig(num_generations=2, max_completion_length=4,
                      **dict(COMMON, output_dir=str(tmp_path), per_device_train_batch_size=2))
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(char_model(char_tokenizer), args=args, train_dataset=prompts(8), processing_class=char_tokenizer)
    # the agentic keywords are taken (tests/rollouts/test_grpo_tools.py); a value of the wrong kind is an error naming them
    for keyword in ("tools", "rollout_func", "environment_factory"):
        with pytest.raises(ValueError, match=f"`{keyword}`"):
            GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(8),
                        processing_class=char_tokenizer, **{keyword: object()})
