"""`leantune plan`: the predicted step peak equals what a real run's memory breakdown measures; a 70B model plans
from its config alone without allocating its weights; the command's mistakes are one line, exit 2."""

from __future__ import annotations

import json
import resource
import time

import pytest

from leantune.cli.main import main
from leantune.metrics.devices import parse_budget
from leantune.planning import plan_memory

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model
from ..fixtures.planning import LLAMA_3_70B, measured_breakdown


# Llama-3-70B's published shape (config.json of meta-llama/Meta-Llama-3-70B), written here: nothing from the Hub.
@pytest.mark.parametrize("arch, fields", [
    ("qwen2", dict(packing=True, per_device_train_batch_size=2, max_length=192, gradient_checkpointing=False)),
    ("llama", dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_length=160,
                   loss_chunk_size=48)),
])
def test_plan_predicts_the_measured_step_peak(tokenizer, gsm8k_rows, arch, fields):
    from leantune import SFTConfig, SFTTrainer

    dataset = gsm8k_prompt_completion(gsm8k_rows, 24)
    model = tiny_model(arch)
    plan = plan_memory(model.config, dataset, "sft", processing_class=tokenizer, **fields)
    measured = measured_breakdown(SFTTrainer, SFTConfig, model, dataset, tokenizer, fields)
    predicted = plan.measured_step
    # Both numbers are MemTracker's sums of the same tensors' byte sizes (one with storage, one fake), so they agree to
    # the byte in every configuration measured (docs/benchmarks.md); 2% is the bound the plan promises, per part too
    # (a part must not be right only because another's error cancels it).
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes
    for part, size in measured.parts.items():
        assert abs(predicted.parts.get(part, 0) - size) <= 0.02 * measured.peak_bytes, part
    assert plan.worst.peak_bytes >= predicted.peak_bytes  # the worst batch of the epoch is at least step 2's
    assert plan.worst.step is not None and plan.worst.step >= 1


def test_70b_plans_from_config_only_in_seconds(tmp_path, tokenizer, gsm8k_rows):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_70B))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu_started = time.process_time()  # CPU time, not wall time: the machine may be shared
    plan = plan_memory(str(tmp_path), gsm8k_prompt_completion(gsm8k_rows, 8), "sft", processing_class=tokenizer,
                       per_device_train_batch_size=2, max_length=128, measured_step=False, max_batches=1,
                       model_init_kwargs={"dtype": "bfloat16"})
    cpu_seconds = time.process_time() - cpu_started
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 1024  # one bf16 layer alone would be 1.6 GiB: no weight was allocated
    assert abs(plan.num_parameters - 70.55e9) < 0.01e9  # Llama-3-70B's 70.55B parameters
    parts = plan.worst.parts
    assert abs(parts["parameters"] - 2 * plan.num_parameters) < 1 << 20  # bf16: 2 bytes a parameter
    assert parts["optimizer_states"] >= 2 * parts["parameters"]  # AdamW's two moments (of bf16 parameters)
    assert any("extrapolated" in note for note in plan.notes)
    assert cpu_seconds < 60


@pytest.mark.quick
@pytest.mark.parametrize("argv, flag", [
    (["plan", "--method", "nope"], "method"),
    (["plan", "--dataset_name", "x.jsonl"], "--model_name_or_path"),
    (["plan", "--model_name_or_path", "/nonexistent/model", "--dataset_name", "/nonexistent.jsonl",
      "--memory_budget", "lots"], "--memory_budget"),
    (["plan", "--model_name_or_path", "/nonexistent/model", "--dataset_name", "/nonexistent.jsonl",
      "--host_memory", "h200"], "--host_memory"),  # a size: a GPU's name gives its device memory, not the host's
    *[(["plan", "--method", method, "--model_name_or_path", "/nonexistent/model", "--dataset_name",
        "/nonexistent.jsonl", "--solve", solve, *budget], "--solve") for method, solve, budget in (
        ("sft", "max_completion_length", ["--memory_budget", "1GiB"]),  # only online methods generate
        ("grpo", "max_completion_length", []),  # no budget to fit
        ("grpo", "max_completions_per_generate", []),
        ("grpo", "max_completions_per_generate", ["--memory_budget", "1GiB", "--use_vllm", "true"]))],  # vLLM's pool
])
def test_plan_command_mistakes_are_one_line(capsys, argv, flag):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "Traceback" not in err[0]


