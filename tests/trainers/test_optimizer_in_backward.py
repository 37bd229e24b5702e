"""The optimizer step inside the backward (trainers/parts/optimizer_in_backward.py): with clipping off it gives the
ordinary step's parameters per element (with gradient accumulation, weight decay groups and a warm-up schedule),
logs the same grad_norm, holds no gradient once the backward is over, resumes from a checkpoint as an uninterrupted
run, composes with bitsandbytes' 8-bit AdamW, and refuses what it cannot do when the config is built.

Tolerances: the two runs do the same float operations on each parameter in the same order (one parameter's AdamW
update is the same whether its optimizer holds one parameter or all of them), so the parameters agree to rounding:
a few fp32 ulps of each element's magnitude (|p| * 4 * 2^-23, plus an absolute floor for elements near zero),
while a missed, repeated or early step moves an element by ~lr = 1e-3, five orders of magnitude more.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from leantune import SFTConfig, SFTTrainer

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

FP32_ULP = 2.0 ** -23


def make_trainer(out, tokenizer, rows, in_backward: bool, **overrides):
    settings = dict(output_dir=str(out), max_length=128, report_to=[], use_cpu=True, per_device_train_batch_size=2,
                    max_steps=3, logging_steps=1, learning_rate=1e-3, seed=0, disable_tqdm=True, save_strategy="no",
                    memory_breakdown=False, max_grad_norm=0.0, weight_decay=0.1, warmup_steps=1,
                    lr_scheduler_type="linear", optimizer_in_backward=in_backward)
    settings.update(overrides)
    return SFTTrainer(model=tiny_model(), args=SFTConfig(**settings), processing_class=tokenizer,
                      train_dataset=gsm8k_prompt_completion(rows, 8))


def assert_same_parameters(first: torch.nn.Module, second: torch.nn.Module, ulps: float = 4.0) -> None:
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        tolerance = a.detach().abs() * ulps * FP32_ULP + 1e-9
        assert ((a.detach() - b.detach()).abs() <= tolerance).all(), name


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


class GradientsAtStep(TrainerCallback):
    """How many parameters still hold a gradient when the optimizer step begins."""

    def __init__(self):
        self.held = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.held.append(sum(p.grad is not None for p in model.parameters()))


@pytest.mark.quick
def test_steps_inside_the_backward_equal_the_ordinary_adamw_steps(tokenizer, gsm8k_rows, tmp_path):
    ordinary = make_trainer(tmp_path / "ordinary", tokenizer, gsm8k_rows, False)
    ordinary.train()
    inside = make_trainer(tmp_path / "inside", tokenizer, gsm8k_rows, True)
    held = GradientsAtStep()
    inside.add_callback(held)
    inside.train()
    assert held.held == [0, 0, 0]  # every gradient freed in the backward, none left for the step
    assert_same_parameters(ordinary.model, inside.model)
    assert logged(inside, "loss") == pytest.approx(logged(ordinary, "loss"), rel=1e-6)
    assert logged(inside, "learning_rate") == logged(ordinary, "learning_rate")  # the scheduler stepped
    # the logged norm: the step's whole gradient, summed over parameters in another order (fp32 sums, ~1e-6)
    assert logged(inside, "grad_norm") == pytest.approx(logged(ordinary, "grad_norm"), rel=1e-5)


def test_with_gradient_accumulation_the_last_micro_batch_steps(tokenizer, gsm8k_rows, tmp_path):
    settings = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2)
    ordinary = make_trainer(tmp_path / "ordinary", tokenizer, gsm8k_rows, False, **settings)
    ordinary.train()
    inside = make_trainer(tmp_path / "inside", tokenizer, gsm8k_rows, True, **settings)
    inside.train()
    assert_same_parameters(ordinary.model, inside.model)
    assert logged(inside, "loss") == pytest.approx(logged(ordinary, "loss"), rel=1e-6)


def test_resume_gives_the_uninterrupted_run(tokenizer, gsm8k_rows, tmp_path):
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2)
    whole = make_trainer(tmp_path / "whole", tokenizer, gsm8k_rows, True, **settings)
    whole.train()
    resumed = make_trainer(tmp_path / "whole", tokenizer, gsm8k_rows, True, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert_same_parameters(whole.model, resumed.model)
    inner = resumed.optimizer.optimizer.per_parameter.values()  # the scheduler still reaches the loaded optimizers
    assert {group["lr"] for optimizer in inner for group in optimizer.param_groups} == {
        resumed.lr_scheduler.get_last_lr()[0]}
    assert logged(resumed, "loss")[-2:] == pytest.approx(logged(whole, "loss")[-2:], rel=1e-6)


def test_bitsandbytes_8bit_adamw_steps_inside_the_backward_as_it_steps_outside(tokenizer, gsm8k_rows, tmp_path):
    pytest.importorskip("bitsandbytes")
    ordinary = make_trainer(tmp_path / "ordinary", tokenizer, gsm8k_rows, False, optim="adamw_bnb_8bit")
    ordinary.train()
    inside = make_trainer(tmp_path / "inside", tokenizer, gsm8k_rows, True, optim="adamw_bnb_8bit")
    inside.train()
    states = inside.optimizer.optimizer.per_parameter
    mlp = inside.model.get_submodule("model.layers.0.mlp.up_proj").weight  # 8,192 values: above bnb's 4,096 minimum
    assert states[mlp].state[mlp]["state1"].dtype == torch.uint8  # 8-bit moments, one optimizer per parameter
    embedding = inside.model.get_input_embeddings().weight  # Trainer keeps embeddings' states in 32 bits
    assert states[embedding].state[embedding]["state1"].dtype == torch.float32
    assert_same_parameters(ordinary.model, inside.model)


@pytest.mark.parametrize("settings, named", [
    (dict(max_grad_norm=1.0), "max_grad_norm"),
    (dict(fp16=True), "fp16"),
    (dict(nonfinite_policy="skip"), "nonfinite_policy"),
    (dict(optim="adalomo"), "optim"),
])
def test_what_cannot_work_is_refused_when_the_config_is_built(settings, named, tmp_path):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_grad_norm=0.0)
    with pytest.raises(ValueError, match=rf"optimizer_in_backward=True.*{named}|{named}.*optimizer_in_backward"):
        SFTConfig(**{**base, **settings}, optimizer_in_backward=True)
    SFTConfig(**{**base, **settings}, optimizer_in_backward=False)  # refused for the combination alone


def test_deepspeed_is_refused_when_the_config_is_built(tmp_path):
    from leantune.trainers.memory_options import validate_optimizer_in_backward

    config = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_grad_norm=0.0)
    config.deepspeed = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match="optimizer_in_backward=True.*deepspeed"):
        validate_optimizer_in_backward(config)


def test_the_memory_breakdown_counts_the_per_parameter_states_from_the_steps_start(tokenizer, gsm8k_rows, tmp_path):
    # batch 2 x <=128 tokens: the step peaks in the forward (the loss's chunk of logits), before any gradient, with
    # the states already held: the same bytes with or without the step in the backward, to the byte (one trace each)
    peaks = {}
    for in_backward in (False, True):
        trainer = make_trainer(tmp_path / str(in_backward), tokenizer, gsm8k_rows, in_backward, max_steps=2,
                               memory_breakdown=True)
        trainer.train()
        peaks[in_backward] = trainer.memory_breakdown.peak_bytes
        moments = 2 * 4 * sum(p.numel() for p in trainer.model.parameters())  # AdamW's two fp32 moments
        assert trainer.memory_breakdown.parts["optimizer_states"] >= moments
    assert peaks[True] == peaks[False]
