"""DPO: layouts, loss paths and reference modes agree; the loss matches hand-computed values; bad pairs are counted.

Tolerance: relative difference <= 1e-5 in fp32 for per-sequence log-probs, losses and first-step gradients.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from datasets import Dataset

from leantune import DPOConfig, DPOTrainer
from leantune.data.preference_preparation import PairTruncation
from leantune.losses.preference import dpo_loss

from ..fixtures.comparisons import GradientRecorder, rel_diff
from ..fixtures.models import tiny_model
from ..fixtures.paths import HH_PAIRS
from ..fixtures.preference import adapter_and_copy_references, batch_of, preference_trainer

RTOL = 1e-5
HH_PAIRS_ROWS = 24


def make_trainer(tokenizer, dataset, tmp_path, model=None, **overrides):
    return preference_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path, model,
                              **{"max_length": 192, **overrides})


@pytest.mark.quick
def test_padding_free_equals_padded_per_sequence(tokenizer, hh_pairs, tmp_path):
    model = tiny_model()
    padded = make_trainer(tokenizer, hh_pairs, tmp_path / "a", model=model)
    flat = make_trainer(tokenizer, hh_pairs, tmp_path / "b", model=model, padding_free=True)
    padded_batch, flat_batch = batch_of(padded), batch_of(flat)
    assert flat_batch["input_ids"].shape[0] == 1 and "attention_mask" not in flat_batch
    model.eval()
    with torch.no_grad():
        reference = padded.sequence_logps(model, padded_batch)
        got = flat.sequence_logps(model, flat_batch)
    assert reference.shape == (12,) and torch.all(reference < 0)
    # sums of <= 192 log-probs: worst-case fp32 rounding ~192 * 6e-8 ~ 1e-5 of the sum; measured 0
    assert rel_diff(got, reference) <= RTOL


def first_step(trainer):
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return recorder.grads, logs[0]


@pytest.mark.quick
@pytest.mark.parametrize("padding_free", [False, True])
def test_chunked_equals_full_loss_and_gradients(padding_free, tokenizer, hh_pairs, tmp_path):
    full_grads, full_log = first_step(make_trainer(tokenizer, hh_pairs, tmp_path / "f", padding_free=padding_free,
                                                   chunked_loss=False))
    chunked = make_trainer(tokenizer, hh_pairs, tmp_path / "c", padding_free=padding_free, use_liger_loss=True,
                           loss_chunk_size=32)
    assert chunked.logprob_path.value == "chunked"
    chunked_grads, chunked_log = first_step(chunked)
    # logps: means of same-sign sums of log-probs, relative to themselves = relative to the sums (measured 3e-8);
    # the step-0 loss is log 2 on both paths (policy == reference)
    for key in ("loss", "logps/chosen", "logps/rejected"):
        assert chunked_log[key] == pytest.approx(full_log[key], rel=RTOL), key
    for name, reference in full_grads.items():  # max abs difference over max |gradient|; measured 5e-7
        assert rel_diff(chunked_grads[name], reference) <= RTOL, name



def test_peft_reference_equals_a_separate_copy_of_the_base_weights(tokenizer, hh_pairs, tmp_path):
    """With a random (non-zero) adapter the policy differs from its base; the reference must be the base."""
    via_adapter, via_copy, policy = adapter_and_copy_references(make_trainer, tokenizer, hh_pairs, tmp_path)
    assert rel_diff(via_adapter, via_copy) <= RTOL  # as above; measured 0 (the same base weights and kernels)
    assert rel_diff(policy, via_copy) > 1e-3  # the adapter does change the policy (measured 5.4e-3, seeded)


@pytest.mark.quick
def test_precomputed_reference_equals_live_reference(tokenizer, hh_pairs, tmp_path):
    live_grads, live_log = first_step(make_trainer(tokenizer, hh_pairs, tmp_path / "live"))
    pre = make_trainer(tokenizer, hh_pairs, tmp_path / "pre", precompute_ref_log_probs=True)
    assert pre.ref_model is None  # no reference copy at all: the initial policy gives the reference log-probs
    pre_grads, pre_log = first_step(pre)
    assert "ref_chosen_logps" in pre.train_dataset.column_names
    assert pre_log["loss"] == pytest.approx(live_log["loss"], rel=RTOL)  # both log 2 at step 0; measured equal
    for name, reference in live_grads.items():  # max abs difference over max |gradient|; measured 0
        assert rel_diff(pre_grads[name], reference) <= RTOL, name


def test_first_step_loss_is_log_2_and_rewards_move_apart(tokenizer, hh_pairs, tmp_path):
    four = hh_pairs.select(range(4))  # the same 4 pairs at every step: their margin must grow
    trainer = make_trainer(tokenizer, four, tmp_path, max_steps=5, per_device_train_batch_size=4, max_length=None)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    # policy == its deep copy at step 0, same batch and kernels: log-ratios exactly 0, so the loss is fp32 log 2
    # (rounding 3e-8 relative) and the margin is 0 up to the 6-decimal logging
    assert logs[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert logs[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    # measured at step 5 with 1, 2 and 4 threads: margin 2.70, loss 0.074 (log 2 = 0.69): far from the thresholds
    assert logs[-1]["rewards/margins"] > 0 and logs[-1]["loss"] < math.log(2)


@pytest.mark.quick
def test_loss_types_against_hand_computed_values():
    pc, pr, rc, rr = (torch.tensor(v) for v in ([-1.0, -2.0], [-1.5, -1.0], [-1.2, -2.5], [-1.0, -1.1]))
    margin = (pc - rc) - (pr - rr)  # [0.7, 0.4]
    beta = 0.5
    losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, beta, "sigmoid")
    expected = [-math.log(1 / (1 + math.exp(-beta * m))) for m in margin.tolist()]
    # fp32 losses of ~0.5 against float64 by hand from the same fp32 inputs: a few ulps; measured <= 1e-7
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    # rewards by hand in float64 from the fp32 inputs: the literals 0.1 and 0.05 differ from what fp32 -1.2 and -1.1
    # give by 2.4e-7 relative; the fp32 differences of these inputs are exact, so only the final rounding remains
    by_hand = lambda a, b: (beta * (a.double() - b.double())).tolist()  # noqa: E731
    assert chosen_rewards.tolist() == pytest.approx(by_hand(pc, rc), rel=1e-6)
    assert rejected_rewards.tolist() == pytest.approx(by_hand(pr, rr), rel=1e-6)
    # label smoothing is robust DPO's (TRL 1.16: the sigmoid loss ignores it); every type: tests/losses/test_dpo_losses.py
    smoothed, _, _ = dpo_loss(pc, pr, rc, rr, beta, "robust", label_smoothing=0.1)
    expected = [(0.9 * -math.log(1 / (1 + math.exp(-beta * m))) - 0.1 * -math.log(1 / (1 + math.exp(beta * m))))
                / 0.8 for m in margin.tolist()]
    assert smoothed.tolist() == pytest.approx(expected, rel=1e-6)  # as above
    # IPO on per-token averages (TRL): margins of 1-token completions are the plain margins
    ones = torch.ones(2)
    ipo, _, _ = dpo_loss(pc, pr, rc, rr, beta, "ipo", chosen_lengths=ones, rejected_lengths=ones)
    assert ipo.tolist() == pytest.approx([(m - 1 / (2 * beta)) ** 2 for m in margin.tolist()], rel=1e-6)
    hinge, _, _ = dpo_loss(pc, pr, rc, rr, beta, "hinge")
    assert hinge.tolist() == pytest.approx([max(0.0, 1 - beta * m) for m in margin.tolist()], rel=1e-6)


def test_implicit_prompt_is_the_shared_dialogue(tokenizer, hh_pairs, tmp_path):
    trainer = make_trainer(tokenizer, hh_pairs, tmp_path, max_length=None)
    row = trainer.train_dataset[0]
    prompt = tokenizer.decode(row["prompt_ids"], skip_special_tokens=True)
    chosen = tokenizer.decode(row["chosen_ids"], skip_special_tokens=True)
    assert prompt.rstrip().endswith("Assistant:")
    assert hh_pairs[0]["chosen"].strip().endswith(chosen.strip())
    assert row["chosen_ids"][-1] == tokenizer.eos_token_id


def test_pretokenised_pairs_in_trl_and_legacy_column_names(tokenizer, hh_pairs, tmp_path):
    prepared = make_trainer(tokenizer, hh_pairs.select(range(6)), tmp_path / "text", max_length=None).train_dataset
    # TRL 1.16's names are what leantune writes, and read back as they are
    assert prepared.column_names == ["prompt_ids", "chosen_ids", "rejected_ids"]
    again = make_trainer(tokenizer, prepared, tmp_path / "ids", max_length=None).train_dataset
    assert again.to_dict() == prepared.to_dict()
    # the names of older TRL releases still train, with a FutureWarning naming the new ones
    legacy = prepared.rename_columns({f"{c}_ids": f"{c}_input_ids" for c in ("prompt", "chosen", "rejected")})
    with pytest.warns(FutureWarning, match="`prompt_input_ids` -> `prompt_ids`"):
        renamed = make_trainer(tokenizer, legacy, tmp_path / "legacy", max_length=None).train_dataset
    assert renamed.to_dict() == prepared.to_dict()


def test_bad_pairs_are_counted_or_rejected(tokenizer, tmp_path, caplog):
    rows = [
        {"prompt": "Say hi.", "chosen": " Hi there!", "rejected": " Go away."},
        {"prompt": "Say hi.", "chosen": " Same.", "rejected": " Same."},  # identical: nothing to prefer
        {"prompt": "Say hi.", "chosen": "   ", "rejected": " No."},  # empty completion
        {"prompt": "word " * 200, "chosen": " ok", "rejected": " no"},  # the prompt alone fills max_length
        {"prompt": "Count.", "chosen": " one two three four five six seven", "rejected": " one"},
    ]
    with caplog.at_level(logging.WARNING, logger="leantune"):
        trainer = make_trainer(tokenizer, Dataset.from_list(rows), tmp_path, max_length=64)
    report = trainer.data_reports["train"]
    assert (report.num_pairs_in, report.num_identical_dropped, report.num_empty_dropped,
            report.num_prompt_too_long_dropped, report.num_pairs_out) == (5, 1, 1, 1, 2)
    assert "identical" in caplog.text and "empty" in caplog.text and "fills max_length" in caplog.text
    with pytest.raises(ValueError, match=r"Columns found: \['answer', 'question'\]"):
        make_trainer(tokenizer, Dataset.from_list([{"question": "q", "answer": "a"}]), tmp_path)
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tokenizer, Dataset.from_list(rows).select([]), tmp_path)
    with pytest.raises(ValueError, match="loss_type"):
        DPOConfig(output_dir="x", loss_type="nope", use_cpu=True)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOConfig(output_dir="x", loss_type="ipo", label_smoothing=0.1, use_cpu=True)


def test_legacy_prompt_and_completion_bounds():
    cut = PairTruncation(max_prompt_length=3, max_completion_length=2, max_length=None)
    assert cut.truncate([1, 2, 3, 4, 5], [6, 7, 8], [9])[:3] == ([3, 4, 5], [6, 7], [9])  # prompt end, completion start
    keep_start = PairTruncation(None, None, max_length=6)
    assert keep_start.truncate([1, 2, 3, 4], [5, 6, 7], [8])[:3] == ([1, 2, 3, 4], [5, 6], [8])
    keep_end = PairTruncation(None, None, max_length=6, mode="keep_end")
    assert keep_end.truncate([1, 2, 3, 4], [5, 6, 7], [8])[:3] == ([2, 3, 4], [5, 6, 7], [8])  # one prompt for both
    assert keep_start.truncate(list(range(7)), [1], [2])[3] is True  # no room left for the completion


def test_cli_trains_on_the_hh_pairs(tokenizer, tmp_path, capsys):
    from leantune.cli.main import main

    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    code = main(["dpo", "--model_name_or_path", str(model_dir), "--dataset_name", str(HH_PAIRS), "--max_steps", "2",
                 "--max_length", "128", "--per_device_train_batch_size", "2", "--output_dir", str(out),
                 "--report_to", "none", "--use_cpu", "true", "--padding_free", "true", "--use_liger_loss", "true"])
    assert code == 0
    assert (out / "model.safetensors").exists()
    assert "=== leantune dpo summary ===" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_demo_moves_held_out_reward_accuracy_up(capsys, tmp_path, monkeypatch):
    from leantune.cli import dpo
    from leantune.cli.main import main

    monkeypatch.setitem(dpo.DEMO_PAIRS, "train", 640)  # 40 steps instead of 300: enough to see the direction
    monkeypatch.setitem(dpo.DEMO_PAIRS, "eval", 64)
    assert main(["dpo", "--output_dir", str(tmp_path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("held-out pairs"))
    import re

    before, after = (float(v) for v in re.search(r"reward accuracy ([\d.]+)% -> ([\d.]+)%", line).groups())
    # at step 0 the policy is the reference: every reward is 0; after 40 steps measured 87.5% (1 thread) and 90.6%
    # (2 threads; OMP_NUM_THREADS=4 is capped at 2 by conftest) on 64 pairs: 60% is > 8 pairs below either
    assert before == 0.0 and after > 60.0, line
