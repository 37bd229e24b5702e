"""Online DPO: the pair choice and loss by hand, the trainer's loss and gradients equal to plain torch on a real round
(padded, padding-free, chunked and full logits), the PEFT reference, a short run whose reward rises with beta per
epoch, the command line, and bad settings refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from leantune import OnlineDPOConfig, OnlineDPOTrainer
from leantune.cli.main import main
from leantune.data.prompt_preparation import PROMPT_IDS
from leantune.losses.preference import chosen_and_rejected, preferred_in_pairs
from leantune.losses.token_logprobs import TargetScores
from leantune.trainers.parts.logprob_engine import LogProbPath

from ..fixtures.data import count_a
from ..fixtures.data import reversal_prompts as prompts
from ..fixtures.models import char_model, tiny_model
from ..fixtures.online_rounds import assert_grads_close, loss_and_grads


class RecordingReward:
    """Whole counts of 'a' (ties are frequent, so the tie rule is exercised), recording what it was given."""

    __name__ = "a_count"

    def __init__(self):
        self.seen = {}

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.seen = {"completions": completions, "ids": completion_ids}
        return [float(text.count("a")) for text in completions]


def config(**overrides):
    settings = dict(output_dir="/tmp/leantune-test-online-dpo", use_cpu=True, report_to=[], save_strategy="no",
                    per_device_train_batch_size=4, max_new_tokens=8, max_steps=2, learning_rate=1e-3,
                    logging_steps=1, disable_tqdm=True, memory_breakdown=False, seed=0, temperature=1.0)
    settings.update(overrides)
    return OnlineDPOConfig(**settings)


def one_round(trainer):
    trainer.model_wrapped = trainer.model
    rows = [trainer.train_dataset[i] for i in range(trainer.round_size // 2)]
    return rows, trainer.generation_round(rows)


def moved_policy(trainer) -> None:
    """Move the policy away from its frozen reference copy, so the log-ratios (and the loss) are not trivially 0."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)


# --- by hand -----------------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_pair_choice_and_the_loss_on_summed_log_probs_by_hand(char_tokenizer):
    nan = float("nan")
    rewards = torch.tensor([1.0, 2.0, 3.0, 3.0, nan, -1.0, 0.0, nan])
    # higher wins; a tie goes to the first; unscored (NaN) counts as 0, as TRL's sum over functions: 0 > -1, 0 = 0
    chosen = preferred_in_pairs(rewards)
    assert chosen.tolist() == [False, True, True, False, True, False, True, False]
    best, worst = chosen_and_rejected(torch.arange(8.0), chosen)
    assert best.tolist() == [1, 2, 4, 6] and worst.tolist() == [0, 3, 5, 7]

    # two pairs of one-to-three-token completions, per-target log-probs in flat order, completion after completion
    trainer = OnlineDPOTrainer(char_model(char_tokenizer), reward_funcs=count_a, args=config(beta=[0.5, 2.0]),
                               train_dataset=prompts(8), processing_class=char_tokenizer)
    logps = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0, -1.0, -0.25, -2.0])
    ref = torch.tensor([-1.5, -1.0, -1.0, -2.0, -1.0, -2.0, -0.5, -1.0])
    sequence = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])  # lengths 2, 3, 1, 2
    batch = {"ref_logps": ref, "num_sequences": torch.tensor(4), "chosen": torch.tensor([False, True, True, False])}
    # sums: policy [-3, -4.5, -1, -2.25], reference [-2.5, -4, -2, -1.5]; pair 1 chooses its second completion
    # log-ratios: [-0.5, -0.5, 1, -0.75] -> chosen - rejected: pair 1: -0.5 - -0.5 = 0; pair 2: 1 - -0.75 = 1.75
    for loss_type, epoch, beta, expected in (
            ("sigmoid", 0.0, 0.5, -math.log(0.5) - math.log(1 / (1 + math.exp(-0.5 * 1.75)))),
            ("ipo", 1.5, 2.0, (0.0 - 0.25) ** 2 + (1.75 - 0.25) ** 2)):  # IPO on sums (TRL's Online DPO), 1/(2 beta)
        trainer.args.loss_type = loss_type
        trainer.state.epoch = epoch  # beta per epoch: [0.5, 2.0]
        loss_sum, metrics = trainer.policy_loss(TargetScores(logps, targets=None), sequence, batch)  # log-probs only
        # a few fp32 ops on values ~1: ulps (default float32 tolerance rel 1.3e-6)
        assert loss_sum.item() == pytest.approx(expected, rel=1e-6)
        assert metrics["beta"].item() == beta
        assert metrics["rewards/chosen"].item() == pytest.approx(beta * (-0.5 + 1.0) / 2, rel=1e-6)
        assert metrics["rewards/accuracies"].item() == 0.5  # pair 1's margin is exactly 0: not counted as right
    assert trainer.loss_items(batch) == 2  # the loss is a mean over pairs


# --- the trainer against plain torch on a real round ---------------------------------------------------------------


def plain_loss(trainer, rows, seen, beta: float, loss_type: str, penalty: float, max_length: int) -> torch.Tensor:
    """The Online DPO loss of a round in plain torch, from the completions the reward function saw: each sequence
    scored alone (no padding, no chunking) by full logits, chosen by hand from the rewards."""
    eos = trainer.processing_class.eos_token_id

    def summed(model, prompt, completion):
        ids = torch.tensor([prompt + completion])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        return logprobs[torch.arange(ids.shape[1] - 1), ids[0, 1:]][-len(completion):].sum()

    policy, reference, rewards = [], [], []
    for j, completion in enumerate(seen["ids"]):
        prompt = rows[j // 2][PROMPT_IDS]
        prompt = prompt[-(max_length - len(completion)):]  # the start of a long prompt is cut
        policy.append(summed(trainer.model, prompt, completion))
        with torch.no_grad():
            reference.append(summed(trainer.ref_model, prompt, completion))
        ended = completion[-1] == eos
        rewards.append(seen["completions"][j].count("a") - (0.0 if ended else penalty))
    losses = []
    for i in range(0, len(rewards), 2):
        c, r = (i, i + 1) if rewards[i] >= rewards[i + 1] else (i + 1, i)
        delta = (policy[c] - reference[c]) - (policy[r] - reference[r])
        losses.append(-F.logsigmoid(beta * delta) if loss_type == "sigmoid" else (delta - 1 / (2 * beta)) ** 2)
    return torch.stack(losses).mean(), rewards


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_and_gradients_equal_plain_torch_in_every_layout_and_path(char_tokenizer, loss_type):
    """Padded and padding-free rows, chunked head and full logits, against plain torch on the same completions."""
    # sampled at temperature 0.7, scored at 1 (the model's own probabilities, as TRL's Online DPO)
    settings = dict(beta=0.1, loss_type=loss_type, missing_eos_penalty=0.5, max_length=18, loss_chunk_size=5,
                    temperature=0.7)
    completions = None
    for padding_free in (False, True):
        reward = RecordingReward()
        trainer = OnlineDPOTrainer(char_model(char_tokenizer), reward_funcs=reward,
                                   args=config(padding_free=padding_free, shared_prompt=False, **settings),
                                   train_dataset=prompts(), processing_class=char_tokenizer)
        moved_policy(trainer)
        rows, batches = one_round(trainer)
        assert len(batches) == 1 and int(batches[0]["num_sequences"]) == 8  # 4 prompts x 2 completions
        batch = batches[0]
        assert ("attention_mask" in batch) != padding_free
        # the same completions in both layouts (same seeds): the layouts are compared on the same pairs
        completions = completions or reward.seen["ids"]
        assert reward.seen["ids"] == completions
        assert trainer.round_counts["prompts_cut_to_max_length"] > 0  # prompts ~15 tokens + 8 > 18
        expected_loss, rewards = plain_loss(trainer, rows, reward.seen, 0.1, loss_type, 0.5, 18)
        trainer.model.zero_grad()
        expected_loss.backward()
        expected_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        # the hand choice, ties included (whole counts of 'a' tie often)
        pairs = torch.tensor(rewards).view(-1, 2)
        assert (pairs[:, 0] == pairs[:, 1]).any()
        hand = torch.where(pairs[:, 0] >= pairs[:, 1], 1.0, -1.0)
        assert batch["chosen"].view(-1, 2)[:, 0].tolist() == (hand > 0).tolist()
        assert trainer.logprob_path is LogProbPath.CHUNKED
        for path in (LogProbPath.CHUNKED, LogProbPath.FULL):
            trainer.logprob_path = path
            loss, grads = loss_and_grads(trainer, batch)
            # Summed log-probs of 8 targets ~ -4 each differ between kernels by ulps of each term (~5e-7), a few e-6
            # per sum, ~1e-5 on a pair's log-ratio difference; x beta = 0.1 into logsigmoid (slope <= 1): <= 1e-6 on
            # a loss ~0.7 (sigmoid); ipo: x 2|delta - 5| ~ 10 -> 1e-4 on a loss ~25. rel 1e-5 covers both with margin
            # (measured: <= 3.4e-7 relative;
            # gradients <= 0.07 of their tolerance).
            torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=0.0)
            assert_grads_close(grads, expected_grads)


