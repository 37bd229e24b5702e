"""Streamed data (datasets.IterableDataset) in every trainer: the same rows, losses, metrics and counts as map-style.

The fair comparison: the map-style run reads its rows in order (`train_sampling_strategy="sequential"`; GRPO/RLOO
`shuffle_dataset=False`), and the stream's buffer holds the whole dataset where a rule depends on more than one row
(packing, KTO's KL partners). Both runs then do the same float operations on the same rows in the same order, so
losses agree to rounding: RTOL = 1e-6 relative to the loss (~10 for these random tiny models, i.e. ~1e-5 absolute),
while one different row in a batch moves a step's loss by more than 1e-3.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from datasets import Dataset
from transformers import TrainerCallback

import leantune.data.streaming as streaming
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
    pack_dataset,
)
from leantune.data.packing import plan_packing

from ..fixtures.data import count_a, gsm8k_prompt_completion
from ..fixtures.data import reversal_prompts as prompts
from ..fixtures.models import char_model, tiny_model, tiny_reward_model

HH_PAIRS_ROWS = 12
RTOL = 1e-6
STEPS = 3
COMMON = dict(report_to=[], save_strategy="no", use_cpu=True, max_steps=STEPS, seed=0, logging_steps=1,
              memory_breakdown=False, disable_tqdm=True, learning_rate=1e-3)


class LossRecorder(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def assert_same_losses(streamed: list, mapped: list) -> None:
    assert len(streamed) == len(mapped) == STEPS
    np.testing.assert_allclose(streamed, mapped, rtol=RTOL)


# --- trainers: the stream trains like the same data read in order ---------------------------------------------------


def offline(cls, config_cls, make_model, max_length):
    """A builder of one offline trainer: (tokenizer, data, tmp_path, callbacks, **config overrides) -> trainer that
    reads its data in order."""
    def build(tokenizer, data, tmp_path, callbacks=(), **overrides):
        args = config_cls(**{**COMMON, "output_dir": str(tmp_path), "max_length": max_length,
                             "per_device_train_batch_size": 4, "train_sampling_strategy": "sequential", **overrides})
        return cls(make_model(), args=args, train_dataset=data, processing_class=tokenizer, callbacks=list(callbacks))
    return build


sft = offline(SFTTrainer, SFTConfig, tiny_model, 128)
dpo = offline(DPOTrainer, DPOConfig, tiny_model, 160)
kto = offline(KTOTrainer, KTOConfig, tiny_model, 160)
reward = offline(RewardTrainer, RewardConfig, tiny_reward_model, 160)


def online(cls, config_cls, tokenizer, data, tmp_path, callbacks=(), **overrides):
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, shuffle_dataset=False, **{**COMMON, **overrides})
    return cls(char_model(tokenizer), count_a, args=args, train_dataset=data, processing_class=tokenizer,
               callbacks=list(callbacks))


def losses_of(build, data, tmp_path, **overrides) -> list:
    recorder = LossRecorder()
    build(data, tmp_path, callbacks=[recorder], **overrides).train()
    return recorder.losses


@pytest.mark.parametrize("layout", [{}, {"padding_free": True}, {"packing": True},
                                    {"packing": True, "packing_strategy": "bfd_split", "padding_free": True},
                                    {"packing": True, "packing_strategy": "wrapped"}],
                         ids=["padded", "padding_free", "packed_bfd", "packed_bfd_split_padding_free", "wrapped"])
def test_sft_stream_trains_like_the_dataset_in_order(layout, tokenizer, gsm8k_rows, tmp_path):
    data = gsm8k_prompt_completion(gsm8k_rows, 32)

    def build(d, path, **kw):
        return sft(tokenizer, d, path, **kw)

    mapped = losses_of(build, data, tmp_path / "map", **layout)
    streamed = losses_of(build, data.to_iterable_dataset(), tmp_path / "stream", **layout)
    assert_same_losses(streamed, mapped)


@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_preference_streams_train_like_the_dataset_in_order(method, tokenizer, hh_pairs, tmp_path):
    make = {"dpo": dpo, "kto": kto, "reward": reward}[method]

    def build(d, path, **kw):
        return make(tokenizer, d, path, **kw)

    mapped = losses_of(build, hh_pairs, tmp_path / "map")
    streamed = losses_of(build, hh_pairs.to_iterable_dataset(), tmp_path / "stream")
    assert_same_losses(streamed, mapped)


@pytest.mark.parametrize("cls,config_cls", [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)],
                         ids=["grpo", "rloo"])
def test_online_streams_train_like_the_prompts_in_order(cls, config_cls, char_tokenizer, tmp_path):
    def build(d, path, **kw):
        return online(cls, config_cls, char_tokenizer, d, path, **kw)

    data = prompts(24)
    mapped = losses_of(build, data, tmp_path / "map")
    streamed = losses_of(build, data.to_iterable_dataset(), tmp_path / "stream")
    assert_same_losses(streamed, mapped)


def test_a_streamed_train_set_needs_max_steps(tokenizer, gsm8k_rows, hh_pairs, char_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"`max_steps`"):
        sft(tokenizer, gsm8k_prompt_completion(gsm8k_rows, 8).to_iterable_dataset(), tmp_path, max_steps=-1)
    with pytest.raises(ValueError, match=r"`max_steps`"):
        dpo(tokenizer, hh_pairs.to_iterable_dataset(), tmp_path, max_steps=-1)
    with pytest.raises(ValueError, match=r"`max_steps`"):
        online(GRPOTrainer, GRPOConfig, char_tokenizer, prompts(24).to_iterable_dataset(), tmp_path, max_steps=-1)
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        dpo(tokenizer, hh_pairs.to_iterable_dataset(), tmp_path, precompute_ref_log_probs=True)


# --- evaluation on a stream -----------------------------------------------------------------------------------------


def test_eval_streams_give_the_dataset_metrics(tokenizer, gsm8k_rows, hh_pairs, char_tokenizer, tmp_path):
    # Same model, same rows, same order: the metrics agree to rounding (RTOL of the values, ~10 or ~0.7).
    data = gsm8k_prompt_completion(gsm8k_rows, 12)
    args = SFTConfig(output_dir=str(tmp_path), max_length=128, per_device_eval_batch_size=4, **COMMON)
    mapped = SFTTrainer(tiny_model(), args=args, train_dataset=data, eval_dataset={"a": data},
                        processing_class=tokenizer)
    streamed = SFTTrainer(tiny_model(), args=args, train_dataset=data.to_iterable_dataset(),
                          eval_dataset={"a": data.to_iterable_dataset()}, processing_class=tokenizer)
    expected, got = mapped.evaluate(), streamed.evaluate()
    assert got["eval_a_loss"] == pytest.approx(expected["eval_a_loss"], rel=RTOL)
    # a raw stream given to evaluate() is prepared there, by the same recipe
    assert streamed.evaluate(data.to_iterable_dataset())["eval_loss"] == pytest.approx(expected["eval_a_loss"],
                                                                                     rel=RTOL)
    # ... also by a trainer built on map-style data only (its accelerator was set up to dispatch batches)
    assert mapped.evaluate(data.to_iterable_dataset())["eval_loss"] == pytest.approx(expected["eval_a_loss"],
                                                                                   rel=RTOL)

    pairs_map = dpo(tokenizer, hh_pairs, tmp_path)
    pairs_stream = dpo(tokenizer, hh_pairs.to_iterable_dataset(), tmp_path)
    expected, got = pairs_map.evaluate(hh_pairs), pairs_stream.evaluate(hh_pairs.to_iterable_dataset())
    for name in ("eval_loss", "eval_rewards/accuracies", "eval_logps/chosen", "eval_logps/rejected"):
        assert got[name] == pytest.approx(expected[name], rel=RTOL, abs=1e-6), name

    # precomputed reference log-probs need a whole dataset: a stream given to evaluate() is refused, by name
    precomputing = dpo(tokenizer, hh_pairs, tmp_path, precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported with IterableDataset"):
        precomputing.evaluate(hh_pairs.to_iterable_dataset())

    grpo_map = online(GRPOTrainer, GRPOConfig, char_tokenizer, prompts(24), tmp_path)
    grpo_stream = online(GRPOTrainer, GRPOConfig, char_tokenizer, prompts(24).to_iterable_dataset(), tmp_path)
    expected, got = grpo_map.evaluate(prompts(8)), grpo_stream.evaluate(prompts(8).to_iterable_dataset())
    assert expected and got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=RTOL, abs=1e-9), name


# --- drop and truncation counts: summed over buffers, equal to the map-style counts --------------------------------


def counts_of(report) -> dict:
    return {k: v for k, v in report.as_dict().items() if k != "split"}


def stream_report(trainer):
    (report,) = [r for key, r in trainer.stream_reports.items() if key == id(trainer.train_dataset)]
    return report


def test_sft_stream_counts_and_rows_equal_the_dataset(tokenizer, gsm8k_rows, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(streaming, "STREAM_BUFFER_ROWS", 5)  # several buffers, one of them with nothing left
    rows = [{"prompt": r["question"], "completion": " " + r["answer"]} for r in gsm8k_rows[:12]]
    rows[1]["completion"] = ""  # empty: dropped
    long_prompt = {"prompt": " ".join(["word"] * 200), "completion": " yes"}  # prompt fills max_length: no target
    rows[5:10] = [{"prompt": "", "completion": ""}] * 4 + [long_prompt]  # a whole buffer dropped
    data = Dataset.from_list(rows)
    mapped = sft(tokenizer, data, tmp_path)
    streamed = sft(tokenizer, data.to_iterable_dataset(), tmp_path)
    assert list(streamed.train_dataset) == [mapped.train_dataset[i] for i in range(len(mapped.train_dataset))]
    expected = counts_of(mapped.data_reports["train"])
    assert expected["num_empty_dropped"] == 5 and expected["num_without_targets_dropped"] == 1
    assert expected["num_truncated"] > 0
    assert counts_of(stream_report(streamed)) == expected
    with caplog.at_level(logging.WARNING, logger="leantune.data"):
        streamed.train()  # the counts of the rows read are logged at the end of training
    assert "train: dropped" in caplog.text and "empty example(s)" in caplog.text


def test_preference_kto_and_prompt_stream_counts_equal_the_dataset(tokenizer, hh_pairs, char_tokenizer, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(streaming, "STREAM_BUFFER_ROWS", 3)
    rows = hh_pairs.to_list()[:10]
    rows[2] = dict(rows[2], rejected=rows[2]["chosen"])  # identical: dropped
    rows[4] = dict(rows[4], chosen="")  # empty: dropped
    data = Dataset.from_list(rows)
    short = dict(max_length=48, max_prompt_length=40)  # truncation counted, some prompts fill max_length
    mapped, streamed = dpo(tokenizer, data, tmp_path, **short), dpo(tokenizer, data.to_iterable_dataset(), tmp_path,
                                                                    **short)
    assert list(streamed.train_dataset) == [mapped.train_dataset[i] for i in range(len(mapped.train_dataset))]
    expected = counts_of(mapped.data_reports["train"])
    assert expected["num_empty_dropped"] == 1 and expected["num_identical_dropped"] == 1
    assert counts_of(stream_report(streamed)) == expected

    mapped, streamed = kto(tokenizer, data, tmp_path, **short), kto(tokenizer, data.to_iterable_dataset(), tmp_path,
                                                                    **short)
    got_rows = list(streamed.train_dataset)
    expected_rows = [mapped.train_dataset[i] for i in range(len(mapped.train_dataset))]
    without_kl = [{k: v for k, v in r.items() if k != "KL_completion_ids"} for r in got_rows]
    assert without_kl == [{k: v for k, v in r.items() if k != "KL_completion_ids"} for r in expected_rows]
    expected, got = counts_of(mapped.data_reports["train"]), counts_of(stream_report(streamed))
    # KL partners are drawn inside each buffer of 3 rows, so only the same-prompt fallback count may differ.
    expected.pop("num_kl_partner_same_prompt"), got.pop("num_kl_partner_same_prompt")
    assert got == expected and expected["num_identical_pairs_dropped"] == 1

    prompt_rows = Dataset.from_dict({"prompt": ["reverse: ab =", "reverse: " + "x" * 80 + " =", "",
                                                "reverse: cd =", "", ""] * 3})
    mapped = online(GRPOTrainer, GRPOConfig, char_tokenizer, prompt_rows, tmp_path)
    streamed = online(GRPOTrainer, GRPOConfig, char_tokenizer, prompt_rows.to_iterable_dataset(), tmp_path)
    assert [r["prompt_ids"] for r in streamed.train_dataset] == mapped.train_dataset["prompt_ids"]
    expected = counts_of(mapped.data_reports["train"])
    assert counts_of(stream_report(streamed)) == expected and expected["num_empty_dropped"] == 9


# --- streaming packing ----------------------------------------------------------------------------------------------


def numbered_sequences(lengths) -> Dataset:
    """Sequence i holds tokens i * 1000 + (0..n-1): every token is unique, so losses and duplicates show."""
    return Dataset.from_dict({"input_ids": [[i * 1000 + j for j in range(n)] for i, n in enumerate(lengths)]})


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_streaming_packing_keeps_every_token_once_and_equals_bfd_with_a_whole_buffer(strategy):
    lengths = np.random.default_rng(0).integers(1, 90 if strategy == "bfd" else 150, size=57)
    data, seq_length = numbered_sequences(lengths), 64
    packed = pack_dataset(data.to_iterable_dataset(), seq_length, strategy, buffer_rows=10)
    assert type(packed).__name__ == "IterableDataset"
    rows = list(packed)
    assert all(len(r["input_ids"]) <= seq_length and sum(r["seq_lengths"]) == len(r["input_ids"]) for r in rows)
    tokens = np.sort(np.concatenate([r["input_ids"] for r in rows]))
    kept = np.concatenate([ids[:seq_length] if strategy == "bfd" else ids for ids in data["input_ids"]])
    np.testing.assert_array_equal(tokens, np.sort(kept))  # no token lost (beyond bfd's counted cut) or repeated
    for row in rows:  # each segment is one run of consecutive tokens of one sequence, positions restarting
        starts = np.cumsum([0, *row["seq_lengths"][:-1]])
        for start, n in zip(starts, row["seq_lengths"]):
            segment = np.asarray(row["input_ids"][start:start + n])
            assert len(set(segment // 1000)) == 1 and np.all(np.diff(segment) == 1)
            assert row["position_ids"][start:start + n] == list(range(n))

    whole = list(pack_dataset(data.to_iterable_dataset(), seq_length, strategy, buffer_rows=len(data)))
    assert whole == pack_dataset(data, seq_length, strategy).to_list()
    plan = plan_packing(lengths, seq_length, strategy)
    assert [r["seq_lengths"] for r in whole] == [plan.segment_length[a:b].tolist() for a, b in
                                                  zip(plan.row_offsets[:-1], plan.row_offsets[1:])]


def test_stream_rounds_read_the_prompts_in_order_or_through_a_seeded_shuffle_buffer():
    from leantune.trainers.online_trainer import StreamRounds

    stream = prompts(24).to_iterable_dataset()
    in_order = list(StreamRounds(stream, 5, 2, shuffle=False, seed=0))
    assert [[r["prompt"] for r in rows] for rows in in_order[::2]] == [
        prompts(24)["prompt"][i:i + 5] for i in range(0, 20, 5)]  # the incomplete last round (4 prompts) left out
    assert all(a == b for a, b in zip(in_order[::2], in_order[1::2]))  # each round once per micro-batch
    rounds = StreamRounds(stream, 6, 1, shuffle=True, seed=0)
    first = [r["prompt"] for rows in rounds for r in rows]
    assert sorted(first) == sorted(prompts(24)["prompt"]) and first != prompts(24)["prompt"]
    assert first == [r["prompt"] for rows in rounds for r in rows]  # seeded
    rounds.set_epoch(1)
    assert [r["prompt"] for rows in rounds for r in rows] != first  # a new order each epoch
