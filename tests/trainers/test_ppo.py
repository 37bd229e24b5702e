"""PPO: its per-token pieces and loss against hand / plain-torch computations, the loss and gradients equal over
padded, padding-free, chunked and full-logits scoring, the value function's layouts (a head on the policy's body,
with PEFT one adapter plus the head; a separate value model), saving, a short run that learns, and clear errors."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from leantune import PPOConfig, PPOTrainer
from leantune.losses.ppo import (
    clipped_value_loss,
    gae_advantages,
    kl_penalised_rewards,
    moments,
    token_kl,
    whiten,
)
from leantune.models.value_head import VALUE_WEIGHTS_NAME, attach_value_function
from leantune.trainers.parts.logprob_engine import LogProbPath

from ..fixtures.data import count_a
from ..fixtures.data import reversal_prompts_with_answers as prompts
from ..fixtures.models import char_model
from ..fixtures.online_rounds import assert_grads_close, loss_and_grads


def config(**overrides):
    settings = dict(output_dir="/tmp/leantune-test-ppo", use_cpu=True, report_to=[], save_strategy="no",
                    per_device_train_batch_size=8, max_completion_length=8, max_steps=2, learning_rate=1e-3,
                    logging_steps=1, disable_tqdm=True, memory_breakdown=False, seed=0, temperature=1.0)
    settings.update(overrides)
    return PPOConfig(**settings)


def ppo_trainer(tokenizer, seed: int = 0, value_model=None, **overrides):
    trainer = PPOTrainer(args=config(**overrides), processing_class=tokenizer, model=char_model(tokenizer, seed),
                         reward_model=count_a, train_dataset=prompts(), value_model=value_model)
    if value_model is None:  # a value head that is not 0 everywhere (it starts at 0), the same in every trainer
        head = trainer.value_function.head.summary
        with torch.no_grad():
            head.weight.copy_(torch.linspace(-1, 1, head.weight.numel()).view_as(head.weight))
            head.bias.fill_(0.1)
    return trainer


def one_round(trainer, seed: int = 5):
    trainer.model_wrapped = trainer.model
    rows = [trainer.train_dataset[i] for i in range(trainer.round_size // trainer.args.num_generations)]
    torch.manual_seed(seed)
    return trainer.generation_round(rows)


def off_policy(batch: dict) -> dict:
    """The micro-batch as a later PPO epoch sees it: generation-time log-probs and values moved away from the current
    ones, so that both clips act on some tokens (fixed shifts: the same in every layout)."""
    batch = dict(batch)
    n = len(batch["old_logps"])
    shift = torch.tensor([0.5, -0.5, 0.05, 0.0]).repeat(n // 4 + 1)[:n]
    batch["old_logps"] = batch["old_logps"] + shift
    batch["old_values"] = batch["old_values"] - 2 * shift
    return batch


# --- the per-token pieces by hand ----------------------------------------------------------------------------------


@pytest.mark.quick
def test_kl_rewards_whitening_gae_and_value_loss_by_hand():
    logps = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5, -2.0, -2.5], dtype=torch.float64)
    torch.testing.assert_close(token_kl(logps, ref, "k1"), logps - ref, rtol=0, atol=0)
    d = [r - p for r, p in zip(ref.tolist(), logps.tolist())]
    torch.testing.assert_close(token_kl(logps, ref, "k3"), torch.tensor([math.exp(x) - x - 1 for x in d],
                                                                         dtype=torch.float64))
    # two completions: 3 tokens and 2 tokens; a third with no target token gets nothing
    sequence = torch.tensor([0, 0, 0, 1, 1])
    kl = token_kl(logps, ref, "k1")  # [0.5, -1, 0, -1, 1]
    rewards = kl_penalised_rewards(kl, torch.tensor([2.0, -1.0, 7.0], dtype=torch.float64), sequence, 0.1)
    expected = [-0.05, 0.1, 0.0 + 2.0, 0.1, -0.1 - 1.0]  # the score on each completion's last token
    torch.testing.assert_close(rewards, torch.tensor(expected, dtype=torch.float64))
    # GAE written out: delta_t = r_t + g V_{t+1} - V_t, A_t = delta_t + g l A_{t+1}, V after the end = 0
    values = torch.tensor([0.3, -0.2, 0.5, 1.0, 0.4], dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    hand = []
    for span in ([0, 1, 2], [3, 4]):
        running, out = 0.0, []
        for k in reversed(range(len(span))):
            following = values[span[k + 1]].item() if k + 1 < len(span) else 0.0
            delta = expected[span[k]] + gamma * following - values[span[k]].item()
            running = delta + gamma * lam * running
            out.append(running)
        hand += out[::-1]
    advantages = gae_advantages(rewards, values, sequence, 3, gamma, lam)
    torch.testing.assert_close(advantages, torch.tensor(hand, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # whitening from summed moments: unbiased variance, mean kept or not
    x = torch.tensor([1.0, 2.0, 4.0, 7.0], dtype=torch.float64)
    std = math.sqrt(sum((v - 3.5) ** 2 for v in x.tolist()) / 3)
    totals = moments(x[:2]) + moments(x[2:])  # two processes' moments, summed
    torch.testing.assert_close(whiten(x, totals), (x - 3.5) / math.sqrt(std ** 2 + 1e-8))
    torch.testing.assert_close(whiten(x, totals, shift_mean=False), (x - 3.5) / math.sqrt(std ** 2 + 1e-8) + 3.5)
    assert whiten(x[:0], moments(x[:0])).numel() == 0  # a round whose completions were all masked out
    # clipped value loss: 0.5 max((V - R)^2, (clip(V, V_old +- 0.2) - R)^2)
    new = torch.tensor([1.0, -0.3, 0.5, 0.0])
    old = torch.tensor([0.5, 0.1, 0.5, 0.1])
    returns = torch.tensor([1.0, -1.0, 0.0, 1.0])
    loss, clipped = clipped_value_loss(new, old, returns, 0.2)
    # first: clip(1.0) = 0.7 -> 0.09 > 0; second: clip(-0.3) = -0.1 -> 0.81 > 0.49; third: V = V_old; fourth: inside
    torch.testing.assert_close(loss, 0.5 * torch.tensor([0.09, 0.81, 0.25, 1.0]))
    assert clipped.tolist() == [True, True, False, False]


# --- a round and the loss, against plain torch ---------------------------------------------------------------------


@pytest.mark.quick
def test_round_and_loss_match_plain_torch(char_tokenizer):
    """The round's rewards, GAE and whitening recomputed from its stored log-probs, values and scores; the loss and
    its gradients recomputed from full logits and the hidden states transformers returns."""
    trainer = ppo_trainer(char_tokenizer, kl_coef=0.2, kl_estimator="k3", whiten_rewards=True, gamma=0.95, lam=0.9,
                          missing_eos_penalty=0.5, gradient_accumulation_steps=2, num_ppo_epochs=2)
    assert trainer.round_size == 16 and trainer.steps_per_generation == 2  # 2 micro-batches, trained twice
    assert not trainer.generation.sampling.logprobs  # generate keeps no per-step scores: no [batch x length x vocabulary]
    batches = one_round(trainer)
    assert len(batches) == 4 and batches[2]["old_logps"] is batches[0]["old_logps"]
    args = trainer.args
    # recomputation in plain torch of what the round stored: per completion (list loops), float64
    flat_rewards, flat_values, spans, start = [], [], [], 0
    for batch in batches[:2]:
        labels = batch["labels"]
        for row in range(labels.shape[0]):
            length = int((labels[row] != -100).sum())
            spans.append(list(range(start, start + length)))
            start += length
        flat_values.append(batch["old_values"].double())
        kl = batch["ref_logps"].double() - batch["old_logps"].double()
        flat_rewards.append(-args.kl_coef * (kl.exp() - kl - 1))
    rewards, values = torch.cat(flat_rewards), torch.cat(flat_values)
    completions = [char_tokenizer.decode([t for t in batch["labels"][row].tolist() if t != -100],
                                         skip_special_tokens=True)
                   for batch in batches[:2] for row in range(batch["labels"].shape[0])]
    ended = [batch["labels"][row][batch["labels"][row] != -100][-1].item() == char_tokenizer.eos_token_id
             for batch in batches[:2] for row in range(batch["labels"].shape[0])]
    assert not all(ended), "no completion was cut: the missing-EOS penalty is not exercised"
    scores = [s - (0.0 if e else 0.5) for s, e in zip(count_a(completions), ended)]
    for span, score in zip(spans, scores):
        rewards[span[-1]] += score
    rewards = (rewards - rewards.mean()) / rewards.std() + rewards.mean()  # whitened, the mean kept (std: unbiased)
    advantages = torch.zeros_like(rewards)
    for span in spans:
        running = 0.0
        for k in reversed(range(len(span))):
            following = values[span[k + 1]] if k + 1 < len(span) else 0.0
            running = rewards[span[k]] + args.gamma * following - values[span[k]] + args.gamma * args.lam * running
            advantages[span[k]] = running
    returns = advantages + values
    whitened = (advantages - advantages.mean()) / advantages.std()
    # float32 storage of float64 recomputations of ~1-magnitude values: 1e-5 relative is ~100 fp32 ulps
    torch.testing.assert_close(torch.cat([b["returns"] for b in batches[:2]]).double(), returns, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([b["token_advantages"] for b in batches[:2]]).double(), whitened,
                               rtol=1e-5, atol=1e-5)

    # the loss of an off-policy micro-batch, from full logits and transformers' own last hidden states
    batch = off_policy(batches[0])
    loss, grads = loss_and_grads(trainer, batch)
    model = trainer.model
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    labels = batch["labels"]
    mask = labels[:, 1:] != -100
    logps = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(
        -1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask]
    head = trainer.value_function.head.summary
    v = (out.hidden_states[-1][:, :-1][mask].float() @ head.weight.T + head.bias).squeeze(-1)
    ratio = (logps - batch["old_logps"]).exp()
    adv = batch["token_advantages"]
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.cliprange, 1 + args.cliprange))
    v_clip = batch["old_values"] + (v - batch["old_values"]).clamp(-args.cliprange_value, args.cliprange_value)
    vf = 0.5 * torch.max((v - batch["returns"]) ** 2, (v_clip - batch["returns"]) ** 2)
    expected = (pg.sum() + args.vf_coef * vf.sum()) / mask.sum()
    expected.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    metrics = trainer.run_metrics.values["train"]
    assert 0 < metrics["policy/clipfrac"][-1] < 1 and 0 < metrics["val/clipfrac"][-1] < 1  # both clips act
    # a sum of ~60 fp32 terms of magnitude ~1, against the same terms from full logits: rel 1e-5 is tens of ulps
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert any("ppo_value_function" in name for name in grads)  # the value head trains with the policy
    assert_grads_close(grads, plain)


@pytest.mark.quick
@pytest.mark.parametrize("value_model", [False, True])
def test_padded_padding_free_chunked_and_full_give_one_loss_and_gradient(char_tokenizer, value_model, tmp_path):
    """The same round scored padded and padding-free (segment attention), each with the chunked head and full
    logits; with a head on the policy's body, and with a separate value model (a sequence-classification model,
    given as a folder to the padded trainer and as the object to the padding-free one)."""
    from transformers import AutoModelForSequenceClassification

    from leantune.defaults import build_default_model_config

    def value():
        torch.manual_seed(1)
        cfg = build_default_model_config(char_tokenizer)
        cfg.num_labels, cfg.pad_token_id = 1, char_tokenizer.pad_token_id
        return AutoModelForSequenceClassification.from_config(cfg)

    results = {}
    for padding_free in (False, True):
        given = value() if value_model else None
        if given is not None and not padding_free:
            given.save_pretrained(tmp_path / "value")
            given = str(tmp_path / "value")
        trainer = ppo_trainer(char_tokenizer, value_model=given, padding_free=padding_free, loss_chunk_size=5,
                              kl_coef=0.1)
        batch = off_policy(one_round(trainer)[0])
        assert ("attention_mask" in batch) != padding_free
        assert trainer.logprob_path is LogProbPath.CHUNKED
        results[padding_free, "chunked"] = loss_and_grads(trainer, batch)
        trainer.logprob_path = LogProbPath.FULL
        results[padding_free, "full"] = loss_and_grads(trainer, batch)
    reference_loss, reference_grads = results[False, "full"]
    if value_model:
        assert any("value_model.score" in name for name in reference_grads)
        assert not trainer.reads_hidden_states
    for key, (loss, grads) in results.items():
        # the same per-token terms summed in other orders / chunked fp32 log-softmaxes: rel 1e-5 (tens of ulps);
        # measured: losses equal, gradients within 2.7e-7 of each tensor's largest entry
        torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-7, msg=str(key))
        assert_grads_close(grads, reference_grads)


# --- the value function's layouts, saving, learning ----------------------------------------------------------------


def text_length(completions, **kwargs):
    return [float(len(text)) for text in completions]


def test_reward_rises_in_a_short_ppo_run(char_tokenizer):
    args = config(max_steps=30, learning_rate=3e-3, lr_scheduler_type="constant", per_device_train_batch_size=16,
                  max_completion_length=6, logging_steps=5, num_ppo_epochs=2)
    trainer = PPOTrainer(args=args, processing_class=char_tokenizer, model=char_model(char_tokenizer),
                         reward_model=count_a, train_dataset=prompts(256))
    trainer.train()
    history = trainer.state.log_history
    rewards = [entry["reward"] for entry in history if "reward" in entry]
    assert len(rewards) == 6
    assert max(rewards[-2:]) > rewards[0] + 0.1, rewards  # measured 0.019 -> 0.185, 0.179 at 1, 2 and 4 threads
    assert all(math.isfinite(entry["loss/value"]) for entry in history if "loss/value" in entry)


def test_peft_shares_one_frozen_base_and_saves_the_value_head_beside_the_adapter(char_tokenizer, tmp_path, caplog):
    """With LoRA: one frozen base, the policy's adapter and the value head train, the reference is the adapter
    disabled; the saved folder is the adapter as PEFT writes it, the value head beside it."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = PPOTrainer(args=config(output_dir=str(tmp_path)), processing_class=char_tokenizer,
                         model=char_model(char_tokenizer), reward_model=text_length, train_dataset=prompts(),
                         peft_config=lora)
    assert trainer.ref_model is None and trainer.uses_adapter_as_reference and trainer.reads_hidden_states
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "ppo_value_function" in n for n in trainable)
    assert any("ppo_value_function" in n for n in trainable)
    before = trainer.value_function.head.summary.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, trainer.value_function.head.summary.weight)  # the head trained
    trainer.save_model(str(tmp_path))
    assert {"adapter_model.safetensors", VALUE_WEIGHTS_NAME} <= set(os.listdir(tmp_path))
    assert not any("value" in key for key in load_file(str(tmp_path / "adapter_model.safetensors")))
    saved = load_file(str(tmp_path / VALUE_WEIGHTS_NAME))
    torch.testing.assert_close(saved["head.summary.weight"], trainer.value_function.head.summary.weight.detach())
    assert hasattr(trainer.model, "ppo_value_function")  # put back after the save
    resumed = PPOTrainer(args=config(output_dir=str(tmp_path)), processing_class=char_tokenizer,
                         model=char_model(char_tokenizer), reward_model=text_length, train_dataset=prompts(),
                         peft_config=lora)
    with caplog.at_level(logging.WARNING, logger="transformers"):
        # what resume_from_checkpoint does before training goes on: Trainer loads the policy (no weight reported
        # missing), then the trainer's own state at the start of training
        resumed._load_from_checkpoint(str(tmp_path))
    assert "missing" not in caplog.text
    resumed.load_extra_state(str(tmp_path))
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)  # adapter and value head, bit for bit


