"""Run by tests/launch/test_context_parallel.py, alone or under `accelerate launch` with
examples/accelerate/fsdp2_context_parallel.yaml (2 CPU processes, cp_size=2): two SGD steps of SFT, DPO, KTO, GRPO,
RLOO, Online DPO, reward or GKD per named case, through the public API. Per case it saves the trained weights
(FSDP2's full-state gather) to <out>/<case>/ and writes what every process saw to <out>/<case>/rank<k>.json. The
case `refusals` builds trainers that context parallelism cannot run exactly (and calls a GRPO trainer's evaluate())
and records each error. The cases `*_unsummed`, `*_masks_dropped` and `*_metrics_per_process` are the negative
controls (measured once, not run by the test; the last case of a launch, as they patch leantune):
padding-free DPO with each process's partial per-sequence sums taken as whole, padding-free GRPO (loss_type="grpo")
with each process's partial token counts taken as each completion's length, padding-free reward with the rewards
this process holds taken as all (0 for those on the other process); `grpo_padding_free_masks_dropped` generates with
accelerate's ring hooks on (the left-padded prompts' masks dropped); `grpo_bnpo_metrics_per_process` logs each
process's metrics over its own targets, not made whole over the group. Each run records its logged metrics per step.

usage: cp_run.py OUT ASSETS_DIR CASE [CASE ...]  (ASSETS_DIR holds model/, teacher/, sft.jsonl and pairs.jsonl)"""

from __future__ import annotations

import json
import os
import sys

import torch
from datasets import load_dataset

import leantune

out, assets, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
torch.set_num_threads(1)
model_dir = f"{assets}/model"
data = load_dataset("json", data_files=f"{assets}/sft.jsonl")["train"]


pairs = load_dataset("json", data_files=f"{assets}/pairs.jsonl")["train"] if os.path.exists(
    f"{assets}/pairs.jsonl") else None
prompts = data.select_columns(["prompt"])  # the SFT examples' prompts, for the online methods


def config(case, config_class=leantune.SFTConfig, **fields):
    # as tests/scripts/engine_run.py: SGD with momentum, no clipping (the update is linear in the step's gradient)
    settings = dict(output_dir=f"{out}/{case}", report_to=[], save_strategy="no", disable_tqdm=True,
                    per_device_train_batch_size=4, max_steps=2, logging_steps=1, learning_rate=1e-2, optim="sgd",
                    optim_args="momentum=0.9", max_grad_norm=0.0, seed=0, data_seed=0, memory_breakdown=False,
                    max_length=96)
    settings.update(fields)
    return config_class(**{name: value for name, value in settings.items() if value is not None})


CASES = {
    "sft": {},
    "sft_packed": dict(packing=True),
    "sft_padding_free": dict(padding_free=True),
    "sft_packed_padding_free": dict(packing=True, padding_free=True),
    # DPO (a frozen reference copy, sharded like the policy): 4 pairs = 8 sequences per step, prompts cut to 48
    # tokens so that completions (the targets) keep most of the 128
    "dpo": dict(config_class=leantune.DPOConfig, max_length=128, max_prompt_length=48),
    "dpo_padding_free": dict(config_class=leantune.DPOConfig, max_length=128, max_prompt_length=48,
                             padding_free=True),
}
# KTO: the pairs unpaired (8 examples, 4 per step), each with its mismatched completion for the KL reference point
CASES["kto"] = dict(CASES["dpo"], config_class=leantune.KTOConfig)
CASES["kto_padding_free"] = dict(CASES["dpo_padding_free"], config_class=leantune.KTOConfig)
# The online methods: each process of the group generates the round (same prompts, same seed) and scores its part of
# every sequence. 4 prompts' completions per step, 16 tokens at most, reference beta > 0. GRPO padded: one round of
# 2 micro-batches (steps_per_generation=2), so step 2 is off-policy (old log-probs, ratios != 1); padding-free: a round
# per step (generated after the update) with loss_type="grpo" (per-sequence means over whole token counts).
# the unshared layouts (torch's ring) unless a case asks for shared-prompt rows
ONLINE = dict(num_generations=2, max_completion_length=16, temperature=1.0, max_length=None, shared_prompt=False)
CASES["grpo"] = dict(ONLINE, config_class=leantune.GRPOConfig, beta=0.04, steps_per_generation=2)
CASES["grpo_padding_free"] = dict(ONLINE, config_class=leantune.GRPOConfig, beta=0.04, loss_type="grpo",
                                  padding_free=True)
