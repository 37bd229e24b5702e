"""GRPO and RLOO: advantages and losses against hand-computed values, the loss through the memory engine equal to
the plain one, a short run whose reward rises, and bad input (reward functions, rewards, prompts) handled loudly."""

from __future__ import annotations

import copy
import logging
import math
import sys

import pytest
import torch
from datasets import Dataset

from leantune import GRPOTrainer, RLOOConfig, RLOOTrainer
from leantune.losses.policy_gradient import (
    clipped_surrogate,
    group_relative_advantages,
    k3_kl,
    leave_one_out_advantages,
    loss_aggregation,
    normalize_then_sum_advantages,
)
from leantune.losses.token_logprobs import count_targets
from leantune.models.checkpointing import checkpointing_setting, enable_model_checkpointing
from leantune.rewards import RewardFunctionError
from leantune.trainers.parts.logprob_engine import LogProbPath

from ..fixtures.data import count_a
from ..fixtures.data import reversal_prompts_with_answers as prompts
from ..fixtures.models import char_model, tiny_model
from ..fixtures.online_rounds import assert_grads_close, loss_and_grads, one_round
from ..fixtures.online_rounds import grpo_config as config
from ..fixtures.paths import REPO, SCRIPTS

# --- advantages and losses on small tensors -------------------------------------------------------------------


def test_group_relative_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    advantages, std = group_relative_advantages(rewards, 4, "group")
    s = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (s + 1e-4)
    # here and below: a handful of fp32 ops on values ~0.1-5, against fp32 references: a few ulps at most (measured
    # <= 0.08 of assert_close's fp32 default tolerance, rel 1.3e-6 + abs 1e-5)
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(std, torch.tensor([s, 0.0]))
    unscaled, _ = group_relative_advantages(rewards, 4, "none")
    torch.testing.assert_close(unscaled, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    batch, _ = group_relative_advantages(rewards, 4, "batch")
    torch.testing.assert_close(batch, unscaled / (rewards.std() + 1e-4))


def test_unscored_completions_leave_the_group_statistics_and_get_no_advantage():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 5.0])
    advantages, _ = group_relative_advantages(rewards, 4, "none")
    torch.testing.assert_close(advantages, torch.tensor([-2.0, 0.0, 0.0, 2.0]))
    loo, _ = leave_one_out_advantages(rewards, 4)
    # others' mean: (3 + 5) / 2 = 4 for the first; (1 + 5) / 2 = 3 for the third; (1 + 3) / 2 = 2 for the last
    torch.testing.assert_close(loo, torch.tensor([-3.0, 0.0, 0.0, 3.0]))


def test_normalize_then_sum_advantages_by_hand():
    # two functions, two groups of 2: function a is [1, 0 | 2, 2], function b [0, 4 | nan, 1] (b skipped the third)
    nan = float("nan")
    per_function = torch.tensor([[1.0, 0.0], [0.0, 4.0], [2.0, nan], [2.0, 1.0]], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5])
    got = normalize_then_sum_advantages(per_function, weights, 2)
    s = math.sqrt(0.5)  # sample std of a group of two values 1 apart; b's first group: 4 apart -> 4 x s
    a = [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.0, 0.0]
    b = [-2.0 / (4 * s + 1e-4), 2.0 / (4 * s + 1e-4), nan, 0.0]  # a group of one: (x - x) / (0 + eps) = 0
    sums = torch.tensor([a[i] + 0.5 * (0.0 if b[i] != b[i] else b[i]) for i in range(4)], dtype=torch.float64)
    expected = (sums - sums.mean()) / (sums.std() + 1e-4)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)  # float64 throughout: exact but for rounding
    unscored = normalize_then_sum_advantages(per_function.index_fill(0, torch.tensor([3]), nan), weights, 2)
    assert unscored[3] == 0.0  # no function scored it: no learning signal


def test_leave_one_out_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])
    advantages, _ = leave_one_out_advantages(rewards, 3)
    torch.testing.assert_close(advantages, torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5, 0 - 1.5, 0 - 1.5, 3 - 0.0]))
    normalised, _ = leave_one_out_advantages(rewards, 3, normalize=True)
    torch.testing.assert_close(normalised, (advantages - advantages.mean()) / (advantages.std() + 1e-4))


