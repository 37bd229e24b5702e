"""Shared-prompt scoring (`shared_prompt=True`): each group's prompt runs once, and the per-token log-probs (policy,
old policy, reference), the loss and every gradient equal the unshared padding-free path's on real GSM8K prompts of
varied lengths; a wrong branch mask fails the same comparison; a model without segment attention is refused."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from leantune import GRPOConfig, GRPOTrainer, OnlineDPOConfig, OnlineDPOTrainer, RLOOConfig, RLOOTrainer
from leantune.models import segment_attention
from leantune.trainers.config_utils import checkpointing_setting, enable_model_checkpointing
from leantune.trainers.online.shared_prompt import batch_targets

from ..fixtures.data import count_a, gsm8k_rows
from ..fixtures.models import lora, tiny_model
from ..fixtures.online_rounds import assert_grads_close, grpo_config, loss_and_grads, one_round


def gsm8k_prompts(n: int = 3) -> Dataset:
    return Dataset.from_dict({"prompt": [row["question"] for row in gsm8k_rows(n)]})


def scored_round(tokenizer, shared: bool, cls=GRPOTrainer, config=GRPOConfig, peft_config=None,
                 checkpointing: bool = False, **overrides):
    """One round's first micro-batch (3 GSM8K prompts of 36, 42 and 65 tokens x 4 completions), scored with the old
    policy and the reference, then the policy moved by a seeded step so the loss's ratio, clipping and KL all act; its
    loss and gradients (`checkpointing`: gradient checkpointing on, as train() turns it on by default)."""
    settings = dict(beta=0.1, padding_free=True, shared_prompt=shared, per_device_train_batch_size=12,
                    num_iterations=2)
    settings.update(overrides)
    extra = {} if peft_config is None else {"peft_config": peft_config}
    trainer = cls(tiny_model("llama"), reward_funcs=count_a, args=grpo_config(config, **settings),
                  train_dataset=gsm8k_prompts(), processing_class=tokenizer, **extra)
    if checkpointing:
        enable_model_checkpointing(trainer.model, checkpointing_setting(trainer.args)[1])
    torch.manual_seed(5)
    batch = one_round(trainer)[0]
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=0.02)
    return trainer, batch, loss_and_grads(trainer, batch)


def assert_logps_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Per token, rel 1e-5, with 1e-5 of the largest |log-prob| as the floor: a log-prob is a logit minus the
    log-sum-exp over the vocabulary, whose fp32 rounding scales with the largest terms (|log p| ~ log 32000 ~ 10.4
    here; measured differences <= 2e-6, two ulps at that size), not with the log-prob itself."""
    assert got.shape == expected.shape and got.numel()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_shared_prompt_scores_equal_unshared_and_a_wrong_mask_does_not(tokenizer, monkeypatch):
    unshared_trainer, unshared, (unshared_loss, unshared_grads) = scored_round(tokenizer, shared=False)
    trainer, shared, (loss, grads) = scored_round(tokenizer, shared=True)
    # the same completions, each group's prompt once: 3 prompts + 12 completions, 96 targets in both layouts
    assert shared["shared_prompt_of"].tolist() == [-1, 0, 0, 0, 0, -1, 5, 5, 5, 5, -1, 10, 10, 10, 10]
    assert shared["target_tokens"].tolist() == unshared["labels"][unshared["labels"] != -100].tolist()
    assert shared["input_ids"].shape[1] < unshared["input_ids"].shape[1] // 2
    for name in ("old_logps", "ref_logps"):
        assert_logps_close(shared[name], unshared[name])
    # the loss: per-token terms of magnitude |advantage| ~ 1 and KL ~ 1e-3, averaged: rel 1e-5 with a floor at 1e-5 of
    # the mean |advantage| (its terms cancel between a group's positive and negative advantages)
    torch.testing.assert_close(loss, unshared_loss, rtol=1e-5, atol=1e-5 * float(shared["advantages"].abs().mean()))
    assert_grads_close(grads, unshared_grads)

    # Negative control: branches that miss the prompt's first key give other log-probs, and the comparison fails.
    def missing_first_prompt_key(prompt_length, branch_length, device):
        seen = torch.ones(branch_length, prompt_length + branch_length, dtype=torch.bool, device=device)
        seen[:, prompt_length:] = seen[:, prompt_length:].tril()
        seen[:, 0] = False
        return seen

    monkeypatch.setattr(segment_attention, "branch_mask", missing_first_prompt_key)
    model = trainer.model.eval()
    inputs = {k: v for k, v in shared.items() if k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                                       "max_length_q", "max_length_k", "shared_prompt_of")}
    with torch.no_grad():
        wrong = trainer.logprobs.target_logprobs(model, inputs, batch_targets(shared), trainer.args.temperature).logps
        expected = unshared_trainer.logprobs.target_logprobs(
            unshared_trainer.model.eval(), {k: v for k, v in unshared.items() if k in inputs},
            unshared["labels"], unshared_trainer.args.temperature).logps
    with pytest.raises(AssertionError):
        assert_logps_close(wrong, expected)


# RLOO: whole-sequence ratios and the KL in the reward (old and reference log-probs summed per completion), with LoRA
# (the reference: the adapter disabled) and the shared side under gradient checkpointing; Online DPO: pairs (2 per
# prompt) and their summed log-probs against the reference, scored at temperature 1, from full logits.
@pytest.mark.parametrize("cls, config, overrides", [
    (RLOOTrainer, RLOOConfig, {"peft_config": "lora"}),
    (OnlineDPOTrainer, OnlineDPOConfig, {"num_generations": 2, "per_device_train_batch_size": 3, "num_iterations": 1,
                                         "chunked_loss": False}),
], ids=["rloo-lora-checkpointing", "online_dpo-full_logits"])
def test_rloo_and_online_dpo_score_shared_prompts_exactly(tokenizer, cls, config, overrides):
    if overrides.get("peft_config") == "lora":
        overrides = {**overrides, "peft_config": lora(True)}
    _, unshared, (unshared_loss, unshared_grads) = scored_round(tokenizer, False, cls, config, **overrides)
    _, shared, (loss, grads) = scored_round(tokenizer, True, cls, config, checkpointing=cls is RLOOTrainer,
                                            **overrides)
    assert shared["input_ids"].shape[1] < unshared["input_ids"].shape[1]
    for name in ("old_logps", "ref_logps"):
        if name in unshared:
            assert_logps_close(shared[name], unshared[name])
    # losses of O(0.1-1) here: rel 1e-5, with a 1e-6 floor for a loss whose terms cancel (RLOO's advantages sum to 0)
    torch.testing.assert_close(loss, unshared_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, unshared_grads)


def test_shared_prompt_needs_segment_attention(tokenizer):
    with pytest.raises(ValueError, match="shared_prompt=True.*attn_implementation='sdpa'.*'eager'"):
        GRPOTrainer(tiny_model("llama", attn_implementation="eager"), count_a,
                    args=grpo_config(shared_prompt=True), train_dataset=gsm8k_prompts(), processing_class=tokenizer)


def test_shared_prompt_is_refused_where_there_are_no_groups():
    from leantune import PPOConfig

    with pytest.raises(ValueError, match="shared_prompt=True.*groups"):
        PPOConfig(output_dir="/tmp/x", use_cpu=True, shared_prompt=True)
