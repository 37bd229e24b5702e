"""Padded, padding-free and packed batches must give the same per-token losses and gradients.

Tolerance: relative difference <= 1e-5 in fp32 (max abs difference over max magnitude, per tensor). The per-token
losses of these random tiny models are about ln(32000) ~ 10.4, so 1e-5 allows ~1e-4 absolute; the layouts differ
only in the shapes (and so the summation order) of the same fp32 matmuls and attention, which moves results by a
few ulps (packed + padding-free against padded or packed, measured: per-token <= 9e-8 relative, ~1e-6 absolute;
one step's loss 9e-8 and gradients <= 5.3e-7 relative), while a real layout error (a token attending across a
sequence boundary, a wrong position id, a target at a sequence start) changes losses by more than 1e-2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leantune import SFTConfig, SFTTrainer
from leantune.losses.token_logprobs import count_targets

from ..fixtures.comparisons import GradientRecorder, rel_diff, token_nll
from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model
from ..fixtures.sft_layouts import losses_by_sequence, make_trainer, model_inputs, sequence_losses, whole_dataset_batch

RTOL = 1e-5


def losses_and_gradients(model, batch) -> tuple[dict, dict[str, torch.Tensor]]:
    """Each sequence's per-token losses and the batch's gradients, from one forward (its logits are the cost here)."""
    model.zero_grad()
    nll = token_nll(model(**model_inputs(batch)).logits, batch["labels"])
    (nll.sum() / count_targets(batch["labels"])).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return losses_by_sequence(batch, nll), grads


LAYOUTS = {
    "padded": {},
    "padding_free": {"padding_free": True},
    "packed_bfd": {"packing": True, "packing_strategy": "bfd"},
    # packing + padding_free: the packed rows of a batch laid end to end in one row, no padding (TRL's bfd default).
    "packed_padding_free": {"packing": True, "padding_free": True},
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_padding_free_and_packed_agree_per_token_and_in_gradients(arch, attn, tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 12)  # 12 rows pack into fewer (asserted below)
    model = tiny_model(arch, attn_implementation=attn)
    model.config.use_cache = False
    results = {}
    for name, overrides in LAYOUTS.items():
        trainer = make_trainer(model, tokenizer, dataset, tmp_path / name, **overrides)
        batch = whole_dataset_batch(trainer)
        results[name] = (*losses_and_gradients(model, batch), count_targets(batch["labels"]))
    padded_losses, padded_grads, padded_count = results["padded"]
    assert len(padded_losses) == 12
    for name in ("padding_free", "packed_bfd", "packed_padding_free"):
        losses, grads, count = results[name]
        assert int(count) == int(padded_count), f"{name}: different number of loss tokens"
        assert set(losses) >= set(padded_losses), f"{name}: sequences missing"
        for key, reference in padded_losses.items():
            assert rel_diff(losses[key], reference) <= RTOL, f"{name}: per-token losses differ"
        assert grads.keys() == padded_grads.keys()
        for param, reference in padded_grads.items():
            assert rel_diff(grads[param], reference) <= RTOL, f"{name}: gradient of {param} differs"
    packed_rows = results["packed_bfd"]
    assert packed_rows  # packing produced fewer rows than examples:
    trainer = make_trainer(model, tokenizer, dataset, tmp_path / "rows", packing=True)
    assert len(trainer.train_dataset) < len(dataset)


@pytest.mark.quick
def test_attention_does_not_cross_packed_sequences(tokenizer, gsm8k_rows, tmp_path):
    """Changing one sequence of a packed row must not change the losses of the others."""
    dataset = gsm8k_prompt_completion(gsm8k_rows, 8)
    model = tiny_model("llama")
    trainer = make_trainer(model, tokenizer, dataset, tmp_path, padding_free=True)
    rows = [trainer.train_dataset[i] for i in range(4)]
    base = sequence_losses(model, trainer.data_collator(rows))
    altered = [dict(r) for r in rows]
    altered[0]["input_ids"] = [altered[0]["input_ids"][0]] + [5] * (len(altered[0]["input_ids"]) - 1)
    changed = sequence_losses(model, trainer.data_collator(altered))
    for row in rows[1:]:
        key = tuple(row["input_ids"])
        assert rel_diff(changed[key], base[key]) <= RTOL


def first_step(tokenizer, dataset, tmp_path, **overrides):
    model = tiny_model("llama")
    recorder = GradientRecorder(model)
    trainer = make_trainer(model, tokenizer, dataset, tmp_path, **overrides)
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.grads, trainer.state.log_history[0]["loss"]


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_batch_8_equals_batch_2_with_accumulation_4(layout, tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    extra = LAYOUTS[layout]
    grads_8, loss_8 = first_step(tokenizer, dataset, tmp_path / "b8", per_device_train_batch_size=8, **extra)
    grads_2x4, loss_2x4 = first_step(
        tokenizer, dataset, tmp_path / "b2", per_device_train_batch_size=2, gradient_accumulation_steps=4, **extra
    )
    assert abs(loss_8 - loss_2x4) <= RTOL * abs(loss_8)
    for name, reference in grads_8.items():
        assert rel_diff(grads_2x4[name], reference) <= RTOL, name


@pytest.mark.quick
def test_logged_loss_is_token_mean_of_the_step(tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 8)
    model = tiny_model("llama")
    trainer = make_trainer(model, tokenizer, dataset, tmp_path, per_device_train_batch_size=8,
                           learning_rate=0.0)
    batch = whole_dataset_batch(trainer)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        expected = float(token_nll(model(**inputs).logits, batch["labels"]).sum() / count_targets(batch["labels"]))
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_dft_loss_and_token_metrics_by_hand(tokenizer, gsm8k_rows, tmp_path):
    """loss_type="dft" is the step's token mean of NLL x p (p detached); `mean_token_accuracy` the share of targets
    that are the argmax, `entropy` the targets' mean entropy, as TRL logs them; a `compute_loss_func` replaces the
    loss and gets the full logits. Values: fp32 sums over ~1000 targets, rel 1e-5 as above; accuracy is a count."""
    from leantune.losses.token_logprobs import shifted_targets

    dataset = gsm8k_prompt_completion(gsm8k_rows, 8)
    model = tiny_model("llama")
    batch = None
    for loss_type in ("dft", "nll"):
        trainer = make_trainer(model, tokenizer, dataset, tmp_path / loss_type, per_device_train_batch_size=8,
                               learning_rate=0.0, loss_type=loss_type, padding_free=loss_type == "dft")
        batch = whole_dataset_batch(make_trainer(model, tokenizer, dataset, tmp_path / "padded",
                                                 per_device_train_batch_size=8))
        trainer.train()
        logged = trainer.state.log_history[0]
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            logits = model(**inputs).logits.float()
        nll = token_nll(logits, batch["labels"])
        targets = shifted_targets(batch["labels"])
        is_target = targets != -100
        per_token = nll * torch.exp(-nll) if loss_type == "dft" else nll
        assert logged["loss"] == pytest.approx(float(per_token[is_target].sum() / is_target.sum()), rel=RTOL)
        top1 = (logits.argmax(-1) == targets)[is_target].float().mean()
        assert logged["mean_token_accuracy"] == pytest.approx(float(top1), abs=1e-6)
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)[is_target].mean()
        assert logged["entropy"] == pytest.approx(float(entropy), rel=RTOL)
    seen = []

    def doubled(outputs, labels, num_items_in_batch=None):
        seen.append(outputs.logits.shape[-1])
        return 2 * token_nll(outputs.logits, labels).sum() / count_targets(labels)

    trainer = make_trainer(model, tokenizer, dataset, tmp_path / "func", per_device_train_batch_size=8,
                           learning_rate=0.0)
    trainer.compute_loss_func = doubled
    trainer.train()
    assert seen and seen[0] == model.config.vocab_size
    assert trainer.state.log_history[0]["loss"] == pytest.approx(2 * logged["loss"], rel=RTOL)
    with pytest.raises(ValueError, match="dft"):
        SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "x"), loss_type="dft", report_to=[]),
                   train_dataset=dataset, processing_class=tokenizer, compute_loss_func=doubled)


@pytest.mark.quick
def test_bfd_split_keeps_every_token(tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 24)
    full = make_trainer(tiny_model(), tokenizer, dataset, tmp_path / "full", max_length=None).train_dataset
    split = make_trainer(tiny_model(), tokenizer, dataset, tmp_path / "split", max_length=96, packing=True,
                         packing_strategy="bfd_split")
    assert split.data_reports["train"].num_truncated == 0
    rows = split.train_dataset
    assert max(len(r) for r in rows["input_ids"]) <= 96
    assert sum(len(r) for r in rows["input_ids"]) == sum(len(r) for r in full["input_ids"])
    assert sorted(t for r in rows["input_ids"] for t in r) == sorted(t for r in full["input_ids"] for t in r)


def test_wrapped_differs_from_padded_only_at_the_cuts(tokenizer, gsm8k_rows, tmp_path):
    """Pieces that start an example match padded per token; only continuations after a cut (no context) differ."""
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    model = tiny_model("llama")
    padded = make_trainer(model, tokenizer, dataset, tmp_path / "padded", max_length=None)
    examples = [padded.train_dataset[i]["input_ids"] for i in range(len(padded.train_dataset))]
    reference = sequence_losses(model, whole_dataset_batch(padded))
    wrapped = make_trainer(model, tokenizer, dataset, tmp_path / "wrapped", max_length=200, packing=True,
                           packing_strategy="wrapped")
    batch = whole_dataset_batch(wrapped)
    with torch.no_grad():
        nll = token_nll(model(**model_inputs(batch)).logits, batch["labels"])
    # Walk the rows in order: wrapped keeps dataset order, so pieces map back to (example, offset).
    example, offset, cuts, checked = 0, 0, 0, 0
    for row in range(batch["input_ids"].shape[0]):
        positions = batch["position_ids"][row]
        starts = torch.nonzero(positions == 0).flatten().tolist() + [positions.numel()]
        for a, b in zip(starts[:-1], starts[1:]):
            if example == len(examples):
                break  # trailing padding segment
            piece = batch["input_ids"][row, a:b].tolist()
            source = examples[example]
            assert piece == source[offset: offset + len(piece)]
            expected = reference[tuple(source)][offset: offset + len(piece)]
            got = nll[row, a:b].numpy()
            if offset == 0:
                # Same tokens with the same context; the last in-piece position has no target when cut.
                last = len(piece) - (1 if len(piece) < len(source) else 0)
                assert rel_diff(got[:last], expected[:last]) <= RTOL
                checked += 1
            else:
                cuts += 1
            offset += len(piece)
            if offset == len(source):
                example, offset = example + 1, 0
    assert example == len(examples) and checked == len(examples) and cuts >= 1


def test_packing_with_padding_free_is_packing_without_the_padding(tokenizer, gsm8k_rows, tmp_path):
    """packing=True + padding_free=True: the batch's packed rows end to end in one row, each sequence keeping its
    restarting positions; the same per-token losses as packing alone and padded batches, and the same loss and
    gradients of a training step (trainer path: chunked loss, per-sequence attention)."""
    dataset = gsm8k_prompt_completion(gsm8k_rows, 16)
    model = tiny_model("llama")
    packed = make_trainer(model, tokenizer, dataset, tmp_path / "p", packing=True)
    flat = make_trainer(model, tokenizer, dataset, tmp_path / "f", packing=True, padding_free=True)
    rows = [packed.train_dataset[i] for i in range(len(packed.train_dataset))]
    packed_batch, flat_batch = packed.data_collator(rows), flat.data_collator(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    # one row of exactly the real tokens: no padding segment, one cu_seq_lens entry per sequence of every row
    assert flat_batch["input_ids"].shape == (1, sum(lengths))
    assert int(flat_batch["num_real_tokens"]) == sum(lengths) == flat_batch["input_ids"].numel()
    segments = [n for r in rows for n in r["seq_lengths"]]
    assert flat_batch["cu_seq_lens_q"].tolist() == np.concatenate([[0], np.cumsum(segments)]).tolist()
    assert flat_batch["max_length_q"] == max(segments)
    assert flat_batch["position_ids"][0].tolist() == [p for r in rows for p in r["position_ids"]]
    packed_labels = torch.cat([packed_batch["labels"][i, :n] for i, n in enumerate(lengths)])
    assert torch.equal(flat_batch["labels"][0], packed_labels)  # the same targets
    packed_losses, flat_losses = sequence_losses(model, packed_batch), sequence_losses(model, flat_batch)
    assert len(flat_losses) == len(segments) and set(flat_losses) <= set(packed_losses)  # packed: + padding segments
    for key, losses in flat_losses.items():
        assert rel_diff(losses, packed_losses[key]) <= RTOL

    # one optimizer step over the whole dataset: padded, packed and packed + padding-free agree
    steps = {}
    for name, extra in (("padded", {}), ("packed", {"packing": True}),
                        ("packed_padding_free", {"packing": True, "padding_free": True})):
        model = tiny_model("llama")
        recorder = GradientRecorder(model)
        trainer = make_trainer(model, tokenizer, dataset, tmp_path / f"step_{name}", per_device_train_batch_size=16,
                               **extra)
        trainer.add_callback(recorder)
        trainer.train()
        steps[name] = (recorder.grads, trainer.state.log_history[0])
    grads_padded, log_padded = steps["padded"]
    for name in ("packed", "packed_padding_free"):
        grads, log = steps[name]
        assert abs(log["loss"] - log_padded["loss"]) <= RTOL * abs(log_padded["loss"]), name
        for param, reference in grads_padded.items():
            assert rel_diff(grads[param], reference) <= RTOL, f"{name}: gradient of {param} differs"
    # padding_fraction counts the computed positions that are not real tokens: none in one flat row
    assert steps["packed_padding_free"][1]["padding_fraction"] == 0.0
    assert steps["packed"][1]["padding_fraction"] > 0.0
