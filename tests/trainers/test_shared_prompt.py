"""Shared-prompt scoring (`shared_prompt=True`): each group's prompt runs once, and the per-token log-probs (policy,
old policy, reference), the per-token loss and every gradient equal the unshared path's on real GSM8K prompts of
varied lengths, composed with what a run may turn on (Liger's fused loss, LoRA, gradient checkpointing, padded and
padding-free unshared layouts, beta > 0, multi-turn tool-use conversations); a wrong branch mask fails the same
comparison; a model without segment attention is refused."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset

from devkit.liger_cpu import FusedKernelCalls, liger_kernels_interpreted
from leantune import GRPOConfig, GRPOTrainer, OnlineDPOConfig, OnlineDPOTrainer, RLOOConfig, RLOOTrainer
from leantune.data.collators import PREFIX_BLOCKS
from leantune.models.checkpointing import checkpointing_setting, enable_model_checkpointing
from leantune.trainers import grpo_trainer
from leantune.trainers.online.round_builder import shared_row_targets

from ..fixtures.data import count_a, gsm8k_rows
from ..fixtures.models import lora, tiny_model
from ..fixtures.online_rounds import assert_grads_close, grpo_config, loss_and_grads, one_round
from ..fixtures.paths import TOKENIZER_DIR
from ..fixtures.tokenizers import load_tokenizer
from ..fixtures.tool_calls import Script, call, multiply, tiny_policy, tool_calling


def gsm8k_prompts(n: int = 3) -> Dataset:
    return Dataset.from_dict({"prompt": [row["question"] for row in gsm8k_rows(n)]})


def scored_round(tokenizer, shared: bool, cls=GRPOTrainer, config=GRPOConfig, peft_config=None,
                 checkpointing: bool = False, model=None, dataset=None, reward=count_a, script=None, tools=None,
                 **overrides):
    """One round's first micro-batch (3 GSM8K prompts of 36, 42 and 65 tokens x 4 completions, unless `dataset`),
    scored with the old policy and the reference, then the policy moved by a seeded step so the loss's ratio,
    clipping and KL all act; the trainer's loss and gradients on it (`checkpointing`: gradient checkpointing on, as
    train() turns it on by default), with the per-token log-probs of its training forward (`logps`) and, for GRPO,
    its per-token loss (`token_loss`), recorded as they pass. `script`: the policy's scripted turns (tool calls)."""
    settings = dict(beta=0.1, padding_free=True, shared_prompt=shared, per_device_train_batch_size=12,
                    num_iterations=2)
    settings.update(overrides)
    extra = {} if peft_config is None else {"peft_config": peft_config}
    if tools is not None:
        extra["tools"] = tools
    trainer = cls(tiny_model("llama") if model is None else model, reward_funcs=reward,
                  args=grpo_config(config, **settings), train_dataset=gsm8k_prompts() if dataset is None else dataset,
                  processing_class=tokenizer, **extra)
    if checkpointing:
        enable_model_checkpointing(trainer.model, checkpointing_setting(trainer.args)[1])
    if script is not None:
        trainer.model.generate = script
    torch.manual_seed(5)
    batch = one_round(trainer)[0]
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=0.02)
    recorded = {}
    policy_loss = trainer.policy_loss

    def recording_policy_loss(scores, sequence, batch):
        recorded["logps"] = scores.logps.detach().clone()
        return policy_loss(scores, sequence, batch)

    def recording_token_loss(*args, **kwargs):
        token_loss, metrics = token_loss_of(*args, **kwargs)
        recorded["token_loss"] = token_loss.detach().clone()
        return token_loss, metrics

    token_loss_of = grpo_trainer.grpo_token_loss
    trainer.policy_loss = recording_policy_loss
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_trainer, "grpo_token_loss", recording_token_loss)
        loss, grads = loss_and_grads(trainer, batch)
    return trainer, batch, (loss, grads), recorded


