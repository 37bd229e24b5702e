"""GKD: the generalised JSD against hand-computed values and TRL's, the trainer's loss against plain torch, every
layout and path equal (loss and gradients), Liger's fused JSD equal to the chunked one, on-policy and seq_kd steps
(reproducible, counted), a 4-bit teacher, and the user's mistakes named.

Tolerances (fp32 throughout). A per-token divergence is a sum over the vocabulary (~100 terms here) of p * (log p -
log q) terms; two exact implementations differ by rounding only: each term's relative error is a few fp32 eps
(1.2e-7) and the sum's error is bounded by (terms x eps) x the largest term, i.e. ~1e-5 relative to the magnitude of
what is summed. So losses compare with rtol 1e-5 of their value, and gradient tensors with 1e-5 of their largest
entry (layouts also change the models' attention kernels: per-sequence SDPA against a padded mask, whose hidden states
differ by rounding of the same order).
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from leantune import GKDConfig, GKDTrainer
from leantune.data.collators import CausalLMCollator, sequence_prompts
from leantune.defaults import build_default_model_config
from leantune.losses.distillation import generalized_jsd
from leantune.losses.token_logprobs import count_targets
from leantune.trainers.parts.logprob_engine import LogProbPath
from leantune.utils.imports import is_available

from ..fixtures.comparisons import loss_and_grads

RTOL = 1e-5


def char_model(tokenizer, seed: int, hidden: int = 128, initializer_range: float = 0.3):
    """The demo's Llama (tied head, ~100-token vocabulary), a wide init so the two models' distributions differ."""
    from transformers import AutoModelForCausalLM

    config = build_default_model_config(tokenizer)
    config.hidden_size, config.intermediate_size, config.initializer_range = hidden, 2 * hidden, initializer_range
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def reversals(n: int = 12) -> Dataset:
    words = ["cat", "dog", "bird", "fish", "tree", "lake", "road", "moon", "star", "wind", "rain", "snow"]
    return Dataset.from_dict({"prompt": [f"reverse: {words[i % 12]}{'x' * (i % 3)} =" for i in range(n)],
                              "completion": [f" {(words[i % 12] + 'x' * (i % 3))[::-1]}" for i in range(n)]})


def gkd_trainer(tokenizer, tmp_path, teacher=None, **overrides):
    settings = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_length=64,
                    per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3, logging_steps=1, seed=0,
                    disable_tqdm=True, memory_breakdown=False, lmbda=0.0, max_grad_norm=0.0)
    settings.update(overrides)
    teacher = teacher if teacher is not None else char_model(tokenizer, seed=0)
    return GKDTrainer(model=char_model(tokenizer, seed=1, hidden=64), teacher_model=teacher,
                      args=GKDConfig(**settings), train_dataset=reversals(), processing_class=tokenizer)


def assert_same(got, expected, what):
    (loss, grads), (ref_loss, ref_grads) = got, expected
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=RTOL * float(ref_loss.abs()))
    assert grads.keys() == ref_grads.keys() and grads
    for name, ref in ref_grads.items():
        scale = float(ref.abs().max())
        assert float((grads[name] - ref).abs().max()) <= RTOL * scale + 1e-12, (what, name)


# --- the divergence -----------------------------------------------------------------------------------------------


def test_generalized_jsd_against_hand_computed_values_and_trls():
    s, t = [0.7, 0.2, 0.1], [0.1, 0.3, 0.6]

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b))

    def by_hand(beta):
        if beta == 0.0:
            return kl(t, s)  # forward KL: teacher || student
        if beta == 1.0:
            return kl(s, t)  # reverse KL
        m = [beta * y + (1 - beta) * x for x, y in zip(s, t)]
        return beta * kl(t, m) + (1 - beta) * kl(s, m)

    logs = torch.tensor([s]).log(), torch.tensor([t]).log()
    for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
        # values ~0.1-1: fp32 rounding of 3 terms is ~1e-7 of them
        assert float(generalized_jsd(*logs, beta)) == pytest.approx(by_hand(beta), rel=1e-6), beta

    # TRL's own function (batchmean over the unmasked tokens) on random logits: the same per-token values
    from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer

    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11) * 3, torch.randn(2, 5, 11) * 3
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    mask = labels != -100
    for beta in (0.0, 0.5, 1.0):
        ours = generalized_jsd(student.log_softmax(-1)[mask], teacher.log_softmax(-1)[mask], beta).sum() / mask.sum()
        theirs = TRLGKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta)
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_chunked_sum_and_per_target_chunks_equal_autograd_through_full_logits(beta):
    """Both chunked forms (gradient formed in forward; per target, recomputed in backward) against autograd through
    the plain formula, with a logit scale, soft-capping and a biased head (the chain rule of OutputHead.transform)."""
    from leantune.losses.distillation import chunked_jsd, chunked_jsd_sum
    from leantune.losses.token_logprobs import select_targets
    from leantune.models.output_head import OutputHead

    torch.manual_seed(0)
    student_head = OutputHead(torch.nn.Linear(16, 40), softcap=5.0, scale=1.7)
    teacher_head = OutputHead(torch.nn.Linear(24, 40, bias=False))
    student, teacher = torch.randn(2, 9, 16), torch.randn(2, 9, 24)
    labels = torch.randint(0, 40, (2, 9))
    labels[0, :3] = -100
    targets = select_targets(labels)
    params = [student_head.module.weight, student_head.module.bias]

    def run(loss_fn):
        hidden = student.clone().requires_grad_()
        loss = loss_fn(hidden)
        return [loss.detach(), *torch.autograd.grad(loss, [hidden, *params])]

    def plain(hidden):
        rows = [h.reshape(-1, h.shape[-1])[targets.index] for h in (hidden, teacher)]
        return generalized_jsd(student_head.logits(rows[0]).log_softmax(-1),
                               teacher_head.logits(rows[1]).log_softmax(-1), beta).sum()

    expected = run(plain)
    for loss_fn in (lambda h: chunked_jsd_sum(h, student_head, teacher, teacher_head, targets, beta, chunk_size=4),
                    lambda h: chunked_jsd(h, student_head, teacher, teacher_head, targets, beta, chunk_size=4).sum()):
        for got, want in zip(run(loss_fn), expected):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()))


@pytest.mark.quick
def test_trainer_loss_is_the_plain_torch_jsd_of_the_completion_tokens(char_tokenizer, tmp_path):
    trainer = gkd_trainer(char_tokenizer, tmp_path, beta=0.3)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss, _ = loss_and_grads(trainer, batch, LogProbPath.CHUNKED)
    # independently: both models' full logits, next-token shift, completion tokens only, probabilities mixed as such
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        s = trainer.model(**inputs).logits[:, :-1].softmax(-1)
        t = trainer.teacher_model(**inputs).logits[:, :-1].softmax(-1)
    mask = batch["labels"][:, 1:] != -100
    s, t = s[mask].double(), t[mask].double()
    m = 0.3 * t + 0.7 * s
    per_token = 0.3 * (t * (t / m).log()).sum(-1) + 0.7 * (s * (s / m).log()).sum(-1)
    assert int(mask.sum()) == int(count_targets(batch["labels"])) > 0
    # the prompt tokens are not targets: every target lies after its row's prompt
    prompt_lengths = [len(p) for p in sequence_prompts(batch)]
    assert all(int(row.nonzero()[0]) + 1 == n for row, n in zip(mask, prompt_lengths))
    assert float(loss) == pytest.approx(float(per_token.sum() / mask.sum()), rel=RTOL)
    assert float(loss) > 1e-3  # the two models really differ (the comparison is not of zeros)


def test_messages_train_on_their_last_message(char_tokenizer, tmp_path):
    """TRL's GKD reads `messages` as prompt = all but the last message, completion = the last one."""
    dialogues = Dataset.from_dict({"messages": [[{"role": "user", "content": "reverse: cat ="},
                                                  {"role": "assistant", "content": "tac"},
                                                  {"role": "user", "content": "reverse: dog ="},
                                                  {"role": "assistant", "content": "god"}]] * 4})
    trainer = gkd_trainer(char_tokenizer, tmp_path)
    prepared, _ = trainer.prepare_split(dialogues, "eval", char_tokenizer, trainer.args)
    row = prepared[0]
    targets = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert char_tokenizer.decode(targets, skip_special_tokens=True).strip() == "god"
    assert "tac" in char_tokenizer.decode(row["input_ids"])  # the earlier turns stay, as prompt