def test_configuration_errors_are_clear(char_tokenizer):
    with pytest.raises(ValueError, match="`beta` is not a PPO field: PPO uses `kl_coef`"):
        config(beta=0.1)
    with pytest.raises(ValueError, match="`num_iterations` is not a PPO field: PPO uses `num_ppo_epochs`"):
        config(num_iterations=2)
    with pytest.raises(ValueError, match="`kl_estimator` must be one of"):
        config(kl_estimator="k2")
    with pytest.raises(ValueError, match="`missing_eos_penalty` must be positive"):
        config(missing_eos_penalty=-1.0)
    assert PPOConfig(output_dir="/tmp/leantune-test-ppo", response_length=12).max_completion_length == 12
    with pytest.raises(ValueError, match="`response_length` \\(12\\) and `max_completion_length` \\(8\\) are one"):
        config(response_length=12)
    resolved = config(num_ppo_epochs=3, num_mini_batches=2, gradient_accumulation_steps=2)
    assert resolved.num_iterations == 3 and resolved.generation_plan(1) == (32, 4)
    with pytest.raises(ValueError, match="No reward source"):
        PPOTrainer(args=config(), processing_class=char_tokenizer, model=char_model(char_tokenizer),
                   train_dataset=prompts())
    with pytest.raises(ValueError, match="`data_collator`"):
        PPOTrainer(args=config(), processing_class=char_tokenizer, model=char_model(char_tokenizer),
                   reward_model=count_a, train_dataset=prompts(), data_collator=lambda rows: rows)
    no_reference = ppo_trainer(char_tokenizer, kl_coef=0.0)
    assert no_reference.ref_model is None and "ref_logps" not in one_round(no_reference)[0]


