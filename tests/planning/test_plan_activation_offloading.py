"""Activation offloading in the plan (memory/offloading.py's `planned_host`, planning/checkpoint_offload_plan.py):
a plan of a CUDA run moves each activation the offloader would move from the traced device to a host ledger of pinned
blocks, so its device peak drops by those bytes and the host check counts them; a plan of a run on this CPU, where
nothing is offloaded, is the trace it always was and equals the CPU allocator's measured step.

The expected saving is the offloader's own: a real run of the same step on this CPU, its offloader told to copy to the
CPU (`offload_device`, as on CUDA), reports the bytes it moved (`stats["bytes_offloaded"]`) and the host blocks they
take (each rounded as the pinned allocator rounds it, `pinned_bytes`). The rows are all cut at `max_length`, so every
batch has the same shape and a layer's input ([tokens, hidden] fp32) is the smallest tensor the rule moves
(`MIN_BYTES`): the data's own tensors (token ids, masks, positions), real in the plan and on CUDA in the run, are under
it.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from leantune.memory.checkpoint_offload import pinned_bytes
from leantune.memory.offloading import ActivationOffloader

HIDDEN, LAYERS, LENGTH, ROWS = 64, 4, 32, 4
MIN_BYTES = ROWS * LENGTH * HIDDEN * 4 // 2  # half a layer input: inputs and larger move, the data's tensors do not


def cut_rows(gsm8k_rows, n: int) -> Dataset:
    """`n` text rows, each longer than `LENGTH` tokens: cut there, every batch is [ROWS, LENGTH] of targets."""
    return Dataset.from_list([{"text": row["question"] + " " + row["answer"]} for row in gsm8k_rows[:n]])


def small_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       attn_implementation="sdpa")


def run_fields(checkpointing: bool, offloading: bool) -> dict:
    offload = dict(activation_offloading=True, activation_offloading_min_bytes=MIN_BYTES) if offloading else {}
    return dict(per_device_train_batch_size=ROWS, max_length=LENGTH, gradient_checkpointing=checkpointing, **offload)


class RecordingOffloader(ActivationOffloader):
    """A real run's offloader copying to this CPU as it would from CUDA; keeps the pinned block of each tensor moved."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, offload_device="cpu", **kwargs)
        self.blocks: list[int] = []

    def _offload(self, handle, session):
        super()._offload(handle, session)
        if handle.offloaded:
            self.blocks.append(pinned_bytes(handle.host.numel() * handle.host.element_size()))


def offloaded_by_the_run(tokenizer, dataset, checkpointing: bool) -> RecordingOffloader:
    """One real optimizer step of the run on this CPU, its offloader recording what it moves."""
    from transformers import LlamaForCausalLM

    from leantune import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(small_config()).float()
    args = SFTConfig(output_dir="/tmp/leantune-test-offload-plan", use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True, max_steps=1, **run_fields(checkpointing, True))
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    recording = RecordingOffloader(trainer.model, min_offload_bytes=MIN_BYTES)
    trainer.logprobs._offloader = recording  # the trainer's own scope enters it around the backbone
    trainer.train()
    assert recording.stats["tensors_reloaded"] == recording.stats["tensors_offloaded"] > 0  # its backward ran
    return recording


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_a_gpu_plan_moves_what_the_offloader_moves_to_the_host(checkpointing, tokenizer, gsm8k_rows):
    """The same run with offloading planned for this CPU (nothing moves: the hooks' own bookkeeping only) and for a
    GPU differs by exactly what the offloader moves where the step peaks with every moved tensor away, at the loss
    after the forward: with checkpointing, whose backward recomputes one layer at a time. Without checkpointing the
    backward, holding every layer's activations, brings them back (and two ahead) and may peak there: the drop is
    then less, never more. The host holds the moved tensors' pinned blocks."""
    from leantune.planning import plan_memory

    dataset = cut_rows(gsm8k_rows, ROWS)

    def plan(offloading: bool, device: str = "24GiB"):
        return plan_memory(small_config(), dataset, "sft", processing_class=tokenizer, device=device,
                           measured_step=False, **run_fields(checkpointing, offloading))

    off, on, on_cpu = plan(False), plan(True), plan(True, "cpu")
    run = offloaded_by_the_run(tokenizer, dataset, checkpointing)
    moved = run.stats["bytes_offloaded"]
    assert on.worst.batch in (f"input_ids [{ROWS}, {LENGTH}]", f"input_ids [1, {ROWS * LENGTH}]"), on.worst.batch
    assert moved >= (LAYERS - 1) * ROWS * LENGTH * HIDDEN * 4  # at least every layer's input but the last
    if checkpointing:
        assert on_cpu.peak_bytes - on.peak_bytes == moved  # the device drops by what the hooks move
    else:
        assert 0 < on_cpu.peak_bytes - on.peak_bytes <= moved
    assert on.peak_bytes < off.peak_bytes and on_cpu.activation_host_bytes == off.activation_host_bytes == 0
    assert on.activation_host_bytes == sum(run.blocks) >= moved  # which the host holds in pinned blocks
    assert any("activation offloading: " in line for line in on.lines())


