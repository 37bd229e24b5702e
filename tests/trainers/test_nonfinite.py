"""NaN/inf in training (trainers/parts/step_guards.py): a non-finite loss stops the run naming the step, the train rows and
the last good checkpoint, or (nonfinite_policy="skip") the step is skipped, counted and logged as NaN; weights that
became non-finite are never saved as a checkpoint.

The NaN is real: a forward hook on the embedding turns the embeddings of one rare token into NaN, so exactly the
rows holding that token (known by their index) give a NaN loss, through the real model, loss and backward pass."""

from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import TrainerCallback

from leantune import SFTConfig, SFTTrainer
from leantune.trainers.parts.step_guards import NonFiniteStepError

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

ROWS = 16
POISONED = (5, 11)
MARK = "Xylophonequartz "


def poisoned_dataset(gsm8k_rows, tokenizer):
    """16 GSM8K rows; rows 5 and 11 end with a rare word. Returns (dataset, the token ids only those rows hold)."""
    dataset = gsm8k_prompt_completion(gsm8k_rows, ROWS)
    dataset = dataset.map(lambda row, i: {"prompt": (MARK if i in POISONED else "") + row["prompt"]},
                          with_indices=True)
    ids = [set(tokenizer(row["prompt"] + row["completion"])["input_ids"]) for row in dataset]
    others = set().union(*(ids[i] for i in range(ROWS) if i not in POISONED))
    poison = (ids[POISONED[0]] & ids[POISONED[1]]) - others
    assert poison, "the mark must tokenise to a token no other row holds"
    return dataset, sorted(poison)


def nan_on_tokens(model, poison: list[int]) -> None:
    """The embeddings of the poison tokens become NaN in every forward pass (the weights stay finite)."""
    poison = torch.tensor(poison)

    def hook(module, args, output):
        return output.masked_fill(torch.isin(args[0], poison)[..., None], float("nan"))

    model.get_input_embeddings().register_forward_hook(hook)


class Logs(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def make_trainer(gsm8k_rows, tokenizer, tmp_path, **overrides):
    dataset, poison = poisoned_dataset(gsm8k_rows, tokenizer)
    model = tiny_model()
    nan_on_tokens(model, poison)
    settings = dict(output_dir=str(tmp_path), max_length=128, report_to=[], save_strategy="no", use_cpu=True,
                    per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=ROWS // 2, seed=0, logging_steps=1,
                    learning_rate=1e-3, memory_breakdown=False)
    settings.update(overrides)
    return SFTTrainer(model=model, args=SFTConfig(**settings), train_dataset=dataset, processing_class=tokenizer)


def test_nan_loss_stops_with_step_rows_and_last_good_checkpoint(gsm8k_rows, tokenizer, tmp_path):
    trainer = make_trainer(gsm8k_rows, tokenizer, tmp_path, save_strategy="steps", save_steps=2)
    with pytest.raises(NonFiniteStepError) as raised:
        trainer.train()
    message = str(raised.value)
    step = trainer.state.global_step + 1  # the failed step never completed
    assert f"Optimizer step {step}: non-finite loss" in message
    named = message.split("rows whose micro-batch had it (indices of trainer.train_dataset): [")[1].split("]")[0]
    rows = {int(r) for r in named.split(", ")}
    assert rows and rows <= set(POISONED), message
    saved = sorted(int(name.split("-")[1]) for name in os.listdir(tmp_path) if name.startswith("checkpoint-"))
    assert all(s < step for s in saved)  # nothing saved at or after the failed step
    if saved:
        assert f"the last good checkpoint is {tmp_path}/checkpoint-{saved[-1]}" in message
    else:
        assert "no checkpoint was saved before it" in message
    assert saved == list(range(2, step, 2))


def test_nan_loss_skipped_counted_and_logged_as_nan(gsm8k_rows, tokenizer, tmp_path):
    trainer = make_trainer(gsm8k_rows, tokenizer, tmp_path, nonfinite_policy="skip")
    logs = Logs()
    trainer.add_callback(logs)
    metrics = trainer.train().metrics
    skipped = trainer.nonfinite.skipped
    assert {r for _, rows in skipped for r in rows} == set(POISONED)
    assert all(set(rows) <= set(POISONED) for _, rows in skipped)
    skipped_steps = [step for step, _ in skipped]
    assert metrics["nonfinite_skipped_steps"] == len(skipped_steps) >= 1
    assert trainer.state.global_step == ROWS // 2
    # the logged loss of a skipped step reads NaN, never a normal-looking value; the others are finite
    assert sorted(logs.losses) == list(range(1, ROWS // 2 + 1))
    for step, loss in logs.losses.items():
        assert math.isnan(loss) == (step in skipped_steps), (step, loss)
    # the optimizer stepped only on the finite steps: AdamW's per-parameter step count, and the weights are finite
    for parameter in trainer.model.parameters():
        assert int(trainer.optimizer.state[parameter]["step"]) == ROWS // 2 - len(skipped_steps)
        assert torch.isfinite(parameter).all()


class BreakWeights(TrainerCallback):
    """A weight becomes NaN after optimizer step 2 (what an overflowing update does)."""

    def __init__(self, model):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            with torch.no_grad():
                self.model.get_input_embeddings().weight[0, 0] = float("nan")


def test_nonfinite_weights_are_never_saved(gsm8k_rows, tokenizer, tmp_path):
    trainer = make_trainer(gsm8k_rows, tokenizer, tmp_path, save_strategy="steps", save_steps=1,
                           nonfinite_policy="skip")
    trainer.train_dataset = trainer.train_dataset.select([i for i in range(ROWS) if i not in POISONED])
    trainer.add_callback(BreakWeights(trainer.model))
    with pytest.raises(NonFiniteStepError, match=r"After optimizer step 2 the weights hold NaN or inf values; the "
                       r"checkpoint of this step was not saved .* the last good checkpoint is .*checkpoint-1 "):
        trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


def test_policy_is_checked(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="`nonfinite_policy` must be one of 'stop', 'skip', got 'ignore'"):
        SFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path), nonfinite_policy="ignore",
                                                      use_cpu=True, report_to=[]),
                   train_dataset=gsm8k_prompt_completion([{"question": "a", "answer": "b"}], 1),
                   processing_class=tokenizer)


def test_cli_reports_a_nan_in_one_line_with_exit_code_1(tokenizer, gsm8k_rows, tmp_path, capsys):
    """A learning rate of 1e38 moves each weight by ~1e38 (Adam's step is ~lr): the next forward pass overflows."""
    import json

    from leantune.cli.main import main

    model_dir, data = tmp_path / "tiny-llama", tmp_path / "train.jsonl"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data.write_text("".join(json.dumps({"prompt": r["question"], "completion": " " + r["answer"]}) + "\n"
                            for r in gsm8k_rows[:8]))
    code = main(["sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--max_length", "32",
                 "--per_device_train_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e38",
                 "--save_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--memory_breakdown", "false",
                 "--output_dir", str(tmp_path / "out")])
    assert code == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("leantune sft: training failed: ") and "Traceback" not in error
    assert "NaN or inf" in error and "checkpoint-1" not in os.listdir(tmp_path / "out"), error