def assert_logps_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Per token, rel 1e-5, with 1e-5 of the largest |log-prob| as the floor: a log-prob is a logit minus the
    log-sum-exp over the vocabulary, whose fp32 rounding scales with the largest terms (|log p| ~ log 32000 ~ 10.4
    here; measured differences <= 2e-6, two ulps at that size), not with the log-prob itself."""
    assert got.shape == expected.shape and got.numel()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def assert_scored_alike(shared_side, unshared_side, loss_atol: float) -> None:
    """Per token: old-policy, reference and training log-probs, and GRPO's per-token loss; the micro-batch's loss
    (rel 1e-5, `loss_atol` for a loss whose terms cancel); every parameter's gradient (assert_grads_close)."""
    _, shared, (loss, grads), scores = shared_side
    _, unshared, (unshared_loss, unshared_grads), unshared_scores = unshared_side
    assert shared["input_ids"].numel() < unshared["input_ids"].numel()  # positions scored (padded: rows x width)
    for name in ("old_logps", "ref_logps"):
        assert (name in shared) == (name in unshared)
        if name in unshared:
            assert_logps_close(shared[name], unshared[name])
    assert_logps_close(scores["logps"], unshared_scores["logps"])
    if "token_loss" in unshared_scores:
        # a token's loss is -ratio x advantage (clipped) + beta x k3 KL: its rounding is the log-probs' absolute
        # rounding times |advantage|, whatever the term's own size (near 0 where the advantage is), so rel 1e-5 with
        # 1e-5 of the largest |term| as the floor
        expected = unshared_scores["token_loss"]
        torch.testing.assert_close(scores["token_loss"], expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(loss, unshared_loss, rtol=1e-5, atol=loss_atol)
    if "advantages" not in unshared:
        assert_grads_close(grads, unshared_grads)
        return
    # A gradient here is a sum over ~100 targets of |advantage| x a log-prob's gradient with signs that cancel (a
    # group's advantages sum to 0), so its fp32 rounding (a log-softmax over 32k logits of |x| ~ 10, summed in another
    # order by each layout) scales with the sum that does not cancel: the same loss's gradient with |advantages|.
    # Measured: differences <= 8.3e-6 of that sum's largest entry per tensor; 5e-5 leaves a 6x margin across
    # machines, while a wrong mask moves gradients by O(1) of it.
    trainer = unshared_side[0]
    _, scale = loss_and_grads(trainer, {**unshared, "advantages": unshared["advantages"].abs()})
    assert grads.keys() == unshared_grads.keys() == scale.keys() and grads
    for name, reference in unshared_grads.items():
        torch.testing.assert_close(grads[name], reference, rtol=1e-5, atol=5e-5 * float(scale[name].abs().max()))


def test_shared_prompt_scores_equal_unshared_and_a_wrong_mask_does_not(tokenizer):
    unshared_side = unshared_trainer, unshared, _, _ = scored_round(tokenizer, shared=False)
    shared_side = trainer, shared, _, _ = scored_round(tokenizer, shared=True)
    # the same completions, each group's prompt once: 3 prompts + 12 completions, 96 targets in both layouts
    assert shared["shared_prompt_of"].tolist() == [-1, 0, 0, 0, 0, -1, 5, 5, 5, 5, -1, 10, 10, 10, 10]
    assert shared["target_tokens"].tolist() == unshared["labels"][unshared["labels"] != -100].tolist()
    assert shared["input_ids"].shape[1] < unshared["input_ids"].shape[1] // 2
    # the loss: per-token terms of magnitude |advantage| ~ 1 and KL ~ 1e-3, averaged: rel 1e-5 with a floor at 1e-5 of
    # the mean |advantage| (its terms cancel between a group's positive and negative advantages)
    assert_scored_alike(shared_side, unshared_side, loss_atol=1e-5 * float(shared["advantages"].abs().mean()))

    # Negative control: completions that miss the prompt's first key give other log-probs, and the comparison fails.
    model = trainer.model.eval()
    inputs = {k: v for k, v in shared.items() if k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                                       "max_length_q", "max_length_k", "shared_prompt_of")}
    mask = shared[PREFIX_BLOCKS]["mask"].clone()
    mask[mask[:, 0, 0, 0], :, :, 0] = False  # key 0 is a prefix key: seen by a block with a prefix
    inputs[PREFIX_BLOCKS] = {**shared[PREFIX_BLOCKS], "mask": mask}
    with torch.no_grad():
        wrong = trainer.logprobs.target_logprobs(model, inputs, shared_row_targets(shared), trainer.args.temperature).logps
        expected = unshared_trainer.logprobs.target_logprobs(
            unshared_trainer.model.eval(), {k: v for k, v in unshared.items() if k in inputs},
            unshared["labels"], unshared_trainer.args.temperature).logps
    with pytest.raises(AssertionError):
        assert_logps_close(wrong, expected)


