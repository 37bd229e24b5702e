"""`memory_budget`: a run below the memory its configuration needs sizes itself before its weights load, then fits
under a meter that shares no code with the planner (the CPU allocator's own events) and trains exactly as the
chosen configuration set by hand."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch
from transformers import TrainerCallback

from devkit.allocator_meter import AllocatorMeter
from leantune import SFTConfig, SFTTrainer
from leantune.planning import plan_memory
from leantune.planning.recommend import TECHNIQUES

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

MIB = 1 << 20


class _Losses(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _run(folder, dataset, tokenizer, meter=None, **fields):
    args = SFTConfig(output_dir=str(folder / "out"), use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True, max_steps=2, logging_steps=1, memory_breakdown=False, **fields)
    before = AllocatorMeter.live_storage_bytes()  # what this process holds that is not the run's
    trainer = SFTTrainer(model=str(folder / "model"), args=args, train_dataset=dataset, processing_class=tokenizer)
    losses = _Losses()
    trainer.add_callback(losses)
    with contextlib.redirect_stdout(io.StringIO()), meter.profiling(trainer) if meter else contextlib.nullcontext():
        trainer.train()
    return trainer, losses.losses, before


def test_a_run_under_its_budget_sizes_itself_fits_and_learns_the_same(tokenizer, gsm8k_rows, tmp_path, caplog):
    tiny_model("llama").save_pretrained(tmp_path / "model")  # loaded by path: after the run has sized itself
    dataset = gsm8k_prompt_completion(gsm8k_rows, 4)
    fields = dict(per_device_train_batch_size=4, max_length=128, padding_free=True, gradient_checkpointing=False)
    default = plan_memory(str(tmp_path / "model"), dataset, "sft", processing_class=tokenizer, measured_step=False,
                          **fields)
    budget = default.peak_bytes - 1  # below what the run as configured needs, by a byte

    meter = AllocatorMeter(step=1)  # the second step: the first that holds optimizer states
    with caplog.at_level(logging.INFO, logger="leantune.plan"):
        sized, losses, before = _run(tmp_path, dataset, tokenizer, meter, memory_budget=f"{budget}B", **fields)
    fit = sized.memory_budget_fit
    chosen = fit.chosen
    # (a) the run changed its config to the search's choice, and one log block said so, each field old -> new
    assert fit.planned.peak_bytes == default.peak_bytes > budget >= chosen.peak_bytes
    assert fit.changes
    for name, (old, new) in fit.changes.items():
        assert getattr(sized.args, name) == new == chosen.fields[name] and fields.get(name, old) == old
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory_budget ")]
    assert len(blocks) == 1
    for name, (old, new) in fit.changes.items():
        assert f"  {name}: {old} -> {new}" in blocks[0].splitlines()
    assert f"{chosen.peak_bytes / 2**20:.1f} MiB" in blocks[0] and f"{budget / 2**20:.1f} MiB" in blocks[0]
    # each technique it turned on (planning/recommend.py's TECHNIQUES), one line more: what and why
    turned_on = [r.getMessage() for r in caplog.records if r.getMessage().startswith("turned on ")]
    techniques = {t.field: t.why for t in TECHNIQUES}
    expected = [(name, new) for name, (_, new) in fit.changes.items() if name in techniques and new]
    assert expected and len(turned_on) == len(expected)
    for line, (name, new) in zip(turned_on, expected):
        assert line.startswith(f"turned on {name}={new} by memory_budget ") and techniques[name] in line
    global_batch = sized.args.per_device_train_batch_size * sized.args.gradient_accumulation_steps
    assert global_batch == fields["per_device_train_batch_size"]  # the same global batch
    # (b) the step's peak at the CPU allocator (torch.profiler's memory events: every allocation and free, op-internal
    # buffers included), less what the process held before the run began, is within the budget
    assert meter.peak_bytes - before <= budget, (meter.peak_bytes - before, budget)

    # (c) the chosen configuration set by hand, same seed: the same ops on the same rows in the same order, so the
    # per-step losses are equal to the bit (no tolerance is needed: nothing differs between the runs). Under the same
    # budget it fits as it is: said, and nothing changed.
    by_hand = {**fields, **{name: new for name, (_, new) in fit.changes.items()}}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="leantune.plan"):
        reference, reference_losses, _ = _run(tmp_path, dataset, tokenizer, memory_budget=f"{budget}B", **by_hand)
    assert reference.memory_budget_fit.recommendation is None and reference.memory_budget_fit.changes == {}
    assert [r.getMessage().endswith("within it; nothing changed.") for r in caplog.records
            if r.getMessage().startswith("memory_budget ")] == [True]
    for name, value in by_hand.items():
        assert getattr(reference.args, name) == value, name
    assert len(losses) == 2 and losses == reference_losses
    for (name, a), b in zip(sized.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.quick
def test_nothing_fits_is_one_line_naming_the_flag_and_the_least_the_run_needs(tokenizer, gsm8k_rows, tmp_path, capsys):
    from leantune.cli.main import main

    tiny_model("llama").save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    gsm8k_prompt_completion(gsm8k_rows, 1).to_json(tmp_path / "train.jsonl")  # one row: the plan traces one batch
    # packing kept, micro-batch 1, the chunk given, the tiled MLP on: two candidates (checkpointing off or on), the
    # cheap search
    argv = ["sft", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "train.jsonl"),
            "--packing", "true", "--max_length", "64", "--per_device_train_batch_size", "1", "--loss_chunk_size", "64",
            "--tiled_mlp", "true",
            "--memory_budget", "1MiB", "--use_cpu", "true", "--output_dir", str(tmp_path / "out"),
            "--report_to", "none"]
    capsys.readouterr()
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("leantune sft: error:")]
    assert len(err) == 1 and "--memory_budget 1.0 MiB: no configuration that learns the same thing fits" in err[0]
    # the run saves all it can already (checkpointing on, micro-batch 1, no candidate saves more): its own peak
    assert "the smallest planned peak is" in err[0] and "gradient_checkpointing=True" in err[0]
    assert not (tmp_path / "out").exists()  # nothing trained or written
    # `leantune plan` with the same flags: the run is its own most frugal candidate (known), so nothing more is planned
    plan_argv = ["plan", *argv[1:argv.index("--use_cpu")]]
    assert main(plan_argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leantune plan: error: --memory_budget 1.0 MiB: no configuration")
    assert "the least a candidate needs is" in err[0] and "gradient_checkpointing=True" in err[0]
    auto = [*argv[:argv.index("--memory_budget")], "--memory_budget", "auto", "--use_cpu", "true"]
    assert main(auto) == 2  # a CPU run: its config refuses `auto` (CUDA's free memory) before any data loads
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("leantune sft: error:")]
    assert len(err) == 1 and "--memory_budget=auto" in err[0] and "give the memory to fit as a size" in err[0]


def test_online_candidates_keep_whole_groups_and_the_same_round():
    from leantune import GRPOConfig, OnlineDPOConfig, PPOConfig
    from leantune.planning.recommend import candidates, micro_batch_group

    grpo = GRPOConfig(output_dir="/tmp/x", per_device_train_batch_size=16, num_generations=4, steps_per_generation=2)
    assert micro_batch_group(grpo) == 4  # GRPO's micro-batch counts completions: a group is num_generations of them
    assert micro_batch_group(OnlineDPOConfig(output_dir="/tmp/x")) == 1  # Online DPO's counts prompts (pairs)
    assert micro_batch_group(PPOConfig(output_dir="/tmp/x")) == 1  # no groups
    found = candidates("grpo", dict(per_device_train_batch_size=16, steps_per_generation=2), group=4)
    sizes = {c.fields["per_device_train_batch_size"] for c in found}
    assert sizes == {16, 8, 4}  # 2 and 1 would split a group of 4
    for candidate in found:
        f = candidate.fields
        assert f["per_device_train_batch_size"] * f["gradient_accumulation_steps"] == 16  # the same optimizer step
        assert f["per_device_train_batch_size"] * f["steps_per_generation"] == 32  # the same generation round


def test_an_online_round_over_its_budget_is_generated_in_pieces_and_trains_as_set_by_hand(caplog, capsys, tmp_path):
    """GRPO whose generation round (16 completions per call) exceeds a budget its update step fits: the run sizes
    itself by generating the round 4 completions (one prompt group) per call, the largest piece that fits, says so
    and why, keeps the round and the global batch, and trains exactly as the same piece set by hand (same seed).
    `leantune plan --memory_budget` with the run's flags recommends that same configuration."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from leantune import GRPOTrainer
    from leantune.defaults import as_prompts_with_answers, build_default_dataset
    from leantune.defaults.tokenizer import build_default_tokenizer
    from leantune.planning.generation_batch import round_total, solve_generation_batch

    from ..fixtures.online_rounds import grpo_config

    tokenizer = build_default_tokenizer()
    # 8 KV heads of 64 on a 32-wide body: a big cache per sequence beside a small update step (checkpointing on)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    prompts = as_prompts_with_answers(build_default_dataset(16, 0, seed=0, task="reverse")["train"])
    # unshared rows: the update step this test sizes the round against (a shared row's step is another size)
    fields = dict(per_device_train_batch_size=4, steps_per_generation=4, gradient_checkpointing=True,
                  shared_prompt=False)
    plan = plan_memory(config, prompts, "grpo", processing_class=tokenizer, measured_step=False, num_generations=4,
                       max_completion_length=8, **fields)
    step_total = solve_generation_batch(plan, plan.device_total_bytes, 4).step_total
    assert plan.generation.batch == 16 and round_total(plan, 8) > step_total  # the round is what exceeds
    budget = (step_total + round_total(plan, 8)) // 2  # the step and a round of 4 per call fit; 8 per call does not
    assert round_total(plan, 4) <= budget

    def run(**overrides):
        torch.manual_seed(0)
        trainer = GRPOTrainer(model=LlamaForCausalLM(config), processing_class=tokenizer, train_dataset=prompts,
                              reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                              args=grpo_config(**fields, **overrides))
        losses = _Losses()
        trainer.add_callback(losses)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
        return trainer, losses.losses

    with caplog.at_level(logging.INFO, logger="leantune.plan"):
        sized, losses = run(memory_budget=f"{budget}B")
    fit = sized.memory_budget_fit
    assert fit.planned.peak_bytes == plan.peak_bytes and fit.changes == {"max_completions_per_generate": (None, 4)}
    assert sized.args.max_completions_per_generate == 4 == sized.generation.backend.max_batch_size
    assert (sized.args.per_device_train_batch_size, sized.args.gradient_accumulation_steps, sized.round_size) == \
        (4, 1, 16)  # the micro-batch, the global batch and the round as configured
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory_budget ")]
    assert len(blocks) == 1 and "  max_completions_per_generate: None -> 4" in blocks[0].splitlines()
    assert "generation round was over the budget" in blocks[0] and "same in distribution" in blocks[0]
    _plan_command_agrees(sized, plan, budget, config, tokenizer, prompts, tmp_path, capsys)
    # the same piece by hand, the same seed: the same pieces draw the same tokens, so the losses and weights are
    # equal to the bit (nothing differs between the runs)
    reference, reference_losses = run(max_completions_per_generate=4)
    assert len(losses) == 2 and losses == reference_losses
    for (name, a), b in zip(sized.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name


def _plan_command_agrees(sized, plan, budget, config, tokenizer, prompts, tmp_path, capsys):
    """The command plans the run as configured (its round over the budget), then, as the run does, generates the round
    in pieces and finds that all it takes: no candidate is planned (it once searched 8 candidates without the run's
    checkpointing and said none fits)."""
    from leantune.cli.main import main

    config.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts.to_json(tmp_path / "prompts.jsonl")
    capsys.readouterr()
    assert main(["plan", "--method", "grpo", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name",
                 str(tmp_path / "prompts.jsonl"), "--num_generations", "4", "--max_completion_length", "8",
                 "--per_device_train_batch_size", "4", "--steps_per_generation", "4", "--gradient_checkpointing",
                 "true", "--shared_prompt", "false", "--memory_budget", f"{budget}B"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "the candidates below generate the round in pieces: --max_completions_per_generate 4" in out
    chosen = plan.with_generation_batch(4)  # the run as configured, in pieces: the run's choice and the command's
    assert sized.memory_budget_fit.chosen.total_bytes == chosen.device_total_bytes <= budget
    searched = [line for line in out if line.startswith("  time x")]
    assert len(searched) == 1 and f"peak {chosen.peak_bytes / MIB:.1f} MiB" in searched[0]
    recommended = out[out.index("recommended (fits, expected fastest):") + 1:]
    flags = dict(line.split() for line in recommended if line.startswith("  --"))
    assert flags["--max_completions_per_generate"] == "4" and flags["--gradient_checkpointing"] == "True"
    for flag, value in flags.items():  # the configuration the run sized itself to, flag for flag
        assert str(getattr(sized.args, flag[2:])) == value, flag
    assert not {"--padding_free", "--activation_offloading"} & set(flags)  # what the run kept, the command keeps
