"""A LoRA adapter trains under activation checkpointing, reentrant or not (one name for checkpointing).

The base's embeddings are frozen, so with reentrant checkpointing (torch.utils.checkpoint's `use_reentrant=True`) no
input of a checkpointed block requires grad and its adapters would get none, unless PEFT's input-grad hook
(`enable_input_require_grads`, models/loading.apply_peft) is on. apply_peft reads the trainer's resolved
checkpointing (trainers/settings.py), not either config name, so it holds whichever name transformers keeps.
transformers 5.24's `train()` turns the hook on too when it enables checkpointing; leantune's must not depend on
that, so the hook is checked right after construction, before `train()`.

Tolerance: both modes run the same fp32 forward and backward on the same batch; checkpointing only recomputes the
forward inside backward, in the same order, so the adapters' gradients agree to a few ulps (rtol 1e-5, as the
layout tests); a missing hook leaves them None or zero, far outside it.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from leantune import SFTConfig, SFTTrainer

from ..fixtures.comparisons import rel_diff
from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import lora, tiny_model

RTOL = 1e-5


class AdapterGradients(TrainerCallback):
    """The LoRA weights' gradients just before the optimizer step."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor | None] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {name: None if p.grad is None else p.grad.detach().clone()
                      for name, p in model.named_parameters() if "lora_" in name}


def lora_step(tokenizer, dataset, folder, reentrant: bool):
    """(adapter gradients, adapter weights before, after) of one real SGD step of an SFT LoRA run."""
    config = SFTConfig(output_dir=str(folder), max_length=64, report_to=[], save_strategy="no", use_cpu=True,
                       per_device_train_batch_size=4, max_steps=1, max_grad_norm=0.0, seed=0, learning_rate=1e-2,
                       optim="sgd", gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    recorder = AdapterGradients()
    trainer = SFTTrainer(model=tiny_model(), args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora(init_random=True), callbacks=[recorder])
    embeddings = trainer.model.get_input_embeddings()
    assert embeddings(torch.tensor([[1, 2]])).requires_grad  # PEFT's input-grad hook, before transformers' train()
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_" in name}
    trainer.train()
    # on by default, under the name this transformers reads (`is_gradient_checkpointing` before the rename)
    assert getattr(trainer.model, "is_activation_checkpointing", None) or trainer.model.is_gradient_checkpointing
    after = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_" in name}
    return recorder.grads, before, after


def test_lora_trains_under_reentrant_and_non_reentrant_checkpointing(tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 4)
    runs = {reentrant: lora_step(tokenizer, dataset, tmp_path / str(reentrant), reentrant) for reentrant in (True, False)}
    for reentrant, (grads, before, after) in runs.items():
        assert len(grads) == 8  # A and B of q_proj and v_proj in 2 layers
        for name, grad in grads.items():
            assert grad is not None and grad.abs().max() > 0, f"{name}: no gradient (reentrant={reentrant})"
            assert not torch.equal(before[name], after[name]), f"{name} did not change (reentrant={reentrant})"
    for name, grad in runs[True][0].items():
        assert rel_diff(grad, runs[False][0][name]) <= RTOL, name