def test_a_load_of_the_policy_as_saved_does_not_miss_the_value_function():
    """A checkpoint holds the policy as given (the value function in its own file): Trainer's strict or non-strict
    load of it into the policy with its value function attached reports nothing missing."""
    policy = torch.nn.Sequential(torch.nn.Linear(2, 2))
    saved = {name: value.clone() for name, value in policy.state_dict().items()}
    attach_value_function(policy, torch.nn.Linear(2, 1))
    assert policy.load_state_dict(saved, strict=True).missing_keys == []
    with pytest.raises(RuntimeError, match="Missing key"):  # any other weight missing is still reported
        policy.load_state_dict({}, strict=True)


def test_reward_model_path_is_trl_s_ppo_reward_model(char_tokenizer, tmp_path):
    """TRL's PPO names its reward model by `reward_model_path`; Online DPO's config refuses that field (its TRL form
    is unused), PPO's takes it: the model is loaded, held frozen, and scores the round."""
    import copy

    from transformers import AutoModelForSequenceClassification

    policy = char_model(char_tokenizer)
    reward_config = copy.deepcopy(policy.config)
    reward_config.num_labels = 1
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(reward_config).save_pretrained(tmp_path / "rm")
    char_tokenizer.save_pretrained(tmp_path / "rm")
    trainer = PPOTrainer(args=config(reward_model_path=str(tmp_path / "rm")), processing_class=char_tokenizer,
                         model=policy, train_dataset=prompts())
    held = [m for m in trainer.frozen_models() if isinstance(m, AutoModelForSequenceClassification._model_mapping[
        type(reward_config)])]
    assert len(held) == 1 and not any(p.requires_grad for p in held[0].parameters())
    batch = one_round(trainer)[0]
    assert torch.isfinite(batch["scores"]).all()  # the round was scored by the reward model


