"""Run by tests/launch/test_scale_out.py, alone or under `accelerate launch` (DDP, FSDP2, ZeRO-2/3 on CPU): a few SGD steps of
each named case, in one process group, through the public API. Per case it saves the trained weights (the engine's
full-state gather) to <out>/<case>/ and writes what every process saw to <out>/<case>/rank<k>.json.

usage: engine_run.py OUT ASSETS_DIR PER_DEVICE_BATCH_SIZE CASE [CASE ...]

ASSETS_DIR holds model/ (a tiny causal LM with its tokenizer), tied_model/ (the same with tied input and output
embeddings), reward_model/, sft.jsonl, pairs.jsonl and prompts.jsonl."""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
from datasets import load_dataset
from peft import LoraConfig

import leantune

out, assets, batch_size, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
torch.set_num_threads(1)
model_dir = f"{assets}/model"


def data(name):
    return load_dataset("json", data_files=f"{assets}/{name}.jsonl")["train"]


def common(case, **fields):
    # SGD with momentum, no clipping: the update is a linear function of the global batch's gradients, so one
    # process and N agree to fp32 rounding by construction (AdamW agrees as closely here, measured in
    # bench/scale_out_adamw.py, but an entry whose gradient cancels to rounding could flip its update's sign); the
    # momentum buffers are optimizer state that a resumed run must restore.
    settings = dict(output_dir=f"{out}/{case}", report_to=[], save_strategy="no", disable_tqdm=True,
                    per_device_train_batch_size=batch_size, max_steps=2, logging_steps=1, learning_rate=1e-2,
                    optim="sgd", optim_args="momentum=0.9", max_grad_norm=0.0, seed=0, memory_breakdown=False,
                    data_seed=0)
    settings.update(fields)
    return settings


def lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


seen_completions = []


def length_reward(completions, **kwargs):
    seen_completions.extend(completions)
    return [float(len(c)) / 10 for c in completions]


def recorded_generations(trainer) -> None:
    """GKD: each generated micro-batch's token ids go where the online cases' completions go."""
    original = trainer.generated_batch

    def generated_batch(*args, **kwargs):
        batch = original(*args, **kwargs)
        seen_completions.append(batch["input_ids"].tolist())
        return batch

    trainer.generated_batch = generated_batch


