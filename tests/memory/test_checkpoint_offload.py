"""Checkpoint offload (memory/checkpoint_offload.py, planning/checkpoint_offload_plan.py): the checkpointed inputs of
the first N decoder layers leave the device and come back for their recompute; losses and gradients are those of the
run without it, the plan counts the device's drop and the host's bytes, and a host that cannot hold them is refused
in one line naming both numbers.

Tolerance (bit-equal): the offload copies each layer input out and back (`copy_` of the same dtype: no arithmetic,
no conversion), and the recompute, the backward and the optimizer run the same kernels on the same values in the same
order. So every per-token loss and every gradient is compared with `torch.equal`, for any OMP_NUM_THREADS (each side
runs the same kernels on the same thread count); a relative tolerance derived from the magnitude would be 0 here.
"""

from __future__ import annotations

import copy
import re
import weakref

import pytest
import torch

from leantune.memory.checkpoint_offload import (
    decoder_layers,
    install_checkpoint_offload,
    pinned_bytes,
    remove_checkpoint_offload,
    unsupported_by_transformers,
)
from leantune.models.checkpointing import enable_model_checkpointing

from ..fixtures.comparisons import GradientRecorder, token_nll
from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import saved_model_and_data

LAYERS, HIDDEN = 4, 64
NEEDS = re.compile(r"needs ([0-9.]+) GiB of host memory .* has ([0-9.]+) GiB available")


# The offload's hooks must run outside each layer's checkpoint (test_checkpoint_offload_versions.py checks both cases)
pytestmark = pytest.mark.skipif(unsupported_by_transformers() is not None,
                                reason="this transformers checkpoints each layer's whole call: refused (see the test "
                                       "of the versions)")