def packed_rows(examples, per_row: int = 2):
    rows = []
    for i in range(0, len(examples), per_row):
        group = examples[i:i + per_row]
        rows.append({"input_ids": sum((e["input_ids"] for e in group), []),
                     "labels": sum((e["labels"] for e in group), []),
                     "seq_lengths": [len(e["input_ids"]) for e in group]})
    return rows


@pytest.mark.quick
def test_padded_padding_free_packed_chunked_and_full_agree(char_tokenizer, tmp_path):
    """One trainer (segment attention on: padded batches still get sdpa's mask), every layout through the full
    logits and the chunked JSD (5 targets per chunk: several chunks), beta 0, 0.5 and 1: loss and gradients."""
    trainer = gkd_trainer(char_tokenizer, tmp_path, padding_free=True, loss_chunk_size=5)
    examples = [trainer.train_dataset[i] for i in range(6)]
    pad = char_tokenizer.pad_token_id
    batches = {"padded": CausalLMCollator(pad)(examples),
               "padding_free": CausalLMCollator(pad, padding_free=True)(examples),
               "packed": CausalLMCollator(pad)(packed_rows(examples))}
    assert len({int(count_targets(b["labels"])) for b in batches.values()}) == 1
    for beta in (0.0, 0.5, 1.0):
        trainer.args.beta = beta
        reference = loss_and_grads(trainer, batches["padded"], LogProbPath.FULL)
        for layout, batch in batches.items():
            for path in (LogProbPath.FULL, LogProbPath.CHUNKED):
                if (layout, path) != ("padded", LogProbPath.FULL):
                    assert_same(loss_and_grads(trainer, batch, path), reference, (beta, layout, path))