def test_an_extrapolated_plan_equals_the_whole_trace(tokenizer, gsm8k_rows, monkeypatch):
    """A 6-layer model is traced with 2, 3 and 4 layers and extrapolated: each layer adds the same moved bytes to the
    host and takes the same off the device, so the plan equals the trace of all 6 layers, to the byte."""
    from leantune.planning import planner

    config = small_config()
    config.num_hidden_layers = 6

    def plan():
        return planner.plan_memory(config, cut_rows(gsm8k_rows, ROWS), "sft", processing_class=tokenizer,
                                   device="24GiB", measured_step=False, **run_fields(True, True))

    extrapolated = plan()
    assert any("extrapolated" in note for note in extrapolated.notes)
    monkeypatch.setattr(planner, "_layer_count", lambda config: None)  # all 6 layers traced
    whole = plan()
    assert extrapolated.peak_bytes == whole.peak_bytes
    assert extrapolated.activation_host_bytes == whole.activation_host_bytes > 0


@pytest.mark.quick
def test_a_host_that_cannot_hold_the_offloaded_activations_is_refused_naming_both_numbers(tokenizer, gsm8k_rows):
    from leantune.planning import plan_memory

    with pytest.raises(ValueError, match=r"^`activation_offloading` needs ([0-9.]+) GiB of host memory for "
                                         r"offloaded activations, and the host has ([0-9.]+) GiB available; turn "
                                         r"`activation_offloading` off"):
        plan_memory(small_config(), cut_rows(gsm8k_rows, ROWS), "sft", processing_class=tokenizer,
                    device="24GiB", measured_step=False, host_memory=1000, **run_fields(True, True))


def test_a_cpu_plan_moves_nothing_and_equals_the_measured_step(tokenizer, gsm8k_rows):
    """On this CPU the run's offloader has nowhere to copy to (it keeps every tensor): the plan with offloading is the
    plan without, and the real run's MemTracker peak within the plan's 2%."""
    from transformers import LlamaForCausalLM

    from leantune import SFTConfig, SFTTrainer
    from leantune.planning import plan_memory

    from ..fixtures.planning import measured_breakdown

    dataset = cut_rows(gsm8k_rows, 2 * ROWS)
    fields = run_fields(True, True)

    def plan(offloading: bool):
        return plan_memory(small_config(), dataset, "sft", processing_class=tokenizer, device="cpu",
                           **run_fields(True, offloading))

    on = plan(True)
    assert on.activation_host_bytes == 0 and on.peak_bytes >= plan(False).peak_bytes
    torch.manual_seed(0)
    measured = measured_breakdown(SFTTrainer, SFTConfig, LlamaForCausalLM(small_config()).float(), dataset, tokenizer,
                                  fields)
    assert abs(on.measured_step.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes
