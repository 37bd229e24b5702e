"""RewardTrainer: exactness of padding-free rewards, the loss by hand, PEFT, bad input, real runs on HH-RLHF pairs."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from leantune.losses.reward import bradley_terry_loss
from leantune.trainers.reward_config import RewardConfig
from leantune.trainers.reward_trainer import RewardCollator, RewardTrainer, prepare_reward_dataset, reward_positions

from ..fixtures.models import tiny_reward_model
from ..fixtures.paths import HH_PAIRS, require


def config(tmp_path, **overrides) -> RewardConfig:
    values = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                  max_length=256, per_device_train_batch_size=4, memory_breakdown=False)
    return RewardConfig(**{**values, **overrides})


def pairs(**columns) -> Dataset:
    return Dataset.from_dict(columns)


def summand_scale(trainer, batches) -> float:
    """The largest entry of the gradient of 0.5 * (the sum of the rewards): the size of the per-sequence terms that a
    Bradley-Terry gradient adds with opposite signs (d loss / d reward ~ -0.5 chosen, +0.5 rejected). A chosen and a
    rejected answer share their prompt, so those terms nearly cancel: the gradient is ~20x smaller than its terms,
    and its fp32 rounding (~1e-7 of the terms) is ~2e-6 of the gradient itself, which depends on the summation order
    (measured 2.5e-6 at 2 threads, 2.2e-6 at 1). Rounding is compared to the terms; a real error (a wrong pooled
    position, a wrong normalisation) changes the gradient by >= 1e-2 of itself, i.e. >= 5e-4 of the terms."""
    model = trainer.model
    model.zero_grad()
    for batch in batches:
        (0.5 * trainer.sequence_rewards(model, batch).sum()).backward()
    scale = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    model.zero_grad()
    return scale


# --- the loss -----------------------------------------------------------------------------------------------------


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.5, -2.0]), torch.tensor([0.0, 1.0, -1.0])
    margin = torch.tensor([0.5, 0.0, 1.0])
    nll = [math.log1p(math.exp(-(c - r - m))) for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist())]
    center = [0.1 * (c + r) ** 2 for c, r in zip(chosen.tolist(), rejected.tolist())]
    # fp32 against float64 by hand, values 0.3-3: assert_close's fp32 defaults (rel 1.3e-6 + 1e-5) >> a few ulps
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected, margin), torch.tensor(nll))
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected, margin, 0.1),
                               torch.tensor([a + b for a, b in zip(nll, center)]))
    # Summed and divided by the pairs: TRL's mean loss plus c * mean((rc + rr)^2).
    plain = [math.log1p(math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())]
    assert bradley_terry_loss(chosen, rejected, None, 0.1).mean().item() == pytest.approx(
        sum(plain) / 3 + sum(center) / 3, rel=1e-6)  # fp32 mean of 3 terms ~1: a few ulps; measured 1e-7


def test_center_rewards_coefficient_adds_the_penalty_by_hand(tmp_path, tokenizer, hh_pairs):
    trainer = RewardTrainer(tiny_reward_model(), args=config(tmp_path, center_rewards_coefficient=0.5),
                            train_dataset=hh_pairs, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.eval()
    with torch.no_grad():
        rewards = trainer.sequence_rewards(trainer.model, batch)
        with_center = trainer.compute_loss(trainer.model, dict(batch))
        trainer.args.center_rewards_coefficient = None
        without = trainer.compute_loss(trainer.model, dict(batch))
    chosen, rejected = rewards[:4].double(), rewards[4:].double()  # the by-hand reference in float64
    expected_plain = -torch.nn.functional.logsigmoid(chosen - rejected).mean().item()
    penalty = 0.5 * ((chosen + rejected) ** 2).mean().item()  # ~2.6e-3 with these random rewards
    # Each fp32 loss (~0.69) against its float64 value: a few ulps (6e-8 each) of rounding, so rel 1e-6 leaves >10x.
    # Never the difference of the two near-equal fp32 losses: its rounding (~1e-7) is ~4e-5 of the penalty.
    assert without.item() == pytest.approx(expected_plain, rel=1e-6)
    assert with_center.item() == pytest.approx(expected_plain + penalty, rel=1e-6)
    assert penalty > 1000 * 1e-6 * (expected_plain + penalty)  # a missing or mis-scaled penalty fails the line above


# --- exactness: padding-free == padded ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch,pad", [("llama", "unk"), ("qwen2", "unk"), ("llama", "eos")])
def test_padding_free_rewards_and_gradients_equal_padded(tmp_path, tokenizer, hh_pairs, arch, pad):
    if pad == "eos":
        tokenizer.pad_token = tokenizer.eos_token  # rewards are then read before the final EOS, as the model pools
    trainer = RewardTrainer(tiny_reward_model(arch), args=config(tmp_path, padding_free=True, pad_to_multiple_of=64),
                            train_dataset=hh_pairs, processing_class=tokenizer)
    model = trainer.model
    rows = [trainer.train_dataset[i] for i in range(6)]
    layouts = {"padded": RewardCollator(tokenizer.pad_token_id)(rows), "padding_free": trainer.data_collator(rows)}
    assert "cu_seq_lens_q" in layouts["padding_free"] and "attention_mask" in layouts["padded"]
    rewards, grads = {}, {}
    for name, batch in layouts.items():
        model.zero_grad()
        r = trainer.sequence_rewards(model, batch)
        bradley_terry_loss(r[:6], r[6:], None, 0.01).sum().backward()
        rewards[name] = r.detach()
        grads[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    # layouts change only the fp32 summation order; rewards relative to the largest reward
    scale = rewards["padded"].abs().max()
    assert ((rewards["padding_free"] - rewards["padded"]).abs().max() / scale).item() <= 1e-5  # measured <= 6e-7
    # the gradient relative to its (nearly cancelling) per-sequence terms, see summand_scale
    terms = summand_scale(trainer, [layouts["padded"]])
    assert ((grads["padding_free"] - grads["padded"]).abs().max() / terms).item() <= 1e-5
    # The padded rewards are the model's own pooled outputs (what inference with the saved model gives).
    with torch.no_grad():
        padded = layouts["padded"]
        own = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits.reshape(-1)
    assert ((own - rewards["padded"]).abs().max() / scale).item() <= 1e-5


def test_loss_is_averaged_over_the_pairs_of_the_whole_optimizer_step(tmp_path, tokenizer, hh_pairs):
    """4 pairs in one micro-batch or in 2 x 2 accumulated ones: the same gradient (before the optimizer step)."""
    from transformers import TrainerCallback

    class KeepGradient(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters() if p.grad is not None])

    grads = {}
    # the per-sequence gradient terms of a step of 4 pairs (the largest over the data's 4 batches): see summand_scale
    probe = RewardTrainer(tiny_reward_model(), args=config(tmp_path), train_dataset=hh_pairs,
                          processing_class=tokenizer)
    rows = [probe.train_dataset[i] for i in range(len(probe.train_dataset))]
    terms = max(summand_scale(probe, [probe.data_collator(rows[i:i + 4])]) for i in range(0, len(rows), 4))
    for batch_size, accumulation in ((4, 1), (2, 2)):
        keep = KeepGradient()
        args = config(tmp_path, max_steps=1, per_device_train_batch_size=batch_size, max_grad_norm=0.0,
                      gradient_accumulation_steps=accumulation, center_rewards_coefficient=0.01)
        RewardTrainer(tiny_reward_model(), args=args, train_dataset=hh_pairs, processing_class=tokenizer,
                      callbacks=[keep]).train()
        grads[accumulation] = keep.grads
    # accumulation only regroups the fp32 sums: relative to the summed terms, not to the cancelled gradient (measured
    # 1.7e-6 of the gradient's largest entry, whose terms are ~200x larger); a wrong normalisation (per micro-batch)
    # changes the gradient by ~50%, i.e. >= 1e-3 of the terms
    assert ((grads[2] - grads[1]).abs().max() / terms).item() <= 1e-5


def test_reward_positions_follow_the_models_pooling_rule():
    """The last token that is not the pad token (0 here), in right- or left-padded rows and in segments."""
    right = {"input_ids": torch.tensor([[5, 6, 7, 0], [5, 0, 8, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0],
                                                                                                    [1, 1, 1, 0]])}
    assert reward_positions(right, 2, 0).tolist() == [2, 6]  # a pad id inside a sequence is skipped over, not ended at
    left = {"input_ids": torch.tensor([[0, 5, 6, 7], [0, 0, 8, 9]]), "attention_mask": torch.tensor([[0, 1, 1, 1],
                                                                                                   [0, 0, 1, 1]])}
    assert reward_positions(left, 2, 0).tolist() == [3, 7]
    ends_in_pad = {"input_ids": torch.tensor([[5, 6, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    assert reward_positions(ends_in_pad, 1, 0).tolist() == [1]  # pad == EOS: the reward is read before the EOS
    flat = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 0, 0, 0]]), "cu_seq_lens_q": torch.tensor([0, 3, 5, 8])}
    assert reward_positions(flat, 2, 0).tolist() == [2, 4]


# --- PEFT -----------------------------------------------------------------------------------------------------------


def test_lora_trains_only_the_adapter_and_the_reward_head(tmp_path, tokenizer, hh_pairs):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = RewardTrainer(tiny_reward_model(), args=config(tmp_path, max_steps=2, learning_rate=1e-2),
                            train_dataset=hh_pairs, processing_class=tokenizer, peft_config=peft_config)
    assert peft_config.task_type == "CAUSAL_LM"  # the caller's config is left as it was
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or ".score." in n for n in trainable), sorted(trainable)
    assert any(".score." in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert all(params[n].grad is None for n in frozen)
    assert all(torch.equal(params[n], value) for n, value in frozen.items())
    changed = [n for n, value in trainable.items() if not torch.equal(params[n], value)]
    assert any(".score." in n for n in changed) and any("lora_B" in n for n in changed)


# --- bad input ------------------------------------------------------------------------------------------------------


def test_missing_columns_are_an_error_listing_the_columns(tmp_path, tokenizer):
    data = pairs(prompt=["Hi"], completion=[" there"])
    with pytest.raises(ValueError, match=r"Columns found: \['completion', 'prompt'\]"):
        RewardTrainer(tiny_reward_model(), args=config(tmp_path), train_dataset=data, processing_class=tokenizer)


def test_unusable_pairs_are_dropped_and_counted(tmp_path, tokenizer):
    long_prompt = "word " * 200
    data = pairs(
        prompt=["Say hi.", "Same?", "Empty?", "Blank?", long_prompt, "Fine."],
        chosen=[" Hi!", " Yes.", "", " Something.", " Short.", " Good answer."],
        rejected=[" Go away.", " Yes.", " Something.", "   ", " Also short.", " Bad answer."],
    )
    _, report = prepare_reward_dataset(data, tokenizer, config(tmp_path, max_length=64, truncation_mode="keep_start"),
                                       "train")
    assert (report.num_pairs_in, report.num_identical_dropped, report.num_empty_dropped,
            report.num_prompt_too_long_dropped, report.num_pairs_out) == (6, 1, 2, 1, 2)
    # keep_end (the default) cuts the start of an over-long prompt instead: truncated, counted, kept.
    kept, report = prepare_reward_dataset(data, tokenizer, config(tmp_path, max_length=64), "train")
    assert (report.num_prompt_truncated, report.num_prompt_too_long_dropped, report.num_pairs_out) == (1, 0, 3)
    assert max(max(len(c), len(r)) for c, r in zip(kept["chosen_ids"], kept["rejected_ids"])) <= 64  # whole sequences


def test_pairs_identical_after_truncation_are_dropped_and_counted(tmp_path, tokenizer):
    data = pairs(prompt=["Q:", "Q:"], chosen=[" the same long start then yes", " yes"],
                 rejected=[" the same long start then no", " no"])
    args = config(tmp_path, max_length=6, truncation_mode="keep_start")  # 3 prompt tokens + 3 shared completion ones
    kept, report = prepare_reward_dataset(data, tokenizer, args, "train")
    assert (report.num_identical_after_truncation_dropped, report.num_identical_dropped, report.num_pairs_out,
            len(kept)) == (1, 0, 1, 1)
    with pytest.raises(ValueError, match="No train pair is left"):
        prepare_reward_dataset(data.select([0]), tokenizer, args, "train")


def test_bad_models_and_settings_are_clear_errors(tmp_path, tokenizer, hh_pairs):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    two_labels = LlamaForSequenceClassification(LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64,
                                                             num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardTrainer(two_labels, args=config(tmp_path), train_dataset=hh_pairs, processing_class=tokenizer)
    with pytest.raises(ValueError, match="truncation_mode"):
        config(tmp_path, truncation_mode="middle")
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        config(tmp_path, center_rewards_coefficient=-0.1)
    with pytest.raises(ValueError, match="max_length"):
        config(tmp_path, max_length=0)


# --- margins, other formats -------------------------------------------------------------------------------------------


def test_margin_column_travels_with_its_pair_into_the_loss(tmp_path, tokenizer):
    data = pairs(prompt=["A?", "B?", "C?"], chosen=[" yes", "", " sure"], rejected=[" no", " x", " nope"],
                 margin=[0.5, 9.0, 2.0])
    trainer = RewardTrainer(tiny_reward_model(), args=config(tmp_path), train_dataset=data, processing_class=tokenizer)
    assert trainer.train_dataset["margin"] == [0.5, 2.0]  # the empty pair's margin left with it
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    torch.testing.assert_close(batch["margin"], torch.tensor([0.5, 2.0]))
    trainer.model.eval()
    with torch.no_grad():
        r = trainer.sequence_rewards(trainer.model, batch)
        loss = trainer.compute_loss(trainer.model, dict(batch))
    expected = -torch.nn.functional.logsigmoid(r[:2] - r[2:] - torch.tensor([0.5, 2.0])).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)  # the same fp32 ops on the same rewards


def test_conversational_and_trl_tokenized_pairs(tmp_path):
    from leantune.defaults import build_default_tokenizer

    tok = build_default_tokenizer()
    user = {"role": "user", "content": "reverse: abc ="}
    conversations = pairs(chosen=[[user, {"role": "assistant", "content": "cba"}]],
                          rejected=[[user, {"role": "assistant", "content": "abc"}]])
    data, _ = prepare_reward_dataset(conversations, tok, config(tmp_path), "train")
    # TRL's prepared form: whole sequences, prompt included, and no prompt column
    assert data.column_names == ["chosen_ids", "rejected_ids"]
    chosen = tok.decode(data[0]["chosen_ids"])
    assert chosen.endswith("<|assistant|>cba<eos>") and "reverse: abc =" in chosen
    tokenized = pairs(chosen_ids=[[1, 5, 6, 7, 2]], rejected_ids=[[1, 5, 6, 8, 2]], margin=[1.0])
    data, _ = prepare_reward_dataset(tokenized, tok, config(tmp_path, max_length=4), "train")
    # the shared start is the prompt: keep_end truncation cuts it, not the completions
    assert (data[0]["chosen_ids"], data[0]["rejected_ids"], data[0]["margin"]) == ([5, 6, 7, 2], [5, 6, 8, 2], 1.0)
    with pytest.warns(FutureWarning, match="will not be supported in v1"):  # the older names, read as the new ones
        legacy, _ = prepare_reward_dataset(tokenized.rename_columns({"chosen_ids": "chosen_input_ids",
                                                                     "rejected_ids": "rejected_input_ids"}),
                                           tok, config(tmp_path), "train")
    assert (legacy[0]["chosen_ids"], legacy[0]["rejected_ids"]) == ([1, 5, 6, 7, 2], [1, 5, 6, 8, 2])


# --- real runs ------------------------------------------------------------------------------------------------------


def test_short_training_run_on_hh_rlhf_pairs_logs_accuracy(tmp_path, tokenizer, hh_pairs):
    args = config(tmp_path, max_steps=3, logging_steps=1, eval_strategy="steps", eval_steps=3,
                  per_device_eval_batch_size=4, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    trainer = RewardTrainer(tiny_reward_model(), args=args, train_dataset=hh_pairs.select(range(12)),
                            eval_dataset=hh_pairs.select(range(12, 16)), processing_class=tokenizer)
    result = trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert all(0.0 <= entry["accuracy"] <= 1.0 and "rewards/chosen" in entry and "margin" in entry for entry in logs)
    evaluation = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert evaluation and "eval_accuracy" in evaluation[-1]
    assert result.metrics["real_tokens"] > 0


def test_cli_trains_a_saved_reward_model_on_hh_rlhf(tmp_path, tokenizer_dir, capsys):
    from transformers import AutoTokenizer

    from leantune.cli.main import main

    model_dir = tmp_path / "tiny-reward"
    tiny_reward_model().save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(model_dir)
    code = main(["reward", "--model_name_or_path", str(model_dir), "--dataset_name", str(require(HH_PAIRS)),
                 "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "128",
                 "--padding_free", "true", "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--disable_tqdm", "true",
                 "--dataset_num_proc", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "=== leantune reward summary ===" in out and "train pairwise accuracy" in out
    assert (tmp_path / "out" / "config.json").exists()


@pytest.mark.quick
def test_cli_demo_prints_accuracy_before_and_after(tmp_path, monkeypatch, capsys):
    from leantune.cli import reward
    from leantune.cli.main import main

    monkeypatch.setattr(reward, "DEMO_PAIRS", {"train": 64, "eval": 16})
    monkeypatch.setattr(reward, "DEMO_WARM_UP_STEPS", 2)
    code = main(["reward", "--max_steps", "3", "--output_dir", str(tmp_path / "demo"), "--report_to", "none",
                 "--disable_tqdm", "true", "--memory_breakdown", "false"])
    out = capsys.readouterr().out
    assert code == 0
    assert "held-out pairs (16): pairwise accuracy" in out and "->" in out.split("pairwise accuracy")[-1]