# bnpo divides by the micro-batch's own token count (the whole batch's under context parallelism); lr 1 moves the
# policy enough for step 2 (off-policy) to log clip ratios and a KL well above the logged 6 decimals
CASES["grpo_bnpo"] = dict(CASES["grpo"], loss_type="bnpo", learning_rate=1.0)
for loss_type in ("sapo", "cispo", "luspo", "dr_grpo"):  # GRPO's other loss types, measured once (not run by the test)
    CASES[f"grpo_{loss_type}"] = dict(CASES["grpo_bnpo"], loss_type=loss_type)
# RLOO and Online DPO read whole-completion sums (made whole over the group, as DPO's), padding-free
CASES["rloo_padding_free"] = dict(ONLINE, config_class=leantune.RLOOConfig, beta=0.04, padding_free=True)
CASES["online_dpo_padding_free"] = dict(ONLINE, config_class=leantune.OnlineDPOConfig, max_completion_length=None,
                                        max_new_tokens=16, padding_free=True)
# Shared-prompt rows (each group's prompt scored once): all-gather attention instead of the ring's
CASES["grpo_shared"] = dict(CASES["grpo"], shared_prompt=True)
CASES["rloo_shared"] = dict(CASES["rloo_padding_free"], padding_free=False, shared_prompt=True)
CASES["online_dpo_shared"] = dict(CASES["online_dpo_padding_free"], padding_free=False, shared_prompt=True)


# Reward: each sequence's reward is read at its last token, which lands on either process; GKD: off-policy (the
# dataset's completions), the teacher (another tiny model, teacher/) scoring each process's part inside the ring
# (two random tiny models are both near uniform: their JSD is ~6e-3, so lr 1 for an update well above fp32 rounding)
CASES["reward"] = dict(config_class=leantune.RewardConfig, max_length=128)
CASES["reward_padding_free"] = dict(CASES["reward"], padding_free=True)
CASES["gkd_padding_free"] = dict(config_class=leantune.GKDConfig, lmbda=0.0, padding_free=True, learning_rate=1.0)
CASES["dpo_padding_free_unsummed"] = CASES["dpo_padding_free"]
CASES["grpo_padding_free_unsummed"] = CASES["grpo_padding_free"]
CASES["reward_padding_free_unsummed"] = CASES["reward_padding_free"]
CASES["grpo_padding_free_masks_dropped"] = CASES["grpo_padding_free"]
CASES["grpo_bnpo_metrics_per_process"] = CASES["grpo_bnpo"]
CASES["grpo_shared_prompt_padding_seen"] = CASES["grpo_shared"]


def length_reward(completions, **kwargs):
    return [float(len(c)) / 10 for c in completions]