def test_clipped_surrogate_and_kl_by_hand():
    logps = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    old = torch.log(torch.tensor([0.25, 0.25, 1.0, 0.5]))  # ratios 2, 2, 0.5, 1
    advantages = torch.tensor([1.0, -1.0, -1.0, 3.0])
    terms = clipped_surrogate(logps, old, advantages, 0.2, 0.28)
    # -min(r A, clip(r) A): clip(2) = 1.28, clip(0.5) = 0.8
    torch.testing.assert_close(terms.loss, torch.tensor([-1.28, 2.0, 0.8, -3.0]))
    assert terms.high_clipped.tolist() == [True, False, False, False]
    assert terms.low_clipped.tolist() == [False, False, True, False]
    ref = torch.log(torch.tensor([0.25, 0.5, 1.0, 0.125]))
    delta = ref - logps
    torch.testing.assert_close(k3_kl(logps, ref), delta.exp() - delta - 1)
    assert k3_kl(logps, logps).abs().max() == 0


def test_loss_types_by_hand():
    token_loss = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    sequence = torch.tensor([0, 0, 0, 1, 2])  # three completions: 3 tokens, 1 token, 1 token
    # small integer-valued sums and means: exact in fp32 (default rel 1e-6)
    assert loss_aggregation("grpo").total(token_loss, sequence, 3).item() == pytest.approx(2.0 + 4.0 + 10.0)
    assert loss_aggregation("grpo").items(3, 5, 8) == 3
    assert loss_aggregation("dapo").total(token_loss, sequence, 3).item() == pytest.approx(20.0)
    assert loss_aggregation("dapo").items(3, 5, 8) == 5
    assert loss_aggregation("dr_grpo").total(token_loss, sequence, 3).item() == pytest.approx(20.0)
    assert loss_aggregation("dr_grpo").items(3, 5, 8) == 24
    assert loss_aggregation("bnpo").total(token_loss, sequence, 3).item() == pytest.approx(4.0)
    assert loss_aggregation("bnpo").items(3, 5, 8) == 1


# --- the trainer -----------------------------------------------------------------------------------------------


def test_a_round_is_grouped_scored_and_split_into_micro_batches(char_tokenizer):
    seen = {}

    def reward(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, ids=completion_ids)
        return [float(len(c)) for c in completions]

    args = config(gradient_accumulation_steps=2, shared_prompt=False)  # the padded layout's rows, read below
    trainer = GRPOTrainer(char_model(char_tokenizer), reward, args=args, train_dataset=prompts(),
                          processing_class=char_tokenizer)
    assert trainer.round_size == 16 and trainer.steps_per_generation == 2
    batches = one_round(trainer)
    assert len(batches) == 2
    # 4 prompts x 4 generations, groups contiguous; the answer column travels with each completion
    assert seen["prompts"][:4] == [seen["prompts"][0]] * 4 and len(set(seen["prompts"])) == 4
    assert seen["answer"][:4] == [seen["answer"][0]] * 4
    # advantages = group-standardised lengths
    lengths = torch.tensor([float(len(c)) for c in seen["completions"]])
    expected, _ = group_relative_advantages(lengths, 4, "group")
    torch.testing.assert_close(torch.cat([b["advantages"] for b in batches]), expected)
    # targets are exactly the completion tokens (the EOS included)
    for batch, ids in zip(batches, (seen["ids"][:8], seen["ids"][8:])):
        assert int(batch["loss_items"]) == sum(len(c) for c in ids)  # dapo: tokens
        targets = batch["labels"][batch["labels"] != -100].tolist()
        assert targets == [t for c in ids for t in c]
    assert "old_logps" not in batches[0]  # on-policy: no generation-time scoring needed


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_chunked_loss_equals_plain_loss_and_gradients(char_tokenizer, padding_free, loss_type):
    """The memory engine's chunked log-probs against full logits, on the same round (fp32; rel 1e-5)."""
    args = config(beta=0.1, loss_type=loss_type, padding_free=padding_free, loss_chunk_size=5)
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(),
                          processing_class=char_tokenizer)
    batch = one_round(trainer)[0]
    assert trainer.logprob_path is LogProbPath.CHUNKED
    chunked_loss, chunked_grads = loss_and_grads(trainer, batch)
    chunked_metrics = {k: list(v) for k, v in trainer.run_metrics.values["train"].items()}
    trainer.run_metrics.values["train"].clear()
    trainer.logprob_path = LogProbPath.FULL
    plain_loss, plain_grads = loss_and_grads(trainer, batch)
    # on-policy: the ratio exp(logp - logp.detach()) is exactly 1 and the k3 KL of the policy against its own copy
    # exactly 0 on both paths, so the loss value is path-independent (measured equal, as are entropy and kl)
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-5, atol=1e-7)
    assert_grads_close(chunked_grads, plain_grads)
    for name in ("entropy", "kl"):
        assert chunked_metrics[name] == pytest.approx(trainer.run_metrics.values["train"][name], rel=1e-5)