@pytest.mark.liger_interpreter
def test_liger_fused_jsd_equals_the_chunked_path(char_tokenizer, tmp_path, monkeypatch):
    from devkit.liger_cpu import liger_kernels_interpreted

    reason = liger_kernels_interpreted()
    if reason is not None:
        pytest.skip(f"Liger's kernels do not run on CPU here: {reason}")
    from leantune.trainers import gkd_trainer as module

    calls = []
    original = module.liger_jsd_sum
    monkeypatch.setattr(module, "liger_jsd_sum", lambda *a, **k: calls.append(1) or original(*a, **k))
    trainer = gkd_trainer(char_tokenizer, tmp_path, use_liger_loss=True, padding_free=True)
    assert trainer.logprob_path is LogProbPath.LIGER
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    for beta in (0.0, 0.5, 1.0):  # liger's jsd_beta passed as TRL's beta: equal at both ends and in between
        trainer.args.beta = beta
        fused = loss_and_grads(trainer, batch, LogProbPath.LIGER)
        assert calls and calls.clear() is None
        assert_same(fused, loss_and_grads(trainer, batch, LogProbPath.CHUNKED), beta)
        assert not calls


# --- on-policy and sequence-level KD steps ------------------------------------------------------------------------


def test_on_policy_and_seq_kd_steps_are_reproducible_counted_and_trained(char_tokenizer, tmp_path):
    trainer = gkd_trainer(char_tokenizer, tmp_path, lmbda=0.5, seq_kd=True, max_new_tokens=4, temperature=1.0,
                          padding_free=True, max_steps=6)
    sources = [trainer.completion_source(step) for step in range(200)]
    assert set(sources) == {"student", "teacher"}  # seq_kd: every step that is not on-policy is the teacher's
    assert 0.4 < sources.count("student") / 200 < 0.6
    again = gkd_trainer(char_tokenizer, tmp_path, lmbda=0.5, seq_kd=True, padding_free=True)
    assert [again.completion_source(step) for step in range(200)] == sources  # from the seed and the step only

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    eos = char_tokenizer.eos_token_id
    for source in ("student", "teacher"):
        generated = trainer.generated_batch(batch, source, 0)
        assert sequence_prompts(generated) == sequence_prompts(batch)  # the same prompts, new completions
        assert torch.equal(generated["input_ids"], trainer.generated_batch(batch, source, 0)["input_ids"])
        labels, ids = generated["labels"].reshape(-1), generated["input_ids"].reshape(-1)
        starts, ends = generated["cu_seq_lens_q"][:-1].tolist(), generated["cu_seq_lens_q"][1:].tolist()
        for start, end, prompt in zip(starts, ends, sequence_prompts(generated)):
            completion = ids[start + len(prompt):end]
            assert 1 <= len(completion) <= 4 and (labels[start + len(prompt):end] == completion).all()
            assert eos not in completion[:-1].tolist()  # cut after the first EOS, which stays a target

    # the step's item count is that of the generated completions, not of the dataset's
    trainer.state.global_step = sources.index("student")
    samples, count = trainer.get_batch_samples(iter([batch, batch]), 2, torch.device("cpu"))
    assert int(count) == sum(int(count_targets(b["labels"])) for b in samples) != 2 * int(count_targets(batch["labels"]))

    trainer.state.global_step = 0
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and all(math.isfinite(v) and v >= 0 for v in losses)
    assert trainer.on_policy_steps == sources[:6].count("student") + 1  # + the get_batch_samples call above