# RLOO: whole-sequence ratios and the KL in the reward (old and reference log-probs summed per completion), with LoRA
# (the reference: the adapter disabled) and the shared side under gradient checkpointing; Online DPO: pairs (2 per
# prompt) and their summed log-probs against the reference, scored at temperature 1, from full logits; GRPO with
# LoRA and gradient checkpointing on both sides against the padded unshared layout (the others: padding-free).
@pytest.mark.parametrize("cls, config, overrides", [
    (RLOOTrainer, RLOOConfig, {"peft_config": "lora"}),
    (OnlineDPOTrainer, OnlineDPOConfig, {"num_generations": 2, "per_device_train_batch_size": 3, "num_iterations": 1,
                                         "chunked_loss": False}),
    (GRPOTrainer, GRPOConfig, {"peft_config": "lora", "padding_free": False, "checkpointing": True}),
], ids=["rloo-lora-checkpointing", "online_dpo-full_logits", "grpo-lora-checkpointing-padded"])
def test_rloo_online_dpo_and_grpo_with_lora_score_shared_prompts_exactly(tokenizer, cls, config, overrides):
    if overrides.get("peft_config") == "lora":
        overrides = {**overrides, "peft_config": lora(True)}
    unshared_side = scored_round(tokenizer, False, cls, config, **overrides)
    shared_side = scored_round(tokenizer, True, cls, config, **{"checkpointing": cls is RLOOTrainer, **overrides})
    # losses of O(0.1-1) here: rel 1e-5, with a 1e-6 floor for a loss whose terms cancel (advantages sum to 0)
    assert_scored_alike(shared_side, unshared_side, loss_atol=1e-6)


def tool_use_conversations(n: int = 2) -> Dataset:
    """Multi-turn prompts around GSM8K questions (varied lengths): a system turn, an earlier exchange, the question."""
    return Dataset.from_dict({"prompt": [[
        {"role": "system", "content": "You solve grade-school maths; call a tool to multiply."},
        {"role": "user", "content": "Hello, can you help with some homework?"},
        {"role": "assistant", "content": "Of course. What is the problem?"},
        {"role": "user", "content": row["question"]},
    ] for row in gsm8k_rows(n)]})


def test_shared_prompt_scores_tool_use_turns_exactly():
    """GRPO's multi-turn rollouts (a tool called, its result in the sequence but not a target, the policy's next
    turn a target), each group's conversation shared, under gradient checkpointing."""
    if not TOKENIZER_DIR.exists():
        pytest.skip(f"shared tokenizer not found at {TOKENIZER_DIR}")
    tokenizer = tool_calling(load_tokenizer(TOKENIZER_DIR))
    first = [call("multiply", a=3, b=4), "The answer is 7.", call("multiply", a=2, c=1),
             call("multiply", a=5, b=5), "No tool needed.", call("multiply", a=6, b=7)]

    def side(shared: bool):
        script = Script(tokenizer, first, ["It is 12.", "Sorry, I cannot.", "So 25 in all.", "42 then."])
        return scored_round(tokenizer, shared, model=tiny_policy(tokenizer), dataset=tool_use_conversations(),
                            reward=lambda completions, **kwargs: [float(len(c)) for c in completions],
                            script=script, tools=[multiply], per_device_train_batch_size=6, num_generations=3,
                            max_completion_length=64, checkpointing=True)

    unshared_side, shared_side = side(False), side(True)
    shared, unshared = shared_side[1], unshared_side[1]
    assert shared["shared_prompt_of"].tolist() == [-1, 0, 0, 0, -1, 4, 4, 4]
    # the targets are the policy's turns only (tool results are in the row, not targets), as in the unshared layout
    assert shared["target_tokens"].tolist() == unshared["labels"][unshared["labels"] != -100].tolist()
    assert "<|im_start|>tool\n12<|im_end|>" in tokenizer.decode(shared["input_ids"][0])  # a tool's result, shared
    assert_scored_alike(shared_side, unshared_side, loss_atol=1e-5 * float(shared["advantages"].abs().mean()))