def test_padding_free_scoring_equals_padded(char_tokenizer):
    losses = []
    for padding_free in (False, True):
        args = config(beta=0.1, padding_free=padding_free)
        trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(),
                              processing_class=char_tokenizer)
        torch.manual_seed(5)
        batch = one_round(trainer)[0]
        losses.append(loss_and_grads(trainer, batch))
    assert "attention_mask" not in batch and "position_ids" in batch
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=1e-5, atol=1e-7)  # path-independent, as above
    assert_grads_close(losses[1][1], losses[0][1])


def test_activation_offloading_and_checkpointing_give_the_same_loss_and_gradients(char_tokenizer, monkeypatch):
    """Offloading pointed at a CPU target (real copies on CPU, as in test_memory_engine) and checkpointing off,
    against the defaults (checkpointing on, no offloading), on the same round."""
    from leantune.memory import offloading

    made = []
    real_context = offloading.offloading_context

    def copying_context(enabled, model=None, **kwargs):
        made.append(real_context(enabled, model, **{**kwargs, "offload_device": "cpu", "min_offload_bytes": 1024}))
        return made[-1]

    monkeypatch.setattr(offloading, "offloading_context", copying_context)
    default = GRPOTrainer(char_model(char_tokenizer), count_a, args=config(beta=0.1), train_dataset=prompts(),
                          processing_class=char_tokenizer)
    enabled, kwargs = checkpointing_setting(default.args)  # under the name this transformers reads
    assert enabled  # on by default
    enable_model_checkpointing(default.model, kwargs)
    batch = one_round(default)[0]
    expected_loss, expected_grads = loss_and_grads(default, batch)
    offloaded = GRPOTrainer(char_model(char_tokenizer), count_a,
                            args=config(beta=0.1, activation_offloading=True, gradient_checkpointing=False),
                            train_dataset=prompts(), processing_class=char_tokenizer)
    loss, grads = loss_and_grads(offloaded, batch)
    assert sum(c.stats.get("tensors_offloaded", 0) for c in made) > 0, "nothing was offloaded"
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)  # path-independent, as above
    assert_grads_close(grads, expected_grads)


def test_on_policy_first_iteration_matches_and_later_iterations_use_generation_time_logps(char_tokenizer):
    args = config(num_iterations=2, loss_type="grpo")
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(),
                          processing_class=char_tokenizer)
    batches = one_round(trainer)
    assert len(batches) == 2 and "old_logps" in batches[0]
    # before any update the stored log-probs are the policy's own: ratio 1, loss = -mean advantage per completion
    loss, _ = loss_and_grads(trainer, batches[0])
    # advantages ~1: fp32 means of 8-16 such terms round at ~1e-7 (measured 1.5e-8)
    assert loss.item() == pytest.approx(-batches[0]["advantages"].mean().item(), abs=1e-5)
    assert trainer.run_metrics.values["train"]["clip_ratio/region_mean"] == [0.0]


def test_generation_batch_size_sets_micro_batches_per_round_and_they_train_off_policy(char_tokenizer):
    args = config(generation_batch_size=24, per_device_train_batch_size=8, num_generations=4, shared_prompt=False)
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(),
                          processing_class=char_tokenizer)
    assert (trainer.round_size, trainer.steps_per_generation) == (24, 3)
    batches = one_round(trainer)
    assert len(batches) == 3 and all(int(b["num_sequences"]) == 8 for b in batches)
    # three micro-batches, one per optimizer step (no accumulation): the later ones train after the policy moved,
    # so every one carries the generation-time log-probs
    assert all("old_logps" in b and len(b["old_logps"]) == int(count_targets(b["labels"])) for b in batches)
    assert len(trainer.get_train_dataloader()) == (64 // 6) * 3  # rounds of 6 prompts, 3 micro-batches each


def test_reward_rises_in_a_short_grpo_run(char_tokenizer):
    args = config(max_steps=30, learning_rate=3e-3, per_device_train_batch_size=16, num_generations=8,
                  max_completion_length=6, temperature=1.0, logging_steps=5)
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(256),
                          processing_class=char_tokenizer)
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert len(rewards) == 6
    assert rewards[-1] > rewards[0] + 0.2, rewards  # measured 0.07 -> 0.96 at 1, 2 and 4 threads