def gathered_fraction_during_generation(trainer) -> list[float]:
    """Under ZeRO-3, the largest share of the model's parameters materialised on this process while a generation
    round runs (checked as each module starts its forward, after DeepSpeed's own hook has gathered its weights)."""
    fractions, original = [], trainer.generation_round

    def measured_round(*args, **kwargs):
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        params = list(model.parameters())
        if not hasattr(params[0], "ds_status"):
            return original(*args, **kwargs)
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        total, peak = sum(p.ds_numel for p in params), [0]

        def count(module, inputs):
            peak[0] = max(peak[0], sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE))

        handles = [m.register_forward_pre_hook(count) for m in model.modules()]
        try:
            return original(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
            fractions.append(peak[0] / total)

    trainer.generation_round = measured_round
    return fractions


def sft(case, peft_config=None, model=None, **fields):
    args = leantune.SFTConfig(**common(case, max_length=64, **fields))
    return leantune.SFTTrainer(model or model_dir, args=args, train_dataset=data("sft"), peft_config=peft_config)


def dpo(case, **fields):
    args = leantune.DPOConfig(**common(case, max_length=96, **fields))
    return leantune.DPOTrainer(model_dir, args=args, train_dataset=data("pairs"))


def online(config_class, trainer_class, case, reward=length_reward, **fields):
    fields.setdefault("shared_prompt", False)  # the unshared layouts, unless a case asks for shared-prompt rows
    args = config_class(**common(case, num_generations=2, max_completion_length=8, temperature=1.0, **fields))
    return trainer_class(model_dir, reward, args=args, train_dataset=data("prompts"))


def sft_resumed(case):
    """Stopped after step 1 (its checkpoint as the engine saves it: ZeRO-3 partitions per process), then resumed."""
    from transformers import TrainerCallback

    class StopAfterFirstStep(TrainerCallback):  # an interrupted 2-step run: same schedule, stopped after step 1
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    interrupted = sft(case, save_strategy="steps", save_steps=1)
    interrupted.add_callback(StopAfterFirstStep())
    interrupted.train()
    trainer = sft(case)
    trainer.resume_from = f"{out}/{case}/checkpoint-1"
    return trainer


CASES = {
    "sft": lambda case: sft(case, memory_breakdown=True),  # its measured step 2 is checked against `plan_memory` (DDP, FSDP2, ZeRO-2/3)
    "sft_packed_padding_free": lambda case: sft(case, packing=True, padding_free=True),
    "sft_lora": lambda case: sft(case, peft_config=lora()),
    "sft_resumed": sft_resumed,
    "sft_tied": lambda case: sft(case, model=f"{assets}/tied_model"),  # lm_head is the input embedding
    "dpo": lambda case: dpo(case),
    "dpo_padding_free": lambda case: dpo(case, padding_free=True),
    "dpo_padding_free_precomputed": lambda case: dpo(case, padding_free=True, precompute_ref_log_probs=True),
    "kto": lambda case: leantune.KTOTrainer(model_dir, args=leantune.KTOConfig(**common(case, max_length=96)),
                                            train_dataset=data("pairs")),
    "reward": lambda case: leantune.RewardTrainer(model_dir, args=leantune.RewardConfig(**common(case, max_length=96)),
                                                  train_dataset=data("pairs")),
    "grpo": lambda case: online(leantune.GRPOConfig, leantune.GRPOTrainer, case, beta=0.04),
    # each group's prompt scored once (one row per group, segment attention): the "grpo" case's results
    "grpo_shared": lambda case: online(leantune.GRPOConfig, leantune.GRPOTrainer, case, beta=0.04, shared_prompt=True),
    "rloo": lambda case: online(leantune.RLOOConfig, leantune.RLOOTrainer, case),
    "grpo_reward_model": lambda case: online(leantune.GRPOConfig, leantune.GRPOTrainer, case, beta=0.04,
                                             reward=[f"{assets}/reward_model", length_reward]),
    "gkd": lambda case: leantune.GKDTrainer(model_dir, teacher_model=f"{assets}/tied_model", train_dataset=data("sft"),
                                            args=leantune.GKDConfig(**common(case, max_length=64, lmbda=0.0))),
    # GKD on-policy (lmbda=1): every step trains on the student's own samples, generated under the engine
    "gkd_on_policy": lambda case: leantune.GKDTrainer(
        model_dir, teacher_model=f"{assets}/tied_model", train_dataset=data("sft"),
        args=leantune.GKDConfig(**common(case, max_length=64, lmbda=1.0, max_new_tokens=8, temperature=1.0))),
    "grpo_sharded_generation": lambda case: online(leantune.GRPOConfig, leantune.GRPOTrainer, case, beta=0.04,
                                                   ds3_gather_for_generation=False),
    # PPO: the value head on the policy's body, rewards whitened over both processes, a reward model scored in chunks
    "ppo": lambda case: leantune.PPOTrainer(
        args=leantune.PPOConfig(**common(case, max_completion_length=8, temperature=1.0, num_ppo_epochs=2,
                                         whiten_rewards=True, kl_estimator="k3")),
        model=model_dir, reward_model=[f"{assets}/reward_model", length_reward], train_dataset=data("prompts")),
    "online_dpo": lambda case: leantune.OnlineDPOTrainer(  # TRL's order: ref_model second, so rewards by name
        model_dir, reward_funcs=length_reward, train_dataset=data("prompts"),
        args=leantune.OnlineDPOConfig(**common(case, max_new_tokens=8, temperature=1.0, missing_eos_penalty=0.1))),
}

for case in cases:
    # What is live leaves the cyclic collector's full scans: the imports, and what earlier cases imported. Each case's
    # train() runs one (accelerate's free_memory), ~0.3 s over the imports alone (tests/conftest.py freezes the
    # suite's own). The earlier case's accelerator (it holds that model) is dropped and a collection runs first, so
    # only what stays live is frozen.
    state = first = None
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    trainer = CASES[case](case)
    seen_completions.clear()
    if hasattr(trainer, "generated_batch"):
        recorded_generations(trainer)
    generation_fractions = gathered_fraction_during_generation(trainer) if hasattr(trainer, "generation_round") else []
    trainer.train(resume_from_checkpoint=getattr(trainer, "resume_from", None))
    trainer.save_model()  # every process takes part: FSDP and ZeRO-3 gather the full weights for process 0 to write
    state = trainer.accelerator
    first = trainer.accelerator.unwrap_model(trainer.model_wrapped).get_input_embeddings().weight
    if hasattr(first, "ds_tensor"):  # ZeRO-3: this process's partition of the flat parameter
        local_fraction = first.ds_tensor.numel() / first.ds_numel
    elif hasattr(first, "to_local"):  # FSDP2: a DTensor sharded on dim 0
        local_fraction = first.to_local().numel() / first.numel()
    else:
        local_fraction = 1.0
    record = {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "world": state.num_processes,
        "engine": str(state.distributed_type).split(".")[-1],
        "head": trainer.logprobs.head_kind.__name__,  # the output head's class the engine chose (output_head.py)
        "local_fraction": local_fraction,
        "completions": list(seen_completions),
        "gathered_during_generation": generation_fractions,
        "seconds": time.perf_counter() - started,  # built, trained and saved (what the case adds to the suite)
    }
    if trainer.memory_breakdown is not None:  # this process's measured step (memory_breakdown=True cases)
        record["memory"] = {"peak": trainer.memory_breakdown.peak_bytes, "parts": trainer.memory_breakdown.parts}
    if hasattr(trainer, "on_policy_steps"):  # GKD: steps trained on the student's own samples
        record["on_policy_steps"] = trainer.on_policy_steps
    if hasattr(trainer, "value_function"):  # PPO: each process's value function after training (DDP keeps one)
        record["value_function"] = [p.detach().double().sum().item() for p in trainer.value_function.parameters()]
    with open(f"{out}/{case}/rank{state.process_index}.json", "w") as handle:
        json.dump(record, handle)
    del trainer
state.end_training()  # leave the process group together (a rank exiting first can abort the other at exit)
# Everything is written. Leave without the interpreter's teardown: after several trainers in one process, a native
# thread's destructor at exit sometimes aborts a rank ("terminate called without an active exception", SIGABRT) once
# its work is done (seen with the online trainers; issue noted, not yet found).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