def small_model(seed: int = 0):
    """A 4-layer Llama of random fp32 weights (4 layers: some offloaded, some kept, and traced whole by the plan)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")).float()


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def step(model, ids, reentrant: bool):
    """Per-token losses and every gradient of one forward and backward under gradient checkpointing."""
    model.train()
    enable_model_checkpointing(model, {"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()  # a LoRA model's frozen embeddings: reentrant checkpointing needs it
    logits = model(input_ids=ids, use_cache=False).logits
    losses = token_nll(logits.float(), ids)
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bit_equal(got, expected) -> None:
    (losses, grads), (losses_ref, grads_ref) = got, expected
    assert torch.equal(losses, losses_ref)  # per token
    assert grads.keys() == grads_ref.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ref[name]), name


@pytest.mark.quick
@pytest.mark.parametrize("reentrant", [False, True])
def test_offloaded_inputs_leave_the_device_and_gradients_are_bit_equal(reentrant):
    base = small_model()
    ids = torch.randint(3, 32000, (2, 48), generator=torch.Generator().manual_seed(0))
    reference = step(copy.deepcopy(base), ids, reentrant)
    model = copy.deepcopy(base)
    offloader = install_checkpoint_offload(model, 2)
    inputs = []  # each layer's hidden-states input, weakly: an offloaded one must be freed on the device
    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(weakref.ref(args[0])),
                                        with_kwargs=True)
    model.train()
    enable_model_checkpointing(model, {"use_reentrant": reentrant})
    logits = model(input_ids=ids, use_cache=False).logits
    assert [ref() is None for ref in inputs] == [True, True, False, False]  # the first 2 live on the host only
    input_bytes = 2 * 48 * HIDDEN * 4
    assert offloader.ledger.bytes == 2 * input_bytes
    losses = token_nll(logits.float(), ids)
    losses.sum().backward()
    got = (losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert_bit_equal(got, reference)
    assert offloader.stats == {"inputs_offloaded": 2, "bytes_offloaded": 2 * input_bytes, "inputs_prefetched": 1}
    assert offloader.ledger.bytes == 0 and offloader.ledger.peak_bytes == 2 * input_bytes


@pytest.mark.parametrize("reentrant", [False, True])
def test_lora_adapters_get_bit_equal_gradients(reentrant):
    base = with_lora(small_model())
    ids = torch.randint(3, 32000, (2, 40), generator=torch.Generator().manual_seed(1))
    reference = step(copy.deepcopy(base), ids, reentrant)
    model = copy.deepcopy(base)
    offloader = install_checkpoint_offload(model, -1)  # every layer but the last
    assert_bit_equal(step(model, ids, reentrant), reference)
    assert offloader.stats["inputs_offloaded"] == LAYERS - 1


def test_auto_offloads_what_the_host_holds_and_never_the_last_layer():
    model = small_model()
    input_bytes = 1 * 16 * HIDDEN * 4
    offloader = install_checkpoint_offload(model, None, host_limit=int(2.5 * input_bytes / 0.9))  # room for 2
    step(model, torch.randint(3, 32000, (1, 16)), False)
    assert offloader.layers == 2 and offloader.stats["inputs_offloaded"] == 2
    roomy = install_checkpoint_offload(model, None, host_limit=1 << 40)
    step(model, torch.randint(3, 32000, (1, 16)), False)
    assert roomy.layers == LAYERS - 1
    remove_checkpoint_offload(model)
    assert not hasattr(model, "checkpoint_offloader")


def test_a_host_that_cannot_hold_the_inputs_stops_the_copy_in_one_line():
    model = small_model()
    install_checkpoint_offload(model, 2, host_limit=1000)
    with pytest.raises(ValueError, match=NEEDS) as caught:
        step(model, torch.randint(3, 32000, (1, 16)), False)
    assert "\n" not in str(caught.value)


def test_more_layers_than_the_model_has_is_refused_in_one_line():
    with pytest.raises(ValueError, match="4 decoder layers"):
        install_checkpoint_offload(small_model(), 5)


def test_pinned_blocks_round_to_a_power_of_two():
    assert [pinned_bytes(size) for size in (0, 1, 4096, 4097, 3 << 30)] == [0, 1, 4096, 8192, 4 << 30]


# --- the config: one field, refused where it cannot work -------------------------------------------------------------

@pytest.mark.parametrize("fields, named", [
    (dict(gradient_checkpointing=False), "gradient_checkpointing=False"),
    (dict(activation_offloading=True), "activation_offloading=True"),
    (dict(checkpoint_offload_layers="some"), "must be a number of decoder layers"),
])
def test_combinations_that_cannot_work_are_refused_when_the_config_is_built(fields, named, tmp_path):
    from leantune import SFTConfig

    settings = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, checkpoint_offload_layers=2)
    with pytest.raises(ValueError, match=re.escape(named)) as caught:
        SFTConfig(**{**settings, **fields})
    assert "\n" not in str(caught.value)


def test_the_command_line_spellings_become_a_count_or_auto(tmp_path):
    from leantune import SFTConfig
    from leantune.trainers.settings import checkpoint_offload_of

    def settings(value):
        return checkpoint_offload_of(SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                               checkpoint_offload_layers=value))

    assert settings("3").layers == 3 and settings("-1").layers == -1 and settings(" Auto").auto
    assert not settings(None).enabled and not settings("0").enabled


# --- the trainers: offload on equals off, real optimizer steps --------------------------------------------------------

def sft(tokenizer, rows, tmp_path, layers, peft: bool = False, **overrides):
    from leantune import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, max_steps=2,
                     per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, seed=0, disable_tqdm=True,
                     memory_breakdown=False, max_grad_norm=0.0, max_length=128, checkpoint_offload_layers=layers,
                     **overrides)
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    return SFTTrainer(model=small_model(), args=args, train_dataset=gsm8k_prompt_completion(rows, 8),
                      processing_class=tokenizer, peft_config=peft_config)


def trained(trainer):
    """(the first step's gradients, the trained parameters, every step's logged loss)."""
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return recorder.grads, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, losses


@pytest.mark.parametrize("case", [
    dict(),
    dict(peft=True),
    dict(packing=True, padding_free=True),
    dict(gradient_checkpointing_kwargs={"use_reentrant": True}),
])
def test_sft_trains_bit_equal_with_the_offload(case, tokenizer, gsm8k_rows, tmp_path):
    on = sft(tokenizer, gsm8k_rows, tmp_path / "on", 2, **case)
    assert on.model.checkpoint_offloader.layers == 2
    on_grads, on_params, on_losses = trained(on)
    off_grads, off_params, off_losses = trained(sft(tokenizer, gsm8k_rows, tmp_path / "off", None, **case))
    assert on.model.checkpoint_offloader.stats["inputs_offloaded"] == 2 * 2  # 2 layers, 2 steps
    assert on_losses == off_losses and len(on_losses) == 2
    for name, grad in off_grads.items():
        assert torch.equal(on_grads[name], grad), name
    for name, param in off_params.items():  # after two real optimizer steps
        assert torch.equal(on_params[name], param), name


def test_a_run_the_host_cannot_hold_is_refused_before_its_weights_load(tmp_path):
    """The model is a folder with config.json only: loading it would fail otherwise; the refusal comes first."""
    from leantune import SFTConfig, SFTTrainer

    small_model().config.save_pretrained(tmp_path / "config_only")
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_length=1 << 20,
                     per_device_train_batch_size=1024, checkpoint_offload_layers=2)
    with pytest.raises(ValueError, match=NEEDS) as caught:
        SFTTrainer(model=str(tmp_path / "config_only"), args=args,
                   train_dataset=gsm8k_prompt_completion([{"question": "q", "answer": "a"}], 1))
    needed, available = map(float, NEEDS.search(str(caught.value)).groups())
    assert needed == pytest.approx(2 * 1024 * (1 << 20) * HIDDEN * 4 / 2**30, rel=1e-3) and needed > available


# --- the plan: the device's drop and the host's bytes -----------------------------------------------------------------

def test_the_plan_counts_device_and_host_bytes_and_matches_the_cpu_allocator(tokenizer, gsm8k_rows):
    """The fake step runs the offload: on a GPU plan the device's peak drops by the offloaded inputs, which the host
    holds in pinned blocks. On this CPU the host is the device: the plan counts them on it as before, and equals the
    real run's MemTracker peak (the copies replace the inputs) within the plan's 2%."""
    from leantune import SFTConfig, SFTTrainer
    from leantune.planning import plan_memory

    from ..fixtures.planning import measured_breakdown

    dataset = gsm8k_prompt_completion(gsm8k_rows, 8)
    fields = dict(per_device_train_batch_size=4, max_length=128)
    model = small_model()

    def plan(**more):
        return plan_memory(model.config, dataset, "sft", processing_class=tokenizer, **fields, **more)

    off, on = plan(device="24GiB"), plan(device="24GiB", checkpoint_offload_layers=2)
    offload = on.offload
    assert off.offload is None and offload.layers == 2
    assert offload.input_bytes % (HIDDEN * 4) == 0 and offload.input_bytes >= 4 * 32 * HIDDEN * 4  # 4 rows, fp32
    assert off.peak_bytes - on.peak_bytes == 2 * offload.input_bytes  # the device drops by the inputs moved
    assert offload.host_bytes == 2 * pinned_bytes(offload.input_bytes)  # which the host holds, pinned
    assert any("checkpoint offload: the inputs of 2 of 4" in line for line in on.lines())
    on_cpu = plan(checkpoint_offload_layers=2)
    assert on_cpu.peak_bytes == plan().peak_bytes and on_cpu.offload.host_bytes == 2 * offload.input_bytes
    measured = measured_breakdown(SFTTrainer, SFTConfig, model, dataset, tokenizer,
                                  {**fields, "checkpoint_offload_layers": 2})
    assert abs(on_cpu.measured_step.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes


def test_a_plan_the_host_cannot_hold_is_refused_naming_both_numbers(tokenizer, gsm8k_rows):
    from leantune.planning import plan_memory

    with pytest.raises(ValueError, match=NEEDS):
        plan_memory(small_model().config, gsm8k_prompt_completion(gsm8k_rows, 4), "sft", processing_class=tokenizer,
                    per_device_train_batch_size=4, max_length=128, checkpoint_offload_layers=2, host_memory=1000)


def test_the_plan_command_holds_the_offload_to_the_host_memory_given(tokenizer, gsm8k_rows, tmp_path, capsys):
    """`leantune plan --host_memory`: the machine the run is planned for (the H200's 128 GiB from this one); one that
    cannot hold the offloaded inputs is a one-line refusal naming both numbers, exit 2."""
    from leantune.cli.main import main

    model_dir, data_file = saved_model_and_data(tmp_path, tokenizer, gsm8k_rows[:8])
    argv = ["plan", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--max_length", "128",
            "--per_device_train_batch_size", "4", "--checkpoint_offload_layers", "2"]
    assert main([*argv, "--host_memory", "1000B"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]  # the rest: progress bars of the data's reading
    assert len(errors) == 1 and NEEDS.search(errors[0]) and "Traceback" not in err, err
    assert main([*argv, "--host_memory", "128GiB"]) == 0


def test_an_extrapolated_plan_equals_the_whole_trace(tokenizer, gsm8k_rows, monkeypatch):
    """A 6-layer model is traced with 2, 3 and 4 layers, each offloading all but its last, and extrapolated; the 3
    layers the run keeps add their inputs back. Here (the peak before those layers' backward) that is the trace of
    all 6 layers with 3 offloaded, to the byte."""
    from transformers import LlamaConfig

    from leantune.planning import planner

    config = LlamaConfig(vocab_size=32000, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

    def plan():
        return planner.plan_memory(config, gsm8k_prompt_completion(gsm8k_rows, 4), "sft", processing_class=tokenizer,
                                   per_device_train_batch_size=4, max_length=128, checkpoint_offload_layers=3,
                                   device="24GiB", measured_step=False)

    extrapolated = plan()
    assert any("extrapolated" in note for note in extrapolated.notes)
    monkeypatch.setattr(planner, "_layer_count", lambda config: None)  # all 6 layers traced
    whole = plan()
    assert extrapolated.offload.kept_added_bytes == 2 * extrapolated.offload.input_bytes > 0
    assert extrapolated.peak_bytes == whole.peak_bytes
    assert extrapolated.offload.host_bytes == whole.offload.host_bytes


def test_auto_is_the_fewest_layers_that_fit_the_budget(tokenizer, gsm8k_rows):
    """What `--memory_budget` turns on (planning/recommend.py's technique, value "auto"): the plan records the fewest
    layers whose device total fits the budget, and that number, planned on its own, fits while one fewer does not."""
    from leantune.planning import plan_memory

    config = small_model().config
    dataset = gsm8k_prompt_completion(gsm8k_rows, 4)

    def plan(layers, device):
        return plan_memory(config, dataset, "sft", processing_class=tokenizer, per_device_train_batch_size=4,
                           max_length=128, checkpoint_offload_layers=layers, device=device, measured_step=False)

    most = plan(LAYERS - 1, "80GiB")  # the device terms (CUDA context, segments) are the same for any GPU size
    input_bytes = most.offload.input_bytes
    budget = most.device_total_bytes + input_bytes + input_bytes // 2  # room for one kept input more, not two
    device = f"{budget / 2**20}MiB"
    chosen = plan("auto", device)
    assert chosen.offload.layers == LAYERS - 2 and chosen.config["checkpoint_offload_layers"] == LAYERS - 2
    assert chosen.device_total_bytes <= budget < plan(LAYERS - 3, device).device_total_bytes


@pytest.mark.quick
def test_in_the_planners_fake_step_an_input_comes_back_fake():
    """The plan's fake step: an offloaded input comes back as a fake tensor of its shape (the device memory a copy back
    takes, counted by the trace), never as a real tensor; at 500,000 tokens of an 8B model a real one is 3.8 GiB of
    this machine's memory per layer (the plan was killed for memory)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from leantune.memory.checkpoint_offload import CheckpointOffloader, _Offloaded
    from leantune.planning.planned_run import planning_session

    with planning_session() as mode:
        with mode.building():
            hidden = torch.empty(2, 16, HIDDEN).as_strided((2, 16, HIDDEN), (16 * HIDDEN, HIDDEN, 1))
        back, event = CheckpointOffloader(1)._copy_in(_Offloaded(hidden, 0), prefetch=False)
    assert isinstance(back, FakeTensor) and event is None
    assert back.shape == hidden.shape and back.stride() == hidden.stride() and back.dtype == hidden.dtype


def test_the_plans_fake_step_is_held_to_the_host_planned_for_not_this_machine(tokenizer, gsm8k_rows):
    """The run's own refusal before loading reads this machine's memory at `max_length`; the plan's fake step builds
    the trainer too, and must leave the host to the plan (`host_memory`): a row of a billion tokens allowed is
    planned at the data's rows for a host that holds it, never refused for this machine's few GiB."""
    from leantune.planning import plan_memory

    planned = plan_memory(small_model().config, gsm8k_prompt_completion(gsm8k_rows, 2), "sft",
                          processing_class=tokenizer, per_device_train_batch_size=1, max_length=10**9,
                          checkpoint_offload_layers=2, host_memory="1TiB", measured_step=False)
    assert planned.offload.layers == 2 and 0 < planned.offload.host_bytes < 2**20