@pytest.mark.liger_interpreter
def test_shared_prompt_scores_exactly_through_liger(tokenizer, monkeypatch):
    """`use_liger_loss=True`: every forward (old policy, reference, the loss's) is scored by Liger's fused linear
    cross-entropy on CPU under Triton's interpreter, taking the shared layout's flat targets as they are."""
    reason = liger_kernels_interpreted()
    if reason is not None:
        pytest.skip(f"Liger's kernels do not run on CPU here: {reason}")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    calls = FusedKernelCalls(monkeypatch)
    # 2 prompts x 4 completions of 4 tokens, no old-policy pass (num_iterations=1): the interpreter runs Liger's
    # kernels program by program (this test: 2.1 s alone, 6 s on loaded cores; 18 s at 3 prompts x 8 tokens with
    # the old-policy pass)
    small = dict(use_liger_loss=True, per_device_train_batch_size=8, max_completion_length=4, num_iterations=1)
    unshared_side = scored_round(tokenizer, False, **small)
    assert calls.take() > 0
    shared_side = scored_round(tokenizer, True, **small)
    assert calls.take() > 0  # Liger's kernel ran, not the chunked head
    assert_scored_alike(shared_side, unshared_side, loss_atol=1e-5 * float(shared_side[1]["advantages"].abs().mean()))


def test_shared_prompt_needs_segment_attention(tokenizer):
    with pytest.raises(ValueError, match="shared_prompt=True.*attn_implementation='sdpa'.*'eager'"):
        GRPOTrainer(tiny_model("llama", attn_implementation="eager"), count_a,
                    args=grpo_config(shared_prompt=True), train_dataset=gsm8k_prompts(), processing_class=tokenizer)


def test_shared_prompt_is_refused_where_there_are_no_groups():
    from leantune import PPOConfig

    with pytest.raises(ValueError, match="shared_prompt=True.*groups"):
        PPOConfig(output_dir="/tmp/x", use_cpu=True, shared_prompt=True)


@pytest.mark.parametrize("config, fields, expected, logged", [
    (GRPOConfig, {}, True, None),
    (RLOOConfig, {}, True, None),
    (OnlineDPOConfig, {"num_generations": 2}, True, None),
    (GRPOConfig, {"use_vllm": True}, True, None),  # generation's backend does not matter: scoring is the trainer's
    (GRPOConfig, {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4}, False, "one completion"),
    (OnlineDPOConfig, {"num_generations": 2, "per_device_train_batch_size": 1}, True, None),  # a prompt's pair
    (GRPOConfig, {"shared_prompt": False}, False, None),
    (GRPOConfig, {"shared_prompt": True, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 4}, True,
     None),
    ("PPOConfig", {}, False, "one completion per prompt"),
], ids=["grpo", "rloo", "online_dpo", "grpo-vllm", "one-per-micro-batch", "online_dpo-one-pair", "explicit-off",
        "explicit-on", "ppo"])
def test_shared_prompt_default_resolves_once_with_the_config(config, fields, expected, logged, caplog):
    """On by default where a micro-batch holds completions of one prompt; off with one log line where it holds
    nothing to share; an explicit value is kept."""
    if config == "PPOConfig":
        from leantune import PPOConfig as config
    settings = dict(output_dir="/tmp/leantune-test-shared", use_cpu=True, report_to=[], num_generations=4,
                    per_device_train_batch_size=4)
    settings.update(fields)
    if config.__name__ == "PPOConfig":
        settings.pop("num_generations")
    with caplog.at_level("INFO", logger="leantune.trainer"):
        args = config(**settings)
    assert args.shared_prompt is expected
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shared_prompt: off")]
    assert len(notes) == (logged is not None) and (logged is None or logged in notes[0])


def test_the_default_turns_off_for_a_model_without_segment_attention(tokenizer, caplog):
    """Left at its default, a model loaded with eager attention runs unshared, said in one line (an explicit True is
    refused: test_shared_prompt_needs_segment_attention)."""
    with caplog.at_level("INFO", logger="leantune.trainer"):
        trainer = GRPOTrainer(tiny_model("llama", attn_implementation="eager"), count_a, args=grpo_config(),
                              train_dataset=gsm8k_prompts(), processing_class=tokenizer)
    assert trainer.args.shared_prompt is False
    assert [r.getMessage() for r in caplog.records if "shared_prompt: off" in r.getMessage()] == [
        "shared_prompt: off for this run (the model's attention is 'eager'; shared rows need 'sdpa')."]
    batch = one_round(trainer)[0]
    assert "shared_prompt_of" not in batch
