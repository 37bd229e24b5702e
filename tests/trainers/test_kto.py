"""KTO: layouts, loss paths and reference modes agree; the loss matches hand-computed values; paired data is unpaired
automatically; bad examples are counted or rejected clearly; a short run moves the rewards apart.

Tolerance: relative difference <= 1e-5 in fp32 for per-sequence log-probs and first-step gradients. The logged kl,
rewards and loss are differences of summed log-probs of size |S| (up to ~1000 nats here) and are compared within
RTOL * |S| of those sums (see `logp_scale`), never relative to the small difference itself.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from datasets import Dataset

from leantune import KTOConfig, KTOTrainer
from leantune.data.kto_preparation import KL_COLUMN, kl_partners
from leantune.losses.kto import kl_estimate, kto_loss
from leantune.models.checkpointing import checkpointing_setting

from ..fixtures.comparisons import GradientRecorder, rel_diff
from ..fixtures.models import char_model, lora, tiny_model
from ..fixtures.preference import adapter_and_copy_references, batch_of, preference_trainer

RTOL = 1e-5
HH_PAIRS_ROWS = 10


def make_trainer(tokenizer, dataset, tmp_path, model=None, **overrides):
    return preference_trainer(KTOTrainer, KTOConfig, tokenizer, dataset, tmp_path, model,
                              **{"max_length": 160, "disable_tqdm": True, **overrides})


def logp_scale(trainer) -> float:
    """The largest |summed completion log-prob| over the train set (policy and reference, completions and KL
    completions): the size of the numbers that the logged kl and rewards are differences of.

    A fp32 sum of N log-probs has a worst-case rounding error of N * 6e-8 of the sum; N <= max_length = 160 tokens
    gives <= 1e-5 = RTOL of the sum, so RTOL * logp_scale bounds the error of any one sequence's log-prob however the
    sum is ordered (layout, chunking, thread count). Measured: ~3e-8 of the sums (1.5e-5 nats on sums of ~500).
    """
    rows, values = len(trainer.train_dataset), []
    with torch.no_grad():
        for start in range(0, rows, 4):
            batch = trainer.data_collator([trainer.train_dataset[i] for i in range(start, min(start + 4, rows))])
            values.append(trainer.sequence_logps(trainer.model, batch))
            if "kl_input_ids" in batch:
                values.append(trainer.sequence_logps(trainer.model, batch, kl=True))
            values += [v for v in trainer.reference_logps(batch) if v is not None]
    return float(torch.cat(values).abs().max())


def assert_logged_differences_agree(got: dict, expected: dict, scale: float, beta: float):
    """kl, rewards and loss of one step, from summed log-probs that may each be off by E = RTOL * scale (above).

    kl (policy - reference, mean over KL completions): 2E; rewards (beta * (policy - reference)): 2 beta E; the loss
    (1 - sigmoid(beta (r - z0)), slope <= beta / 4, r and z0 each off by 2E): beta E, plus its own fp32 rounding.
    The logs are rounded to 6 decimals: + 1e-6. Here E ~ 9e-3 (kl tolerance 0.018, measured difference 1.5e-5). A
    real bug is far larger: one token dropped or doubled moves a sum by ~10 nats (kl by 10 / 4 = 2.5, >100 x the
    tolerance), and then logps/chosen and the gradients fail too.
    """
    error = RTOL * scale
    tolerance = {"kl": 2 * error, "rewards/chosen": 2 * beta * error, "rewards/rejected": 2 * beta * error,
                 "loss": beta * error + RTOL * abs(expected["loss"])}
    for key, tol in tolerance.items():
        assert got[key] == pytest.approx(expected[key], abs=tol + 1e-6), key


def first_step(trainer):
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return recorder.grads, logs[0]


# --- the loss -----------------------------------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_loss_against_hand_computed_values():
    policy, ref = torch.tensor([-1.0, -2.0, -3.0, -0.5]), torch.tensor([-1.5, -1.0, -3.5, -0.5])
    desirable = torch.tensor([True, True, False, False])
    ratio = [0.5, -1.0, 0.5, 0.0]
    beta, kl, wd, wu = 0.5, 0.2, 1.5, 0.75
    losses, rewards = kto_loss(policy, ref, desirable, kl, beta, wd, wu, "kto")
    expected = [wd * (1 - sigmoid(beta * (ratio[0] - kl))), wd * (1 - sigmoid(beta * (ratio[1] - kl))),
                wu * (1 - sigmoid(beta * (kl - ratio[2]))), wu * (1 - sigmoid(beta * (kl - ratio[3])))]
    # fp32 losses of size 0.3-1 against float64 by hand: a few ulps (6e-8 relative each); measured <= 1e-7
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert rewards.tolist() == pytest.approx([beta * r for r in ratio], rel=1e-6)
    apo, _ = kto_loss(policy, ref, desirable, kl, beta, wd, wu, "apo_zero_unpaired")  # no reference point
    expected = [wd * (1 - sigmoid(beta * ratio[0])), wd * (1 - sigmoid(beta * ratio[1])),
                wu * sigmoid(beta * ratio[2]), wu * sigmoid(beta * ratio[3])]
    assert apo.tolist() == pytest.approx(expected, rel=1e-6)
    # z0: mean policy/reference log-ratio of the mismatched completions, detached
    policy_kl = torch.tensor([-2.0, -4.0], requires_grad=True)
    z0 = kl_estimate(policy_kl, torch.tensor([-3.0, -4.5]))
    assert float(z0) == pytest.approx(0.75) and not z0.requires_grad  # exact in fp32 (default rel 1e-6)


def test_kl_reference_point_is_clamped_at_zero_and_detached(tokenizer, hh_pairs, tmp_path):
    trainer = make_trainer(tokenizer, hh_pairs, tmp_path)
    batch = batch_of(trainer, 4)
    with torch.no_grad():
        policy_kl = trainer.sequence_logps(trainer.model, batch, kl=True)
    above = trainer.kl_reference_point(trainer.model, batch, policy_kl - 2.0)  # policy above reference by 2 nats
    below = trainer.kl_reference_point(trainer.model, batch, policy_kl + 2.0)
    # x - (x - 2) with |x| ~ 100-900 nats: x - 2 rounds by up to 1 ulp of x (1.2e-7 |x|), not relative to 2
    assert float(above) == pytest.approx(2.0, abs=1e-6 * float(policy_kl.abs().max())) and float(below) == 0.0
    assert not above.requires_grad


# --- layouts, loss paths and reference modes agree ------------------------------------------------------------------


def test_padding_free_equals_padded_per_sequence(tokenizer, hh_pairs, tmp_path):
    model = tiny_model()
    padded = make_trainer(tokenizer, hh_pairs, tmp_path / "a", model=model)
    flat = make_trainer(tokenizer, hh_pairs, tmp_path / "b", model=model, padding_free=True)
    padded_batch, flat_batch = batch_of(padded), batch_of(flat)
    assert flat_batch["input_ids"].shape[0] == 1 and flat_batch["kl_input_ids"].shape[0] == 1
    assert "attention_mask" not in flat_batch
    model.eval()
    with torch.no_grad():
        for kl in (False, True):
            reference = padded.sequence_logps(model, padded_batch, kl=kl)
            got = flat.sequence_logps(model, flat_batch, kl=kl)
            assert reference.shape == (6,) and torch.all(reference < 0)
            # sums of <= 160 log-probs: worst-case fp32 rounding 160 * 6e-8 ~ 1e-5 of the sum; measured 0
            assert rel_diff(got, reference) <= RTOL, kl


def sharper_reference():
    """The initial policy with a sharper output head: it puts less mass on most completions than the policy does,
    so rewards and the KL reference point are positive (not clamped to 0) and the KL term is exercised."""
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


def test_chunked_equals_full_loss_and_gradients(tokenizer, hh_pairs, tmp_path):
    # Padding-free; the padded layout gives the same per-sequence log-probs (above).
    full = make_trainer(tokenizer, hh_pairs, tmp_path / "f", padding_free=True, ref_model=sharper_reference(),
                        chunked_loss=False)
    scale = logp_scale(full)  # ~900 nats here
    full_grads, full_log = first_step(full)
    chunked = make_trainer(tokenizer, hh_pairs, tmp_path / "c", padding_free=True, ref_model=sharper_reference(),
                           use_liger_loss=True, loss_chunk_size=32)
    assert chunked.logprob_path.value == "chunked"
    chunked_grads, chunked_log = first_step(chunked)
    assert full_log["kl"] > 0 and full_log["rewards/chosen"] > 0
    for key in ("logps/chosen", "logps/rejected"):  # means of same-sign sums: relative to the sums themselves
        assert chunked_log[key] == pytest.approx(full_log[key], rel=RTOL), key
    # kl ~6 and rewards ~0.1-0.4 are differences of ~500-nat sums: within RTOL of the sums, not of themselves
    assert_logged_differences_agree(chunked_log, full_log, scale, full.args.beta)
    for name, reference in full_grads.items():  # max abs difference over max |gradient|; measured ~1e-7
        assert rel_diff(chunked_grads[name], reference) <= RTOL, name



def test_peft_reference_equals_a_separate_copy_of_the_base_weights(tokenizer, hh_pairs, tmp_path):
    """With a random (non-zero) adapter the policy differs from its base; the reference must be the base."""
    via_adapter, via_copy, policy = adapter_and_copy_references(make_trainer, tokenizer, hh_pairs, tmp_path)
    assert via_adapter.shape == (12,)  # completions and KL completions
    assert rel_diff(via_adapter, via_copy) <= RTOL  # as above; measured 0 (the same base weights and kernels)
    assert rel_diff(policy, via_copy[:6]) > 1e-3  # the adapter does change the policy (measured 5.6e-3, seeded)


@pytest.mark.parametrize("peft", [False, True])
def test_precomputed_reference_equals_live_reference(peft, tokenizer, hh_pairs, tmp_path):
    def trainer(path, **extra):
        torch.manual_seed(0)
        return make_trainer(tokenizer, hh_pairs, tmp_path / path, peft_config=lora(True) if peft else None,
                            ref_model=None if peft else sharper_reference(), **extra)

    live = trainer("live")
    scale = logp_scale(live)
    live_grads, live_log = first_step(live)
    pre = trainer("pre", precompute_ref_log_probs=True)
    pre_grads, pre_log = first_step(pre)
    assert pre.ref_model is None  # no reference held in training
    assert peft or live_log["kl"] > 0
    assert {"ref_logps", "ref_kl_logps"} <= set(pre.train_dataset.column_names)
    # reference log-probs precomputed in other batches (other summation order): differences of sums, as above
    assert_logged_differences_agree(pre_log, live_log, scale, live.args.beta)
    for name, reference in live_grads.items():  # max abs difference over max |gradient|
        assert rel_diff(pre_grads[name], reference) <= RTOL, name


def test_precomputed_reference_of_the_initial_policy_needs_no_copy(tokenizer, hh_pairs, tmp_path):
    trainer = make_trainer(tokenizer, hh_pairs, tmp_path, precompute_ref_log_probs=True)
    assert trainer.ref_model is None and not trainer.uses_adapter_as_reference
    _, log = first_step(trainer)
    scale = logp_scale(trainer)  # after the step: the reference log-probs are precomputed when training starts
    # policy == reference at step 0: every loss is 1 - sigmoid(0) = 0.5, up to the rounding of the precomputed sums
    # (other batches): slope beta / 4, log-ratio and z0 each off by <= 2 RTOL * scale (measured: exactly 0.5)
    assert log["loss"] == pytest.approx(0.5, abs=trainer.args.beta * RTOL * scale + 1e-7)


# --- data -----------------------------------------------------------------------------------------------------------


def test_paired_hh_data_is_unpaired_automatically(tokenizer, hh_pairs, tmp_path):
    trainer = make_trainer(tokenizer, hh_pairs, tmp_path, max_length=None)
    data, report = trainer.train_dataset, trainer.data_reports["train"]
    assert report.num_pairs_unpaired == len(hh_pairs) and len(data) == 2 * len(hh_pairs)
    assert data["label"] == [True, False] * len(hh_pairs)  # chosen then rejected, side by side
    assert report.num_desirable == report.num_undesirable == len(hh_pairs)
    chosen, rejected = data[0], data[1]
    assert chosen["prompt_ids"] == rejected["prompt_ids"]
    prompt = tokenizer.decode(chosen["prompt_ids"], skip_special_tokens=True)
    assert prompt.rstrip().endswith("Assistant:")
    assert hh_pairs[0]["chosen"].strip().endswith(tokenizer.decode(chosen["completion_ids"],
                                                                   skip_special_tokens=True).strip())
    assert chosen["completion_ids"][-1] == tokenizer.eos_token_id
    # each prompt's KL completion was written for another prompt
    completions = [tuple(c) for c in data["completion_ids"]]
    for row in data:
        j = completions.index(tuple(row[KL_COLUMN]))
        assert data[j]["prompt_ids"] != row["prompt_ids"]


def test_kl_partners_are_other_prompts_from_a_seeded_permutation():
    keys = np.array([0, 0, 1, 1, 2, 2, 3, 3])  # pairs: two completions per prompt
    partner, left = kl_partners(keys, seed=0)
    assert left == 0 and not np.any(keys[partner] == keys)
    assert np.array_equal(partner, kl_partners(keys, seed=0)[0])
    partner, left = kl_partners(np.array([5, 5, 5]), seed=0)  # impossible: counted, never the example itself
    assert left == 3 and not np.any(partner == np.arange(3))
    # one example has no other completion: its own, counted (as TRL, which pairs it with itself)
    assert kl_partners(np.array([1]), seed=0)[0].tolist() == [0] and kl_partners(np.array([1]), seed=0)[1] == 1


def test_batch_pairing_trains_step_for_step_as_trl(char_tokenizer, gsm8k_rows, tmp_path):
    """kl_pairing="batch" with sequential batches is TRL 1.16's KTO: the same batches and KL partners, so the same
    KL term and losses at every step. With the default pairing (a seeded permutation) on the same batches the KL term
    is another one. (The GPU kit compared the default with TRL: different batches, apart from step 2 on; step 1's loss
    is 0.5 for any batch, the policy being its reference.)"""
    trl = pytest.importorskip("trl")
    rows = [{"prompt": row["question"][:60], "completion": " " + row["answer"][:60], "label": i % 2 == 0}
            for i, row in enumerate(gsm8k_rows[:16])]
    fields = dict(per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3, lr_scheduler_type="constant",
                  seed=0, beta=0.1, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
                  gradient_checkpointing=False, disable_tqdm=True, train_sampling_strategy="sequential")

    def run(trainer_class, config_class, **extra):
        trainer = trainer_class(model=char_model(char_tokenizer), ref_model=char_model(char_tokenizer),
                                processing_class=char_tokenizer, train_dataset=Dataset.from_list(rows),
                                args=config_class(output_dir=str(tmp_path / config_class.__module__), **fields,
                                                  **extra))
        trainer.train()
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        return [entry["loss"] for entry in logged], [entry["kl"] for entry in logged]

    trl_losses, trl_kl = run(trl.KTOTrainer, trl.KTOConfig)
    losses, kl = run(KTOTrainer, KTOConfig, kl_pairing="batch")
    permuted_losses, permuted_kl = run(KTOTrainer, KTOConfig)
    assert max(trl_kl) > 1  # the mismatched pairs weigh in (a KL term clamped at 0 would not tell the pairings apart)
    # The first step's gradients of the two libraries agree to 2e-7 on a batch (their log-probs to the last fp32
    # bit), but inside TRL's training loop its gradient is 0.3% off its own compute_loss gradient (measured; leantune's
    # is not). Three Adam steps of lr 1e-3 carry that into the policy: KL (a difference of sums of ~100 log-probs)
    # stays within 5% and the loss within 2e-3 (measured 1.4% and 7e-4, the same at OMP_NUM_THREADS 1 and 4); the
    # permutation's partners give a KL term 56% away.
    assert rel_diff(kl, trl_kl) < 0.05 and rel_diff(losses, trl_losses) < 2e-3, (kl, trl_kl, losses, trl_losses)
    assert rel_diff(permuted_kl, trl_kl) > 0.3, (permuted_kl, trl_kl)


def test_unpaired_text_and_conversational_data(tokenizer, tmp_path):
    rows = [{"prompt": f"Q{i}:", "completion": f" answer {i}", "label": i % 3 != 0} for i in range(6)]
    trainer = make_trainer(tokenizer, Dataset.from_list(rows), tmp_path / "t")
    row = trainer.train_dataset[1]
    assert tokenizer.decode(row["completion_ids"], skip_special_tokens=True).strip() == "answer 1"
    assert row["prompt_ids"][0] == tokenizer.bos_token_id and row["label"] is True
    chat = [{"prompt": [{"role": "user", "content": f"Say {w}."}],
             "completion": [{"role": "assistant", "content": w}], "label": w != "no"} for w in ("yes", "no", "ok")]
    trainer = make_trainer(tokenizer, Dataset.from_list(chat), tmp_path / "c")
    row = trainer.train_dataset[0]
    full = tokenizer.apply_chat_template(chat[0]["prompt"] + chat[0]["completion"], tokenize=True,
                                         return_dict=True)["input_ids"]
    assert list(row["prompt_ids"]) + list(row["completion_ids"]) == list(full)
    assert tokenizer.decode(row["completion_ids"], skip_special_tokens=True).strip() == "yes"


def test_pretokenised_examples_in_trl_and_legacy_column_names(tokenizer, tmp_path):
    rows = [{"prompt": f"Q{i}:", "completion": f" answer {i}", "label": i % 3 != 0} for i in range(6)]
    prepared = make_trainer(tokenizer, Dataset.from_list(rows), tmp_path / "text").train_dataset
    assert {"prompt_ids", "completion_ids", "label", "KL_completion_ids"} <= set(prepared.column_names)  # TRL's
    legacy = prepared.rename_columns({"prompt_ids": "prompt_input_ids", "completion_ids": "completion_input_ids",
                                      "KL_completion_ids": "kl_completion_input_ids"})
    with pytest.warns(FutureWarning, match="will not be supported in v1"):
        renamed = make_trainer(tokenizer, legacy, tmp_path / "legacy").train_dataset
    assert renamed.to_dict() == prepared.to_dict()


def test_bad_examples_are_counted_or_rejected(tokenizer, tmp_path, caplog):
    rows = [
        {"prompt": "Say hi.", "completion": " Hi there!", "label": True},
        {"prompt": "Say hi.", "completion": "   ", "label": True},  # empty completion
        {"prompt": "word " * 200, "completion": " ok", "label": False},  # the prompt alone fills max_length
        {"prompt": "Count.", "completion": " one two three four five six seven eight nine ten " * 8, "label": False},
        {"prompt": "Name a colour.", "completion": " Blue.", "label": False},
    ]
    with caplog.at_level(logging.WARNING, logger="leantune"):
        trainer = make_trainer(tokenizer, Dataset.from_list(rows), tmp_path, max_length=64)
    report = trainer.data_reports["train"]
    assert (report.num_rows_in, report.num_empty_dropped, report.num_prompt_too_long_dropped,
            report.num_completion_truncated, report.num_examples_out) == (5, 1, 1, 1, 3)
    assert (report.num_desirable, report.num_undesirable) == (1, 2)
    assert all(len(p) + len(c) <= 64 for p, c in zip(trainer.train_dataset["prompt_ids"],
                                                      trainer.train_dataset["completion_ids"]))
    assert "empty completion" in caplog.text and "fills max_length" in caplog.text and "eq. 8" in caplog.text

    pairs = [{"prompt": "Say hi.", "chosen": " Hi!", "rejected": " Go away."},
             {"prompt": "Say hi.", "chosen": " Same.", "rejected": " Same."},  # identical: contradictory labels
             {"prompt": "Say bye.", "chosen": " Bye!", "rejected": ""}]  # the chosen side is still usable
    report = make_trainer(tokenizer, Dataset.from_list(pairs), tmp_path / "p").data_reports["train"]
    assert (report.num_identical_pairs_dropped, report.num_empty_dropped, report.num_examples_out) == (1, 1, 3)

    with pytest.raises(ValueError, match=r"missing column\(s\) \['label'\]. Columns found: \['completion', 'prompt'\]"):
        make_trainer(tokenizer, Dataset.from_list([{"prompt": "q", "completion": "a"}]), tmp_path)
    with pytest.raises(ValueError, match="must hold booleans"):
        make_trainer(tokenizer, Dataset.from_list([{"prompt": "q", "completion": "a", "label": 1}] * 2), tmp_path)
    with pytest.raises(ValueError, match="missing value"):
        make_trainer(tokenizer, Dataset.from_list([{"prompt": "q", "completion": "a", "label": None},
                                                   {"prompt": "r", "completion": "b", "label": True}]), tmp_path)
    with pytest.raises(ValueError, match="No train example is left"):
        make_trainer(tokenizer, Dataset.from_list(rows[1:3]), tmp_path, max_length=64)
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tokenizer, Dataset.from_list(rows).select([]), tmp_path)


@pytest.mark.quick
def test_one_sided_data_warns_and_trains(tokenizer, tmp_path, caplog):
    rows = [{"prompt": f"Q{i}:", "completion": f" A{i}", "label": True} for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="leantune"):
        trainer = make_trainer(tokenizer, Dataset.from_list(rows), tmp_path)
    assert "all 4 examples are desirable" in caplog.text
    trainer.train()


def test_config_is_validated():
    for bad, match in ((dict(loss_type="sigmoid"), "loss_type"), (dict(beta=0), "beta"),
                       (dict(desirable_weight=-1.0), "desirable_weight"),
                       (dict(desirable_weight=0.0, undesirable_weight=0.0), "both 0"),
                       (dict(truncation_mode="middle"), "truncation_mode"), (dict(max_length=0), "max_length"),
                       (dict(kl_pairing="nearby"), "kl_pairing"), (dict(kl_pairing="batch"), "sequential")):
        with pytest.raises(ValueError, match=match):
            KTOConfig(output_dir="x", use_cpu=True, **bad)
    config = KTOConfig(output_dir="x", use_cpu=True)
    assert (config.beta, config.learning_rate, config.max_length, config.loss_type) == (0.1, 1e-6, 1024, "kto")
    assert checkpointing_setting(config)[0] is True  # gradient checkpointing on by default (either name)


# --- training -------------------------------------------------------------------------------------------------------


def test_short_run_moves_rewards_apart(tokenizer, hh_pairs, tmp_path):
    trainer = make_trainer(tokenizer, hh_pairs, tmp_path, max_steps=4, learning_rate=3e-3, memory_breakdown=True,
                           activation_offloading=True, per_device_eval_batch_size=8)
    seen = trainer.train_dataset.select(range(8))
    before = trainer.evaluate(seen)
    trainer.train()
    after = trainer.evaluate(seen)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    # policy == its deep copy on the same batch and kernels: log-ratios and kl exactly 0, loss 0.5 to fp32 rounding
    assert logs[0]["loss"] == pytest.approx(0.5, rel=1e-6) and logs[0]["kl"] == 0.0
    assert sum(e["count/desirable"] + e["count/undesirable"] for e in logs) == 4 * 4
    assert before["eval_rewards/margins"] == 0.0 and before["eval_loss"] == pytest.approx(0.5, rel=1e-6)
    # measured at 1, 2 and 4 threads: margins 0 -> 1.52, eval loss 0.5 -> 0.34 (thresholds far from the values)
    assert after["eval_rewards/margins"] > 0 and after["eval_loss"] < 0.5
    assert trainer.memory_breakdown is not None  # the breakdown survives several forwards per step


def test_apo_zero_unpaired_needs_no_kl_completions(tokenizer, hh_pairs, tmp_path):
    trainer = make_trainer(tokenizer, hh_pairs, tmp_path, loss_type="apo_zero_unpaired", max_steps=2)
    assert KL_COLUMN not in trainer.train_dataset.column_names
    assert "kl_input_ids" not in batch_of(trainer, 2)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[0]["loss"] == pytest.approx(0.5, rel=1e-6) and logs[0]["kl"] == 0.0  # as above: exact log-ratio 0
    raw = trainer.evaluate(hh_pairs.select(range(3)), metric_key_prefix="pairs")  # any accepted format
    # measured 0.385 after 2 steps at 1, 2 and 4 threads (0.5 untrained)
    assert trainer.data_reports["pairs"].num_pairs_unpaired == 3 and raw["pairs_loss"] < 0.5


@pytest.mark.quick
def test_cli_trains_on_paired_hh_data(tokenizer, hh_pairs, tmp_path, capsys):
    from leantune.cli.runner import run_method

    def run(argv):
        return run_method("kto", argv)

    model_dir, data_file = tmp_path / "tiny-llama", tmp_path / "pairs.jsonl"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    hh_pairs.to_json(str(data_file))
    code = run(["--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--max_steps", "2",
                "--max_length", "160", "--per_device_train_batch_size", "4", "--logging_steps", "1",
                "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--use_cpu", "true",
                "--memory_breakdown", "false", "--disable_tqdm", "true"])
    out = capsys.readouterr().out
    assert code == 0 and "steps: 2" in out and "train reward margin" in out
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("padding_free", [False, True])
def test_collated_batch_carries_trls_completion_mask(tokenizer, tmp_path, padding_free):
    rows = [{"prompt": f"Q{i}:", "completion": f" answer {i}" * (i + 1), "label": i % 2 == 0} for i in range(4)]
    trainer = make_trainer(tokenizer, Dataset.from_list(rows), tmp_path, padding_free=padding_free)
    examples = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(examples)
    mask = batch["completion_mask"]
    assert mask.shape == batch["input_ids"].shape
    assert int(mask.sum()) == sum(len(ex["completion_ids"]) for ex in examples)
    # the targets are exactly the completion tokens (prompts are not empty here, so no completion starts a sequence)
    assert torch.equal(batch["labels"] != -100, mask.bool())