@pytest.mark.quick
def test_budgets_read_sizes_and_gpu_names():
    assert parse_budget("24GiB") == 24 * 1024 ** 3
    assert parse_budget("1500MiB") == 1500 * 1024 ** 2
    assert parse_budget("H100") == 81559 * 1024 ** 2
    with pytest.raises(ValueError, match="memory_budget"):
        parse_budget("big")


def test_plan_trains_the_weights_in_the_dtype_the_trainer_would(tmp_path, tokenizer, gsm8k_rows):
    """A checkpoint saved in bf16: a name loads in float32 unless model_init_kwargs says (as TRL), "auto" takes the
    checkpoint's dtype, and a model object trains in its own; the plan's parameters are 4 or 2 bytes each."""
    import torch

    model = tiny_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    dataset = gsm8k_prompt_completion(gsm8k_rows, 4)
    fields = dict(per_device_train_batch_size=2, max_length=64, measured_step=False, max_batches=1)
    for source, init_kwargs, size in ((str(tmp_path), None, 4), (str(tmp_path), {"dtype": "auto"}, 2),
                                      (model, None, 2)):
        plan = plan_memory(source, dataset, "sft", processing_class=tokenizer, model_init_kwargs=init_kwargs,
                           **fields)
        assert plan.worst.parts["parameters"] == size * plan.num_parameters, (source, init_kwargs)


@pytest.mark.quick
def test_a_peak_linear_in_the_layers_is_extrapolated_when_a_tensor_changes_part():
    """The 8B QLoRA plan at 500,000 tokens with checkpoint offload: traced with 2, 3 and 4 layers, its peak grew by the
    same bytes per layer, but a [500,000, 4,096] tensor counted as an activation with 2 layers is a temporary from 3
    on. The parts then come from the last two traces (they add up to the peak); before, the plan traced all 32 layers
    (429 s instead of ~25). A peak that is not linear still traces the whole model (None)."""
    from leantune.planning.planned_run import TracedStep
    from leantune.planning.planner import _extrapolate

    moved = 4_096_000_000

    def run(layers: int, peak_growth: int = 100):
        parts = {"parameters": 1000 + 10 * layers, "activations": 90 * layers + (moved if layers == 2 else 0),
                 "temporaries": (0 if layers == 2 else moved)}
        step = TracedStep(sum(parts.values()) + (peak_growth - 100) * (layers == 4), parts, "rows", 1)
        return 7 * layers, 1, None, [step], None

    regrouped = []
    _, _, _, (step,), _ = _extrapolate([run(2), run(3), run(4)], 32, regrouped)
    assert sorted(regrouped) == ["activations", "temporaries"]
    assert step.parts == {"parameters": 1320, "activations": 90 * 32, "temporaries": moved}
    assert step.peak_bytes == sum(step.parts.values()) == run(2)[3][0].peak_bytes + 30 * 100
    assert _extrapolate([run(2), run(3), run(4)], 32) is None  # the caller that does not take regrouped parts
    assert _extrapolate([run(2), run(3), run(4, peak_growth=101)], 32, []) is None  # the peak itself not linear


@pytest.mark.quick
def test_a_breakdown_beside_the_gradients_that_is_not_linear_is_dropped_unless_zero_reads_it():
    """The 8B QLoRA plan at 500,000 tokens with the attention block tiled: the peak and its parts grew linearly with
    2, 3 and 4 layers, the breakdown beside the gradients (read by ZeRO-2's plan only) did not (the 2-layer trace
    holds its gradients at another moment). Without ZeRO it is left out (None) instead of tracing all 32 layers
    (stopped after 7 minutes; 29 s extrapolated); a ZeRO plan, which reads it, still traces the whole model."""
    from leantune.planning.planned_run import TracedStep
    from leantune.planning.planner import _extrapolate

    def run(layers: int):
        parts = {"parameters": 1000 + 10 * layers, "activations": 90}
        beside = {"gradients": 8 if layers > 2 else 3, "activations": 50}
        return 7 * layers, 1, None, [TracedStep(sum(parts.values()), parts, "rows", 1, None, False, beside)], None

    runs = [run(2), run(3), run(4)]
    _, _, _, (step,), _ = _extrapolate(runs, 32, [], beside_needed=False)
    assert step.peak_bytes == 1000 + 320 + 90 and step.backward_beside_gradients is None
    assert _extrapolate(runs, 32, [], beside_needed=True) is None
    linear = [(*r[:3], [TracedStep(**{**vars(r[3][0]), "backward_beside_gradients": {"gradients": n}})], None)
              for n, r in zip((3, 4, 5), runs)]
    assert _extrapolate(linear, 32, [], beside_needed=True)[3][0].backward_beside_gradients == {"gradients": 33}
