"""`plan_check` before training, planning from `leantune profile`'s JSON, and the budget search seen choosing a
configuration that then fits for real (CPU: no device terms, so the budget is the traced peak's own scale)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
import re

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from leantune.cli.main import main
from leantune.planning import plan_memory
from leantune.planning.plan_check import report_fit

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model
from ..fixtures.paths import REPO

MIB = 1 << 20


def _train(model, dataset, tokenizer, **fields):
    from leantune import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir="/tmp/leantune-test-plan-budget", use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True, max_steps=2, **fields)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    probe = _RandomStates()
    trainer.add_callback(probe)
    probe.at_call = probe.now()  # as the Trainer's set-up left them (set_seed(args.seed)): the plan's order is theirs
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    trainer.random_states = probe
    return trainer


class _RandomStates(TrainerCallback):
    """The RNGs' states when train() was called and when the Trainer's loop began (after any plan_check)."""

    @staticmethod
    def now():
        return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_begin = self.now()

    def unchanged(self) -> bool:
        (t0, r0, n0), (t1, r1, n1) = self.at_call, self.at_begin
        return torch.equal(t0, t1) and r0 == r1 and bool((n0 == n1).all())


def test_plan_check_predicts_its_own_run_and_changes_nothing(tokenizer, gsm8k_rows, caplog):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 9)
    fields = dict(per_device_train_batch_size=3, max_length=128, loss_chunk_size=40)
    level = logging.getLogger("leantune").level
    with caplog.at_level(logging.INFO, logger="leantune.plan"):
        checked = _train(tiny_model("llama"), dataset, tokenizer, plan_check=True, **fields)
    plain = _train(tiny_model("llama"), dataset, tokenizer, **fields)
    plan = checked.memory_plan
    measured = checked.memory_breakdown
    # The plan's step 2 and the run's measured step 2 are MemTracker's sums of the same tensors' byte sizes (fake and
    # real): they agree to the byte in every configuration measured (docs/benchmarks.md); 2% of the peak is the bound
    # the plan promises, held per part so that no part is right only because another's error cancels it.
    assert abs(plan.measured_step.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes
    for part, size in measured.parts.items():
        assert abs(plan.measured_step.parts.get(part, 0) - size) <= 0.02 * measured.peak_bytes, part
    assert any("plan_check: predicted step peak" in r.message and r.levelno == logging.INFO for r in caplog.records)
    # Planning ran in its own trainer, whose set-up re-seeds the RNGs (torch's, numpy's and random's states all change
    # without the restore: checked below at the loop's start); they, accelerate's state and the log level were put
    # back, so the checked run trained bit for bit as the plain one.
    for (name, a), b in zip(checked.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(a, b), name
    assert plain.random_states.unchanged() and checked.random_states.unchanged()  # the plan's set_seed undone
    assert logging.getLogger("leantune").level == level

    # The warning path, through the seam that takes the device's free memory as a number: the model already holds its
    # parameters (counted by the plan), so "usable" is free + those bytes.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="leantune.plan"):
        assert report_fit(plan, checked.model, torch.device("cpu"), free_bytes=1 * MIB) is False
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert f"{plan.peak_bytes / MIB:,.1f} MiB" in warnings[0] and "leantune plan --device cpu --memory_budget" in warnings[0]
    held = sum(p.numel() * p.element_size() for p in checked.model.parameters()) + sum(
        b.numel() * b.element_size() for b in checked.model.buffers())
    assert f"{(MIB + held) / MIB:,.1f} MiB this run can use" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="leantune.plan"):
        assert report_fit(plan, checked.model, torch.device("cpu"), free_bytes=plan.peak_bytes) is True
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    # A run the plan cannot take (a stream: its rows are not known before training) says so in one line and trains.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="leantune.plan"):
        streamed = _train(tiny_model("llama"), dataset.to_iterable_dataset(), tokenizer, plan_check=True, **fields)
    assert streamed.memory_plan is None and streamed.state.global_step == 2
    skipped = [r.message for r in caplog.records if r.name == "leantune.plan" and r.levelno == logging.WARNING]
    assert len(skipped) == 1 and "streamed" in skipped[0] and "goes on unchecked" in skipped[0]


@pytest.mark.quick
def test_plan_from_the_profile_json_is_the_plan_from_the_data(tokenizer, gsm8k_rows, tmp_path, capsys):
    from leantune.profiling import profile_dataset

    dataset = gsm8k_prompt_completion(gsm8k_rows, 12)
    profile_path = tmp_path / "length_profile.json"
    profile_dataset(dataset, tokenizer).to_json(profile_path)
    config = tiny_model("qwen2").config
    # max_length 96 truncates most rows and leaves some without a completion token (dropped): the rebuilt rows must
    # reproduce the prompt/completion split for that, and the row order for the sampler's batches.
    fields = dict(padding_free=True, per_device_train_batch_size=4, max_length=96)
    from_data = plan_memory(config, dataset, "sft", processing_class=tokenizer, measured_step=False, **fields)
    from_json = plan_memory(config, None, "sft", processing_class=tokenizer, measured_step=False,
                            lengths=str(profile_path), **fields)
    assert from_json.worst == from_data.worst  # same batch, same step, same bytes per part: exact, not approximate

    # The command plans the same rows (the model folder holds config.json only; the tokenizer is named apart).
    model_dir = tmp_path / "model"
    config.save_pretrained(model_dir)
    plan_json = tmp_path / "plan.json"
    assert main(["plan", "--model_name_or_path", str(model_dir), "--tokenizer", str(tokenizer.name_or_path),
                 "--lengths", str(profile_path), "--padding_free", "true", "--per_device_train_batch_size", "4",
                 "--max_length", "96", "--plan_json", str(plan_json)]) == 0
    assert json.loads(plan_json.read_text())["worst"]["peak_bytes"] == from_data.worst.peak_bytes

    # Mistakes are one line: a file that is not a profile, a profile of another kind of data than the method reads.
    (tmp_path / "other.json").write_text("{}")
    capsys.readouterr()
    for lengths, method, said in [(tmp_path / "other.json", "sft", "row_lengths"), (profile_path, "dpo", "dpo"),
                                  (profile_path, "sft", "--dataset_name")]:
        both = ["--dataset_name", "x.jsonl"] if said == "--dataset_name" else []
        assert main(["plan", "--model_name_or_path", str(model_dir), "--lengths", str(lengths),
                     "--method", method, *both]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--lengths" in err[0] and said in err[0] and "Traceback" not in err[0]


def test_budget_search_chooses_a_config_that_fits_for_real(tokenizer, gsm8k_rows, capsys):
    from leantune import SFTConfig
    from leantune.cli.arguments import ModelConfig, PlanArguments, ScriptArguments
    from leantune.cli.parser import parse_command_args
    from leantune.planning.length_suggestion import data_lengths, suggest_for_budget
    from leantune.planning.recommend import candidates, recommend

    dataset = gsm8k_prompt_completion(gsm8k_rows, 12)
    model = tiny_model("llama")
    fields = dict(per_device_train_batch_size=4, max_length=512)
    ranked = candidates("sft", fields)
    fastest = plan_memory(model.config, dataset, "sft", processing_class=tokenizer, measured_step=False,
                          **ranked[0].fields)
    budget = fastest.peak_bytes - 1  # the fastest candidate misses by one byte
    plan_args = PlanArguments(device="cpu", memory_budget=str(budget))  # CPU: no device terms beyond the trace
    found = recommend(fastest, budget, model.config, dataset, "sft", None, plan_args, fields, tokenizer)
    chosen = found.chosen
    assert chosen is not None and chosen is not found.considered[0]
    assert chosen.total_bytes == chosen.peak_bytes <= budget
    for faster in found.considered[:found.considered.index(chosen)]:
        assert faster.peak_bytes > budget and faster.relative_time <= chosen.relative_time

    lines = found.lines()
    for candidate in found.considered:
        assert any(f"time x{candidate.relative_time:.2f}" in line and f"{candidate.peak_bytes / MIB:.1f} MiB" in line
                   for line in lines)
    flags = [line.split() for line in lines[lines.index("recommended (fits, expected fastest):") + 1:]]
    assert flags and all(len(flag) == 2 and flag[0].startswith("--") for flag in flags)
    argv = [word for flag in flags for word in flag] + ["--max_length", "512", "--output_dir", "/tmp/x"]
    _, _, config, explicit = parse_command_args("leantune sft", (ScriptArguments, ModelConfig, SFTConfig), argv)
    for name, value in chosen.fields.items():  # the printed flags are the chosen configuration, as the CLI reads it
        assert getattr(config, name) == value, name

    trained = _train(model, dataset, tokenizer, **{k: getattr(config, k) for k in explicit if k != "output_dir"})
    assert trained.memory_breakdown.peak_bytes <= chosen.peak_bytes <= budget  # the recommendation fits for real

    # The profiler's keep-threshold max_length is offered apart, labelled with what it truncates, and its own search
    # runs because the same-result search gave something up (its fastest candidate did not fit).
    lengths = data_lengths(dataset, tokenizer).tolist()  # through the trainer's tokenisation, as leantune profile
    suggestion = suggest_for_budget(found, lengths, SFTConfig, fields, 0.9, lambda shorter: recommend(
        fastest, budget, model.config, dataset, "sft", None, plan_args, shorter, tokenizer, limit=1))
    assert suggestion is not None and suggestion.max_length < 512 and suggestion.max_length % 64 == 0
    assert suggestion.rows_truncated == sum(n > suggestion.max_length for n in lengths)
    assert suggestion.tokens_lost == sum(max(0, n - suggestion.max_length) for n in lengths)
    assert suggestion.tokens_lost <= 0.1 * sum(lengths)  # keeps >= 90% of the tokens
    text = "\n".join(suggestion.lines())
    assert text.startswith("changes what is learned") and f"truncates {suggestion.rows_truncated} of 12 rows" in text
    assert suggestion.search.considered[0].fields["max_length"] == suggestion.max_length


def test_candidates_are_ranked_by_the_documented_factors():
    from leantune.planning.recommend import candidates

    table = (REPO / "docs" / "plan.md").read_text()
    factors = {rule: float(x) for rule, x in re.findall(r"\| (padded layout|gradient checkpointing|activation "
                                                         r"offloading|each halving of the micro-batch|checkpoint "
                                                         r"offload) \| x([0-9.]+)", table)}
    assert len(factors) == 5
    ranked = candidates("sft", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2))
    # layouts x (checkpointing x offloading, + checkpoint offload beside checkpointing alone, where this transformers
    # lets it run) x micro-batches 4, 2, 1
    from leantune.memory.checkpoint_offload import unsupported_by_transformers

    assert len(ranked) == 3 * (2 * 2 + (unsupported_by_transformers() is None)) * 3
    for candidate in ranked:
        f = candidate.fields
        assert f["per_device_train_batch_size"] * f["gradient_accumulation_steps"] == 8  # the same global batch
        expected = ((factors["padded layout"] if not (f["packing"] or f["padding_free"]) else 1.0)
                    * (factors["gradient checkpointing"] if f["gradient_checkpointing"] else 1.0)
                    * (factors["activation offloading"] if f["activation_offloading"] else 1.0)
                    * (factors["checkpoint offload"] if f.get("checkpoint_offload_layers") else 1.0)
                    * factors["each halving of the micro-batch"] ** {4: 0, 2: 1, 1: 2}[f["per_device_train_batch_size"]])
        assert candidate.relative_time == pytest.approx(expected, rel=1e-12)
    times = [c.relative_time for c in ranked]
    assert times == sorted(times)
    assert ranked[0].fields["packing"] and not ranked[0].fields["gradient_checkpointing"]
    # with the vocabulary known, each candidate also comes with a quarter of the default loss chunk (docs/plan.md)
    chunk = float(re.search(r"\| a quarter of the default loss chunk \| x([0-9.]+)", table).group(1))
    with_chunks = candidates("sft", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2), 32000)
    smaller = [c for c in with_chunks if "loss_chunk_size" in c.fields]
    assert len(with_chunks) == 2 * len(ranked) and len(smaller) == len(ranked)
    assert {c.fields["loss_chunk_size"] for c in smaller} == {64 * 2 ** 20 // (4 * 32000) // 4}
    assert sorted(c.relative_time for c in smaller) == pytest.approx([t * chunk for t in times], rel=1e-12)


def test_a_lora_run_that_does_not_fit_is_offered_qlora_apart(tokenizer, gsm8k_rows):
    from peft import LoraConfig

    from leantune import SFTConfig
    from leantune.cli.arguments import ModelConfig, PlanArguments, ScriptArguments
    from leantune.cli.parser import parse_command_args
    from leantune.planning.qlora_suggestion import suggest_qlora
    from leantune.planning.recommend import candidates, recommend
    from leantune.planning.run_facts import RunFacts

    dataset = gsm8k_prompt_completion(gsm8k_rows, 8)
    config = tiny_model("llama").config
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    fields = dict(per_device_train_batch_size=2, max_length=128)
    fastest = plan_memory(config, dataset, "sft", processing_class=tokenizer, peft_config=lora, measured_step=False,
                          **candidates("sft", fields)[0].fields)
    budget = fastest.peak_bytes - 1
    plan_args = PlanArguments(device="cpu", memory_budget=str(budget))
    found = recommend(fastest, budget, config, dataset, "sft", lora, plan_args, fields, tokenizer, limit=1)
    assert found.chosen is None  # the one same-result candidate planned misses by a byte
    facts = RunFacts("sft", config, fields, adapters=True)  # the search's candidates include the tiled MLP's
    assert found.limit == 1 and found.unplanned == len(candidates("sft", fields, config.vocab_size, 1, facts)) - 1
    assert f"stopped at its limit of 1 plans: {found.unplanned} candidate(s) were not planned" in "\n".join(found.lines())

    def search(quantized):
        return recommend(fastest, budget, config, dataset, "sft", lora, plan_args, quantized, tokenizer, limit=1)

    assert suggest_qlora(found, fields, uses_peft=False, search=search) is None  # full training: no adapter to keep
    suggestion = suggest_qlora(found, fields, uses_peft=True, search=search)
    chosen = suggestion.search.chosen
    # the same fastest layout with the 4-bit base: the decoder's linear weights at ~0.52 byte instead of 4 fit it
    assert chosen is not None and chosen.peak_bytes <= budget < fastest.peak_bytes
    text = suggestion.lines()
    assert text[0].startswith("changes what is learned")
    flags = [word for line in text[text.index("    --load_in_4bit true"):] for word in line.split()]
    _, model_args, _, _ = parse_command_args("leantune sft", (ScriptArguments, ModelConfig, SFTConfig),
                                             flags + ["--use_peft", "true", "--output_dir", "/tmp/x"])  # as sft reads them
    assert model_args.load_in_4bit and model_args.bnb_4bit_quant_type == "nf4" and model_args.use_bnb_nested_quant