def test_on_policy_only_distillation_brings_the_student_closer(char_tokenizer, tmp_path):
    """lmbda=1, temperature 1 (the setting TRL steers to its DistillationTrainer): every step trains on the
    student's own samples, and the held-out divergence to the teacher falls."""
    trainer = gkd_trainer(char_tokenizer, tmp_path, lmbda=1.0, temperature=1.0, max_new_tokens=6, max_steps=24,
                          learning_rate=1e-2, beta=0.5)
    trainer.eval_dataset = trainer.train_dataset
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert trainer.on_policy_steps == 24
    assert after < 0.85 * before, (before, after)  # measured 0.581 -> 0.476


# --- the teacher ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not is_available("bitsandbytes"), reason="needs leantune[bitsandbytes]")
def test_a_4_bit_teacher_trains_the_student_and_both_paths_agree(char_tokenizer, tmp_path):
    path = tmp_path / "teacher"
    char_model(char_tokenizer, seed=0).save_pretrained(path)
    trainer = gkd_trainer(char_tokenizer, tmp_path / "out", teacher=str(path), teacher_model_init_kwargs={
        "quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}})
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear4bit) for m in trainer.teacher_model.modules())
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert_same(loss_and_grads(trainer, batch, LogProbPath.CHUNKED), loss_and_grads(trainer, batch, LogProbPath.FULL),
                "4-bit teacher")
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


def test_mistakes_are_named(char_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needs a teacher"):
        GKDTrainer(model=char_model(char_tokenizer, 1), args=GKDConfig(output_dir=str(tmp_path), use_cpu=True),
                   train_dataset=reversals(), processing_class=char_tokenizer)
    with pytest.raises(ValueError, match="teacher_model_init_kwargs"):
        gkd_trainer(char_tokenizer, tmp_path, teacher_model_init_kwargs={"dtype": "float32"})
    student = char_model(char_tokenizer, 1)
    with pytest.raises(ValueError, match="student `model` itself"):
        GKDTrainer(model=student, teacher_model=student, args=GKDConfig(output_dir=str(tmp_path), use_cpu=True),
                   train_dataset=reversals(), processing_class=char_tokenizer)
    from transformers import AutoModelForCausalLM

    other = build_default_model_config(char_tokenizer)
    other.vocab_size += 7
    with pytest.raises(ValueError, match="same vocabulary"):
        gkd_trainer(char_tokenizer, tmp_path, teacher=AutoModelForCausalLM.from_config(other))
    for field, value in (("beta", 1.5), ("lmbda", -0.1), ("temperature", 0.0), ("max_new_tokens", 0)):
        with pytest.raises(ValueError, match=f"`{field}`"):
            GKDConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})


# --- the command line ----------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_cli_distils_a_local_teacher_and_names_a_missing_one(tokenizer, gsm8k_rows, tmp_path, capsys):
    import json

    from leantune.cli.main import main

    from ..fixtures.models import tiny_model

    folders = {}
    for role, seed in (("student", 0), ("teacher", 1)):
        folders[role] = tmp_path / role
        tiny_model(seed=seed).save_pretrained(folders[role])
        tokenizer.save_pretrained(folders[role])
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": row["question"], "completion": " " + row["answer"]}) + "\n"
                                 for row in gsm8k_rows[:8]))
    common = ["--model_name_or_path", str(folders["student"]), "--dataset_name", str(data_file), "--max_steps", "2",
              "--per_device_train_batch_size", "4", "--max_length", "128", "--report_to", "none", "--use_cpu", "true", "--memory_breakdown", "false"]
    assert main(["gkd", *common, "--output_dir", str(tmp_path / "none")]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("leantune gkd: error:")]
    assert len(error) == 1 and "teacher" in error[0], error

    assert main(["gkd", *common, "--teacher_model_name_or_path", str(folders["teacher"]), "--lmbda", "0.5",
                 "--max_new_tokens", "4", "--output_dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "steps: 2" in out and "on-policy steps (the student's own samples):" in out
    assert (tmp_path / "out" / "model.safetensors").exists()