def test_reward_rises_in_a_short_rloo_run_with_kl_in_the_reward(char_tokenizer):
    args = config(RLOOConfig, max_steps=30, learning_rate=3e-3, per_device_train_batch_size=16, num_generations=4,
                  max_completion_length=6, beta=0.01, logging_steps=5)
    trainer = RLOOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(256),
                          processing_class=char_tokenizer)
    assert trainer.ref_model is not None  # beta > 0 without PEFT: a frozen copy
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "reward" in entry]
    # measured 0.05 -> 0.93 at 1, 2 and 4 threads
    assert history[-1]["reward"] > history[0]["reward"] + 0.2, [h["reward"] for h in history]
    assert history[-1]["kl"] > 0


@pytest.mark.quick
def test_rloo_round_subtracts_beta_times_summed_log_ratio_before_the_baseline(char_tokenizer):
    args = config(RLOOConfig, beta=0.5, num_generations=2)
    captured = {}

    def reward(completions, **kwargs):
        values = [float(len(c)) for c in completions]
        captured["rewards"] = torch.tensor(values)
        return values

    trainer = RLOOTrainer(char_model(char_tokenizer), reward, args=args, train_dataset=prompts(),
                          processing_class=char_tokenizer)
    # move the policy away from the reference so the KL term is not zero
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    batch = one_round(trainer)[0]
    kl = trainer._sequence_kl(batch)
    assert kl.abs().sum() > 0
    penalised = captured["rewards"] - 0.5 * kl
    expected, _ = leave_one_out_advantages(penalised, 2)
    torch.testing.assert_close(batch["advantages"], expected, rtol=1e-5, atol=1e-6)  # advantages ~1; measured equal
    # with two generations, leave-one-out advantages are +-half the pair's difference
    torch.testing.assert_close(expected[0::2], -expected[1::2])


@pytest.mark.quick
def test_a_round_and_its_loss_enter_no_code_of_the_features_that_are_off(char_tokenizer):
    """Without shared prompts, ZeRO-3, context parallelism or a reference (beta 0), a round and its loss never enter
    those features' files: what is off was chosen away when the trainer was built (the backend and its ZeRO-3 scope,
    the target reading, the gathering, the scoring), not tested again in each round."""
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=config(shared_prompt=False),
                          train_dataset=prompts(), processing_class=char_tokenizer)
    entered = set()

    def profile(frame, event, arg):
        if event == "call":
            entered.add(frame.f_code.co_filename.replace("\\", "/"))

    sys.setprofile(profile)
    try:
        loss_and_grads(trainer, one_round(trainer)[0])
    finally:
        sys.setprofile(None)
    off = ("trainers/online/shared_prompt.py", "generation/zero3.py", "generation/backend.py",
           "trainers/parts/context_parallel.py")
    assert not [name for name in off if any(path.endswith("leantune/" + name) for path in entered)]
    assert any(path.endswith("leantune/generation/transformers_backend.py") for path in entered)  # it did generate


def test_peft_reference_is_the_adapter_disabled_and_beta_zero_loads_none(char_tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=config(beta=0.1, shared_prompt=False),
                          train_dataset=prompts(), processing_class=char_tokenizer, peft_config=lora)
    assert trainer.ref_model is None and trainer.uses_adapter_as_reference
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    batch = one_round(trainer)[0]
    base = copy.deepcopy(trainer.model).merge_and_unload()
    with torch.no_grad():
        base_copy = copy.deepcopy(trainer.model)
        with base_copy.disable_adapter():
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
            plain = torch.log_softmax(base_copy(**inputs).logits.float(), -1)
    labels = batch["labels"]
    mask = labels[:, 1:] != -100
    expected = plain[:, :-1].gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask]
    # per-token log-probs ~ -4 (small vocabulary), one log_softmax each: ulps; measured 1e-2 of the tolerance
    torch.testing.assert_close(batch["ref_logps"], expected, rtol=1e-5, atol=1e-5)
    assert base is not None
    plain_trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=config(), train_dataset=prompts(),
                                processing_class=char_tokenizer)
    assert plain_trainer.ref_model is None and not plain_trainer.uses_adapter_as_reference