def test_peft_reference_is_the_adapter_disabled(char_tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = OnlineDPOTrainer(char_model(char_tokenizer), reward_funcs=count_a, args=config(shared_prompt=False),
                               train_dataset=prompts(), processing_class=char_tokenizer, peft_config=lora)  # padded
    assert trainer.ref_model is None and trainer.uses_adapter_as_reference
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    _, (batch,) = one_round(trainer)
    with torch.no_grad(), trainer.model.disable_adapter():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"]
    mask = labels[:, 1:] != -100
    plain = torch.log_softmax(logits, -1)[:, :-1].gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    # per-token log-probs ~ -4, one log_softmax each on either side: ulps (measured ~1e-7)
    torch.testing.assert_close(batch["ref_logps"], plain[mask], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        policy = trainer.rounds.scored_logps(trainer.model, trainer._prepare_inputs(dict(batch)))
    assert (policy - batch["ref_logps"]).abs().max() > 1e-2  # the adapter moved the policy away from it


# --- training ----------------------------------------------------------------------------------------------------


def test_reward_rises_in_a_short_run_with_beta_per_epoch_and_evaluation_reports_loss_and_reward(char_tokenizer):
    # 256 prompts / 16 per step = 16 steps per epoch: beta 0.1 in the first, 0.2 from the second on
    args = config(max_steps=30, learning_rate=3e-3, per_device_train_batch_size=16, max_new_tokens=6,
                  logging_steps=5, beta=[0.1, 0.2], per_device_eval_batch_size=8)
    trainer = OnlineDPOTrainer(char_model(char_tokenizer), reward_funcs=count_a, args=args, train_dataset=prompts(256),
                               eval_dataset=prompts(8), processing_class=char_tokenizer)
    assert trainer.ref_model is not None  # no PEFT: a frozen copy
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(history) == 6
    # measured 0.015 -> 0.78 at 1, 2 and 4 threads
    assert history[-1]["reward"] > history[0]["reward"] + 0.3, [h["reward"] for h in history]
    assert history[-1]["rewards/accuracies"] > 0.6 and history[-1]["rewards/margins"] > 0
    assert [h["beta"] for h in history[:3]] == [0.1] * 3 and history[-1]["beta"] == 0.2
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0 and 0.0 <= metrics["eval_reward"] <= 1.0
    assert "eval_rewards/margins" in metrics


# --- configuration and command line ------------------------------------------------------------------------------


def test_config_follows_trl_and_refuses_what_cannot_apply(char_tokenizer):
    args = OnlineDPOConfig(output_dir="/tmp/x", use_cpu=True)
    # TRL's defaults: one beta kept as a float, 64 new tokens, temperature 0.9, learning rate 5e-7, dropout off
    assert (args.beta, args.max_new_tokens, args.max_length, args.temperature) == (0.1, 64, 512, 0.9)
    assert (args.learning_rate, args.disable_dropout, args.loss_type) == (5e-7, True, "sigmoid")
    assert args.num_generations == 2
    assert args.max_completion_length == 64  # the online trainers' name follows
    assert OnlineDPOConfig(output_dir="/tmp/x", max_completion_length=16).max_new_tokens == 16
    assert OnlineDPOConfig(output_dir="/tmp/x", beta=[0.1, 0.05]).beta == [0.1, 0.05]
    bad = [({"num_generations": 4}, "`num_generations` must be 2"), ({"beta": 0.0}, "`beta` must be positive"),
           ({"loss_type": "hinge"}, "`loss_type` must be one of"),
           ({"max_new_tokens": 512}, "must be below `max_length`"),
           ({"epsilon": 0.3}, "`epsilon` does not apply to Online DPO"),
           ({"max_new_tokens": 8, "max_completion_length": 16}, "name the same limit"),
           ({"reward_model_path": "org/rm"}, "pass the reward model"),
           ({"missing_eos_penalty": -1.0}, "`missing_eos_penalty` must be positive")]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            OnlineDPOConfig(output_dir="/tmp/x", **overrides)
    with pytest.raises(ValueError, match="`judge` is not supported"):
        OnlineDPOTrainer(char_model(char_tokenizer), reward_funcs=count_a, args=config(), train_dataset=prompts(),
                         processing_class=char_tokenizer, judge=object())
    with pytest.raises(ValueError, match="is a function: pass reward functions as `reward_funcs=`"):
        OnlineDPOTrainer(char_model(char_tokenizer), count_a, args=config(), train_dataset=prompts(),
                         processing_class=char_tokenizer)  # TRL's order: ref_model is the second argument
    given = char_model(char_tokenizer, seed=3)
    trainer = OnlineDPOTrainer(char_model(char_tokenizer), given, reward_funcs=count_a, args=config(),
                               train_dataset=prompts(), processing_class=char_tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(trainer.ref_model.parameters(), given.parameters()))
    with pytest.raises(ValueError, match="`reward_funcs` must be provided"):
        OnlineDPOTrainer(char_model(char_tokenizer), args=config(), train_dataset=prompts(),
                         processing_class=char_tokenizer)


def test_cli_trains_a_local_model_and_a_bad_flag_is_one_line(tokenizer, gsm8k_rows, tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "gsm8k.jsonl"
    with open(data, "w", encoding="utf-8") as handle:
        for row in gsm8k_rows[:8]:
            handle.write(json.dumps({"prompt": row["question"], "answer": row["answer"]}) + "\n")
    out = tmp_path / "out"
    base = ["online-dpo", "--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--reward_funcs",
            "correct_answer", "characters_in_place", "--output_dir", str(out), "--report_to", "none", "--use_cpu",
            "true"]
    code = main([*base, "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_new_tokens", "8",
                 "--max_prompt_length", "64", "--beta", "0.1", "0.05", "--missing_eos_penalty", "1.0",
                 "--logging_steps", "1"])
    assert code == 0 and (out / "model.safetensors").exists()
    text = capsys.readouterr().out
    assert "=== leantune online-dpo summary ===" in text and "steps: 2 in" in text
    assert "chosen over rejected (implicit reward): accuracy" in text
    assert main([*base, "--num_generations", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num_generations must be 2" in err[0], err
    assert main(["online-dpo", "--help"]) == 0
    help_text = capsys.readouterr().out
    for flag in ("--beta", "--loss_type", "--missing_eos_penalty", "--max_new_tokens", "--max_length", "--use_vllm",
                 "--ds3_gather_for_generation", "--padding_free", "--reward_funcs"):
        assert flag in help_text, flag
