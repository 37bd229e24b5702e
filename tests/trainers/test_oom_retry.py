"""An out-of-memory error at runtime, retried at the step boundary (trainers/parts/step_guards.py), under a real cap:
the process's address space limited (RLIMIT_AS, soft limit only, restored after) below what the configured
micro-batch needs, so the CPU allocator itself refuses; the run then trains as a run configured with the micro-batch
it settled on does. Offline (SFT) and online (GRPO: its update step, in parts of whole prompt groups)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import subprocess
import sys

import pytest
import torch
from datasets import Dataset

from leantune import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from ..fixtures.data import count_a
from ..fixtures.launched_runs import assert_same_losses, assert_same_weights
from ..fixtures.models import tiny_model
from ..fixtures.paths import REPO

MIB = 1024 * 1024
# Full logits (chunked_loss=False) make the step's memory grow with the micro-batch (8 rows x 64 tokens x 32k fp32:
# 65 MiB a copy). Measured growth of the address space over the first steps (VmPeak, threads started before; OMP 1
# and 4): 346 MiB at micro-batch 8, 317-348 at 4, 185-220 at 2, 124 at 1. 240 MiB of room lies halfway between the
# configured run's need and one row's: the default is refused and the run settles at 2 or 1.
ROOM = 240 * MIB
# GRPO, full logits too (2 GSM8K prompts x 4 completions of 16 tokens, padding-free: one row of ~900 tokens x 32k
# fp32, 110 MiB a copy, in the update step only; generation computes the last position's logits). Measured with the
# cap itself, in this test's process (OMP 1 and 4): micro-batch 8 fits 196 MiB of room and is refused at 185;
# micro-batch 4 fits 150 and is refused at 135 (the round generated under the cap in both). 168 MiB lies between.
ONLINE_ROOM = 168 * MIB


def _address_space() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_room(room: int):
    """The process may map `room` bytes more than it has now (the soft limit; the hard one, and so the way back, is
    kept)."""
    torch.ones(256, 256) @ torch.ones(256, 256)  # the intra-op threads exist (and their arenas) before the cap
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + room, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def sft_run(dataset, tokenizer, tmp_path, batch: int, accumulation: int, max_length: int = 64):
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, max_steps=2,
                     per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, seed=0,
                     optim="sgd", optim_args="momentum=0.9", learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1,
                     max_length=max_length, chunked_loss=False, gradient_checkpointing=False, memory_breakdown=False,
                     disable_tqdm=True)
    return SFTTrainer(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer)


def gsm8k_text(rows, n: int) -> Dataset:
    """Language-modelling rows, each longer than max_length: every micro-batch is rows x 64 tokens."""
    return Dataset.from_list([{"text": row["question"] + " " + row["answer"]} for row in rows[:n]])


def grpo_run(rows, tokenizer, out, batch: int, accumulation: int):
    args = GRPOConfig(output_dir=str(out), report_to=[], save_strategy="no", use_cpu=True, max_steps=2, seed=0,
                      per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, num_generations=4,
                      max_completion_length=16, learning_rate=1e-3, logging_steps=1, chunked_loss=False,
                      memory_breakdown=False, disable_tqdm=True,
                      shared_prompt=False)  # the unshared step, which the cap refuses at 8 (a shared one fits)
    prompts = Dataset.from_list([{"prompt": row["question"]} for row in rows[:16]])
    return GRPOTrainer(model=tiny_model(), reward_funcs=count_a, args=args, train_dataset=prompts,
                       processing_class=tokenizer)


def losses(trainer, key: str = "loss") -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


def capped_run(out: str, method: str = "sft") -> None:
    """The capped run, in a process of its own (the test's subprocess): a long-lived process (a pytest worker after
    other tests) serves much of a step from heap it already maps, which no address-space cap sees; a fresh one
    needs the growth measured above."""
    from safetensors.torch import save_file

    from ..fixtures.data import gsm8k_rows
    from ..fixtures.paths import TOKENIZER_DIR
    from ..fixtures.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    if method == "grpo":
        capped, room = grpo_run(gsm8k_rows(16), tokenizer, f"{out}/run", batch=8, accumulation=1), ONLINE_ROOM
    else:
        capped = sft_run(gsm8k_text(gsm8k_rows(16), 16), tokenizer, f"{out}/run", batch=8, accumulation=1)
        room = ROOM
    save_file({name: w.detach().clone() for name, w in capped.model.named_parameters()}, f"{out}/initial.safetensors")
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("leantune.trainer").addHandler(handler)
    with address_space_room(room):
        capped.train()
    save_file({name: w.detach().contiguous() for name, w in capped.model.named_parameters()},
              f"{out}/trained.safetensors")
    retry = capped.oom_retry
    logged = {key: losses(capped, key) for key in ("loss", "num_tokens", "entropy", "grad_norm")}
    with open(f"{out}/run.json", "w", encoding="utf-8") as handle:
        json.dump({"losses": logged["loss"], "logged": logged, "retries": retry.retries,
                   "micro_batch": retry.micro_batch, "accumulation": retry.accumulation,
                   "warnings": [w for w in warnings if "Out of memory" in w]}, handle)


def run_capped(tmp_path, method: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", "import sys; from tests.trainers.test_oom_retry import capped_run; "
                           "capped_run(*sys.argv[1:])", str(tmp_path), method], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "run.json").read_text())


def test_out_of_memory_step_retried_with_half_the_micro_batch_trains_as_that_configuration(
        tokenizer, gsm8k_rows, tmp_path):
    from safetensors.torch import load_file

    run = run_capped(tmp_path, "sft")
    retries = run["retries"]
    assert retries and tuple(retries[0][:2]) == (8, 4), retries  # the allocator refused the default
    assert all("can't allocate memory" in why for _, _, why in retries)
    assert len(run["warnings"]) == len(retries) and "micro-batch 8 -> 4" in run["warnings"][0]
    assert "gradient accumulation 1 -> 2" in run["warnings"][0]

    # the reference: configured from the start with the micro-batch and accumulation the capped run settled on
    reference = sft_run(gsm8k_text(gsm8k_rows, 16), tokenizer, tmp_path / "reference", batch=run["micro_batch"],
                        accumulation=run["accumulation"])
    reference.train()
    # The same examples in the same micro-batches, accumulated in the same order: the gradients are the same sums;
    # what may differ is the logged loss's order of addition (the parts' losses added before the step's total,
    # one fp32 rounding of a ~10 loss), within assert_same_losses' 1e-5 relative, and the weights within
    # assert_same_weights' bound (1e-5 of each update's norm plus fp32 storage rounding).
    assert_same_losses(run["losses"], losses(reference))
    assert_same_weights(load_file(str(tmp_path / "trained.safetensors")), dict(reference.model.named_parameters()),
                        load_file(str(tmp_path / "initial.safetensors")))


def test_out_of_memory_at_one_example_is_one_clear_error(tokenizer, gsm8k_rows, tmp_path):
    # two rows of four GSM8K examples each (~600 tokens): one row's fp32 logits (~75 MiB) are above glibc's largest
    # mmap threshold (32 MiB), so they are always a new mapping, which 4 MiB of room refuses whatever the heap holds
    rows = [{"question": " ".join(r["question"] + " " + r["answer"] for r in gsm8k_rows[i:i + 4]), "answer": ""}
            for i in (0, 4)]
    trainer = sft_run(gsm8k_text(rows, 2), tokenizer, tmp_path, batch=1, accumulation=2, max_length=1024)
    with address_space_room(4 * MIB), pytest.raises(RuntimeError) as raised:
        trainer.train()
    assert "micro-batch of one example: nothing left to halve" in str(raised.value)
    assert "can't allocate memory" in str(raised.value) and not trainer.oom_retry.retries


def test_out_of_memory_in_a_grpo_update_step_is_retried_in_whole_prompt_groups_and_trains_as_that_configuration(
        tokenizer, gsm8k_rows, tmp_path):
    from safetensors.torch import load_file

    run = run_capped(tmp_path, "grpo")
    # the round was generated under the cap, its update step at 8 refused, its halves (one prompt group each) fit
    assert [tuple(retry[:2]) for retry in run["retries"]] == [(8, 4)], run["retries"]
    assert "can't allocate memory" in run["retries"][0][2]
    assert len(run["warnings"]) == 1 and "micro-batch 8 -> 4 and gradient accumulation 1 -> 2" in run["warnings"][0]
    assert "whole prompt groups of 4" in run["warnings"][0]
    assert "per_device_train_batch_size=4 and gradient_accumulation_steps=2" in run["warnings"][0]

    reference = grpo_run(gsm8k_rows, tokenizer, tmp_path / "reference", batch=4, accumulation=2)
    reference.train()
    logged = run["logged"]
    # the failed attempt left no record: the same tokens counted, the same per-micro-batch metrics averaged
    assert logged["num_tokens"] == losses(reference, "num_tokens")
    for key in ("entropy", "grad_norm"):
        torch.testing.assert_close(logged[key], losses(reference, key), rtol=1e-5, atol=0)
    # The same completions (one round, generated whole in both runs) in the same micro-batches, collated alike: the
    # gradients are the same sums. The logged loss is a mean of per-token terms of the size of the advantages (~1,
    # normalised per group) that cancel to ~0 on-policy, so its rounding scales with those terms, not with the
    # loss: fp32 rounding of ~130 such terms summed in another order is below 1e-6.
    for got, expected in zip(logged["loss"], losses(reference), strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected) + 1e-6, (logged["loss"], losses(reference))
    assert_same_weights(load_file(str(tmp_path / "trained.safetensors")), dict(reference.model.named_parameters()),
                        load_file(str(tmp_path / "initial.safetensors")))


@pytest.mark.parametrize("method", ["rloo", "online_dpo"])
def test_rloo_and_online_dpo_micro_batches_in_whole_groups_train_as_the_smaller_configuration(char_tokenizer, method,
                                                                                             tmp_path):
    """The split of the GRPO test above, method by method (RLOO with the KL in its reward: per-target old and
    reference log-probs and per-completion advantages; Online DPO: pairs, per-completion `chosen`), its micro-batch
    set where a retry leaves it: the parts train as the run configured so does."""
    from leantune import OnlineDPOConfig, OnlineDPOTrainer, RLOOConfig, RLOOTrainer

    from ..fixtures.data import reversal_prompts_with_answers
    from ..fixtures.models import char_model

    def run(batch: int, accumulation: int, micro_batch: int | None = None):
        common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=2, seed=0,
                      per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, learning_rate=1e-2,
                      logging_steps=1, disable_tqdm=True, memory_breakdown=False)
        if method == "rloo":  # 8 completions, 4 per prompt
            trainer_class, args = RLOOTrainer, RLOOConfig(**common, num_generations=4, max_completion_length=8,
                                                          beta=0.05)
        else:  # 4 prompts of 2 completions
            trainer_class, args = OnlineDPOTrainer, OnlineDPOConfig(**common, max_new_tokens=8, temperature=1.0)
        trainer = trainer_class(model=char_model(char_tokenizer), reward_funcs=count_a, args=args,
                                train_dataset=reversal_prompts_with_answers(16), processing_class=char_tokenizer)
        initial = {name: w.detach().clone() for name, w in trainer.model.named_parameters()}
        if micro_batch is not None:
            trainer.oom_retry.micro_batch = micro_batch
        trainer.train()
        return trainer, initial

    batch = 8 if method == "rloo" else 4
    split, initial = run(batch, 1, micro_batch=batch // 2)
    reference, _ = run(batch // 2, 2)
    assert split.oom_retry.accumulation == 2
    # RLOO's loss is a mean of per-completion terms of the size of the advantages that cancel to ~0 on-policy (see
    # the GRPO test); Online DPO's (~0.69) is compared relatively
    for got, expected in zip(losses(split), losses(reference), strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected) + 1e-6, (losses(split), losses(reference))
    assert_same_weights(dict(split.model.named_parameters()), dict(reference.model.named_parameters()), initial)