@pytest.mark.quick
def test_evaluate_generates_for_held_out_prompts_and_reports_rewards(char_tokenizer):
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=config(per_device_eval_batch_size=8),
                          train_dataset=prompts(), eval_dataset=prompts(12), processing_class=char_tokenizer)
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval_reward"] <= 1.0
    assert metrics["eval_rewards/count_a/mean"] == pytest.approx(metrics["eval_reward"], abs=1e-6)  # 6 decimals
    assert 1 <= metrics["eval_completions/mean_length"] <= 8


def test_conversational_prompts_use_the_chat_template_and_completions_arrive_as_messages(tokenizer):
    seen = {}

    def reward(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [1.0] * len(completions)

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {i}"}]} for i in range(8)])
    model = tiny_model(vocab_size=len(tokenizer))
    trainer = GRPOTrainer(model, reward, args=config(max_completion_length=4), train_dataset=data,
                          processing_class=tokenizer)
    expected = tokenizer.apply_chat_template(data[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert trainer.train_dataset[0]["prompt_ids"] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    one_round(trainer)
    assert seen["prompts"][0] == [{"role": "user", "content": seen["prompts"][0][0]["content"]}]
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in seen["completions"])


def test_masked_truncated_completions_have_no_targets(char_tokenizer):
    args = config(max_completion_length=2, mask_truncated_completions=True, shared_prompt=False)  # padded rows
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(),
                          processing_class=char_tokenizer)
    rows = [trainer.train_dataset[0]] * 3
    eos = char_tokenizer.eos_token_id
    examples = trainer.rounds.scoring_examples(rows, [[5, eos], [5, 6], [eos]], [True, False, True])
    prompt = len(rows[0]["prompt_ids"])
    assert [e["completion_mask"][prompt:] for e in examples] == [[1, 1], [0, 0], [1]]
    assert trainer.round_counts["truncated_completions_masked"] == 1
    # a round where every completion is cut (a random model rarely says EOS within 2 tokens) still trains safely
    batch = one_round(trainer)[0]
    truncated = trainer.round_counts["truncated_completions_masked"] - 1
    assert int((batch["labels"] != -100).any(dim=1).logical_not().sum()) <= truncated
    loss, _ = loss_and_grads(trainer, batch)
    assert torch.isfinite(loss)


# --- bad input ---------------------------------------------------------------------------------------------------


def test_a_reward_function_that_raises_names_itself(char_tokenizer):
    def broken(completions, **kwargs):
        raise KeyError("no such column")

    trainer = GRPOTrainer(char_model(char_tokenizer), broken, args=config(), train_dataset=prompts(),
                          processing_class=char_tokenizer)
    with pytest.raises(RewardFunctionError, match="broken.*KeyError"):
        trainer.train()


def test_a_reward_function_of_the_wrong_length_is_an_error(char_tokenizer):
    trainer = GRPOTrainer(char_model(char_tokenizer), lambda completions, **kw: [1.0], args=config(),
                          train_dataset=prompts(), processing_class=char_tokenizer)
    with pytest.raises(ValueError, match="<lambda>.*1"):
        trainer.train()


def test_nan_and_missing_rewards_are_counted_and_logged(char_tokenizer, caplog):
    calls = {"n": 0}

    def flaky(completions, **kwargs):
        calls["n"] += 1
        return [float("nan") if i == 0 else (None if i == 1 else 1.0) for i in range(len(completions))]

    trainer = GRPOTrainer(char_model(char_tokenizer), flaky, args=config(max_steps=1), train_dataset=prompts(),
                          processing_class=char_tokenizer)
    with caplog.at_level(logging.WARNING, logger="leantune.online"):
        result = trainer.train()
    assert "returned NaN for 1 completion" in caplog.text
    assert result.metrics["count/nan_reward/flaky"] == 1
    assert result.metrics["count/no_reward/flaky"] == 1
    assert result.metrics["count/unscored_completions"] == 2


def test_prompts_too_long_for_the_model_are_dropped_and_counted_or_cut(char_tokenizer, caplog):
    data = Dataset.from_dict({"prompt": ["reverse: ab =", "reverse: " + "x" * 80 + " =", "", "reverse: cd ="] * 4})
    args = config(max_completion_length=8)  # the demo model's context is 64 tokens
    with caplog.at_level(logging.WARNING, logger="leantune.data"):
        trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=data,
                              processing_class=char_tokenizer)
    report = trainer.data_reports["train"]
    assert report["num_too_long_dropped"] == 4 and report["num_empty_dropped"] == 4 and report["num_prompts_out"] == 8
    assert "too long to leave max_completion_length=8" in caplog.text
    cut = GRPOTrainer(char_model(char_tokenizer), count_a, args=config(max_prompt_length=20), train_dataset=data,
                      processing_class=char_tokenizer)
    report = cut.data_reports["train"]
    assert report["num_truncated"] == 4 and report["num_too_long_dropped"] == 0
    assert max(len(ids) for ids in cut.train_dataset["prompt_ids"]) == 20
    long_only = Dataset.from_dict({"prompt": ["reverse: " + "x" * 80 + " ="] * 4})
    with pytest.raises(ValueError, match="No train prompt is left"):
        GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=long_only,
                    processing_class=char_tokenizer)