# --- the command line ----------------------------------------------------------------------------------------------


def test_cli_trains_a_local_model_with_a_reward_function_and_refuses_grpo_fields(tokenizer, gsm8k_rows, tmp_path,
                                                                                 capsys):
    import json

    from leantune.cli.main import main

    from ..fixtures.models import tiny_model

    model_dir, data, out = tmp_path / "model", tmp_path / "gsm8k.jsonl", tmp_path / "out"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with open(data, "w", encoding="utf-8") as handle:
        for row in gsm8k_rows[:8]:
            handle.write(json.dumps({"prompt": row["question"], "answer": row["answer"]}) + "\n")
    base = ["ppo", "--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--use_cpu", "true",
            "--reward_funcs", "correct_answer", "characters_in_place", "--output_dir", str(out), "--report_to", "none"]
    code = main([*base, "--max_steps", "2", "--per_device_train_batch_size", "4", "--response_length", "8",
                 "--max_prompt_length", "64", "--num_ppo_epochs", "2", "--kl_estimator", "k3", "--logging_steps", "1"])
    assert code == 0
    assert {"model.safetensors", VALUE_WEIGHTS_NAME} <= set(os.listdir(out))
    text = capsys.readouterr().out
    assert "=== leantune ppo summary ===" in text and "steps: 2 in" in text and "correct_answer:" in text
    assert main([*base, "--beta", "0.1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--beta" in error[0] and "--kl_coef" in error[0]