def refusals() -> dict[str, str]:
    """Each trainer context parallelism cannot run exactly, and the first line of its error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def error(build):
        try:
            build()
        except ValueError as exc:
            return str(exc)
        return ""

    def sliding():
        small = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, sliding_window=16, attn_implementation="sdpa")
        return MistralForCausalLM(MistralConfig(**small))

    return {
        "sliding_window": error(lambda: leantune.SFTTrainer(sliding(), args=config("r1"), train_dataset=data,
                                                                      processing_class=tokenizer)),
        "eager": error(lambda: leantune.SFTTrainer(
            AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager"), args=config("r2"),
            train_dataset=data, processing_class=tokenizer)),
        "compute_loss_func": error(lambda: leantune.SFTTrainer(model_dir, args=config("r3"), train_dataset=data,
                                                               compute_loss_func=lambda *a, **k: 0)),
        "ppo": error(lambda: leantune.PPOTrainer(args=config("r4", config_class=leantune.PPOConfig, max_length=None),
                                                 model=model_dir, reward_funcs=length_reward, train_dataset=prompts)),
        "gkd_on_policy": error(lambda: leantune.GKDTrainer(
            model_dir, teacher_model=f"{assets}/teacher", train_dataset=data,
            args=config("r8", config_class=leantune.GKDConfig, lmbda=0.5))),
        "grpo_sequence_level": error(lambda: leantune.GRPOTrainer(
            model_dir, reward_funcs=length_reward, train_dataset=prompts,
            args=config("r7", **dict(CASES["grpo"], importance_sampling_level="sequence")))),
        "pad_to_multiple_of": error(lambda: config("r5", pad_to_multiple_of=6)),
        "online_evaluate": error(lambda: leantune.GRPOTrainer(
            model_dir, reward_funcs=length_reward, train_dataset=prompts,
            args=config("r9", **CASES["grpo"])).evaluate(prompts.select(range(2)))),
        "pad_to_multiple_of_default": str(config("r6").pad_to_multiple_of),
    }


state = None
for case in cases:
    if case == "refusals":
        record = refusals()
        from accelerate import PartialState

        state = PartialState()
        os.makedirs(f"{out}/{case}", exist_ok=True)
        with open(f"{out}/{case}/rank{state.process_index}.json", "w") as handle:
            json.dump(record, handle)
        continue
    args = config(case, **CASES[case])
    if case.endswith("_unsummed"):  # the negative controls: partial sums (and counts) read as whole sequences
        from leantune.trainers.parts.context_parallel import ContextParallelism

        ContextParallelism.total = lambda self, partial: partial
    if case.endswith("_per_process"):  # negative control: each process's metrics logged as they are, not made whole
        from leantune.trainers.parts.context_parallel import ContextParallelism

        ContextParallelism.whole_means = lambda self, metrics, count: metrics
    if case.endswith("_prompt_padding_seen"):  # negative control: branches also attend to their prompt's padding
        from leantune.trainers.parts import shared_prompt_ring

        real_lengths = shared_prompt_ring.ring_segments
        shared_prompt_ring.ring_segments = lambda lengths, padded, *rest, real=real_lengths: real(padded, padded, *rest)
    if case.endswith("_masks_dropped"):  # negative control: generation under the ring's hooks (prompt masks dropped)
        import contextlib

        from leantune.trainers.parts import context_parallel

        context_parallel.ring_hooks_suspended = lambda model: contextlib.nullcontext()
    if isinstance(args, (leantune.GRPOConfig, leantune.RLOOConfig, leantune.OnlineDPOConfig)):
        trainer_class = {leantune.GRPOConfig: leantune.GRPOTrainer, leantune.RLOOConfig: leantune.RLOOTrainer,
                         leantune.OnlineDPOConfig: leantune.OnlineDPOTrainer}[type(args)]
        trainer = trainer_class(model_dir, reward_funcs=length_reward, args=args, train_dataset=prompts)
    elif isinstance(args, leantune.RewardConfig):
        torch.manual_seed(args.seed)  # the new score head's initial weights, the same in every run
        trainer = leantune.RewardTrainer(model_dir, args=args, train_dataset=pairs)
    elif isinstance(args, leantune.GKDConfig):
        trainer = leantune.GKDTrainer(model_dir, teacher_model=f"{assets}/teacher", args=args, train_dataset=data)
    elif isinstance(args, leantune.KTOConfig):
        trainer = leantune.KTOTrainer(model_dir, args=args, train_dataset=pairs)
    elif isinstance(args, leantune.DPOConfig):
        trainer = leantune.DPOTrainer(model_dir, args=args, train_dataset=pairs)
    else:
        trainer = leantune.SFTTrainer(model_dir, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model()  # every process takes part: FSDP2 gathers the full weights for process 0 to write
    state = trainer.accelerator
    parallelism = state.parallelism_config
    record = {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "logs": [e for e in trainer.state.log_history if "loss" in e],  # every logged metric of each step
        "world": state.num_processes,
        "engine": str(state.distributed_type).split(".")[-1],
        "cp_size": parallelism.cp_size if parallelism is not None else 1,
        "pad_to_multiple_of": trainer.args.pad_to_multiple_of,
    }
    with open(f"{out}/{case}/rank{state.process_index}.json", "w") as handle:
        json.dump(record, handle)
    del trainer
if state is not None and hasattr(state, "end_training"):
    state.end_training()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