def test_configuration_errors_are_clear(char_tokenizer):
    with pytest.raises(ValueError, match="num_generations"):
        config(num_generations=1)
    with pytest.raises(ValueError, match="loss_type"):
        config(loss_type="ppo")
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode"):
        config(vllm_enable_sleep_mode=True)
    with pytest.raises(ValueError, match="not both"):
        config(generation_batch_size=16, steps_per_generation=2)
    with pytest.raises(ValueError, match="multiple of num_generations"):
        GRPOTrainer(char_model(char_tokenizer), count_a, args=config(per_device_train_batch_size=6),
                    train_dataset=prompts(), processing_class=char_tokenizer)
    with pytest.raises(ValueError, match="'prompt' column"):
        GRPOTrainer(char_model(char_tokenizer), count_a, args=config(),
                    train_dataset=Dataset.from_dict({"question": ["a"]}), processing_class=char_tokenizer)
    assert config(scale_rewards=True).scale_rewards == "group" and config(scale_rewards=False).scale_rewards == "none"
    # unset epsilon_high / num_generations_eval follow epsilon / num_generations, also when those change later
    args = config(epsilon=0.1)
    assert (args.upper_epsilon, args.eval_num_generations) == (0.1, 4)
    args.epsilon, args.num_generations = 0.3, 8
    args.__post_init__()
    assert (args.upper_epsilon, args.eval_num_generations, args.epsilon_high) == (0.3, 8, None)
    assert config(epsilon_high=0.28, num_generations_eval=2).upper_epsilon == 0.28


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vllm is installed")
def test_colocated_vllm_without_the_extra_fails_when_the_trainer_is_built(char_tokenizer):
    with pytest.raises(ImportError, match=r"pip install 'leantune\[vllm\]'"):
        GRPOTrainer(char_model(char_tokenizer), count_a, args=config(use_vllm=True), train_dataset=prompts(),
                    processing_class=char_tokenizer)


# --- two processes (CPU, gloo): groups span the processes ---------------------------------------------------------


def test_two_processes_share_groups_rewards_and_weights(tmp_path):
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = SCRIPTS / "grpo_two_processes.py"
    repo = str(REPO)  # this checkout's leantune, whatever the installed one points at
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(port), str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # DDP kept the weights identical
    assert ranks[0]["logged_rewards"] == ranks[1]["logged_rewards"]
    for step in range(2):
        # one prompt per round, its 4 completions split 2 + 2 over the processes
        rewards = torch.tensor(ranks[0]["rewards"][2 * step:2 * step + 2] + ranks[1]["rewards"][2 * step:2 * step + 2])
        expected, _ = group_relative_advantages(rewards, 4, "group")
        got = torch.tensor(ranks[0]["advantages"][step][0] + ranks[1]["advantages"][step][0])
        torch.testing.assert_close(got, expected)
        assert ranks[0]["logged_rewards"][step] == pytest.approx(rewards.mean().item(), abs=1e-6)  # 6-decimal logs
    # the processes sample different completions of the same prompt (their own seeds)
    assert ranks[0]["prompts"] == ranks[1]["prompts"]
    assert ranks[0]["completions"] != ranks[1]["completions"]
