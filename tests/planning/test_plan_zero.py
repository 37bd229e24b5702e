"""What the ZeRO plan reads from the DeepSpeed config the run will use (leantune/planning/zero.py). Its numbers are
checked against real 2-process runs in tests/launch/test_scale_out.py (tests/fixtures/launched_plans.py), on the launches made
there anyway; here, the config's reading and the mistakes a user can make, with no launch."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import LlamaConfig

from leantune.memory.checkpoint_offload import unsupported_by_transformers
from leantune.planning.zero import ParameterShapes, rank_terms, zero_settings

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=32000)


def test_deepspeed_config_is_read_as_the_trainer_resolves_it(tmp_path):
    # no config: DeepSpeed's defaults (reduce_bucket_size 5e8), the dtype of --bf16
    default = zero_settings("zero3", {"bf16": True}, 2, CONFIG, torch.float32)
    assert (default.reduce_bucket_size, default.compute_dtype) == (500_000_000, torch.bfloat16)
    # "auto" as transformers fills it for the Trainer: hidden^2; bf16 "auto" follows --bf16
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                                "bf16": {"enabled": "auto"}}))
    auto = zero_settings("zero2", {"deepspeed": str(path)}, 2, CONFIG, torch.float32)
    assert (auto.reduce_bucket_size, auto.compute_dtype, auto.stage) == (64 * 64, torch.float32, 2)
    given = zero_settings("zero3", {"deepspeed": {"zero_optimization": {"reduce_bucket_size": 5e6},
                                                  "bf16": {"enabled": True}}}, 2, CONFIG, torch.float32)
    assert (given.reduce_bucket_size, given.compute_dtype) == (5_000_000, torch.bfloat16)
    with pytest.raises(ValueError, match="`deepspeed`: .* sets ZeRO stage 2, but the engine is zero3"):
        zero_settings("zero3", {"deepspeed": str(path)}, 2, CONFIG, torch.float32)
    with pytest.raises(ValueError, match="`deepspeed`: no DeepSpeed config file at"):
        zero_settings("zero3", {"deepspeed": str(tmp_path / "missing.json")}, 2, CONFIG, torch.float32)


def test_partitions_follow_deepspeeds_padding():
    # 3 parameters of 5, 4 and 1 elements (the last frozen), 2 processes, fp32, SGD with momentum (1 state)
    shapes = ParameterShapes([5, 4, 1], [True, True, False], head=4, embedding=5, backward_order=[4, 5])
    three = zero_settings("zero3", {"deepspeed": {"zero_optimization": {"reduce_bucket_size": 8}}}, 2, CONFIG,
                          torch.float32)
    terms = rank_terms(shapes, three, states_per_element=1.0)
    # ZeRO-3: ceil(numel/N) of every parameter (3 + 2 + 1), master + momentum on the trained ones (3 + 2)
    assert terms.parameters == (3 + 2 + 1) * 4
    assert terms.master_and_states == (3 + 2) * 4 * 2
    assert terms.persistent_gradients == (3 + 2) * 4 + 8 * 4  # partitions + the bucket
    two = zero_settings("zero2", {"deepspeed": {"zero_optimization": {"reduce_bucket_size": 8}}}, 2, CONFIG,
                        torch.float32)
    terms = rank_terms(shapes, two, states_per_element=1.0)
    # ZeRO-2: the 9 trained elements flattened and padded to a multiple of 2 x 2, whole on every rank
    assert terms.parameters == (12 + 1) * 4
    assert terms.master_and_states == 12 // 2 * 4 * 2
    assert terms.persistent_gradients == 0


def test_plan_refuses_a_rank_outside_the_launch():
    from leantune import plan_memory

    with pytest.raises(ValueError, match="`rank`: 2 is not a process of 2"):
        plan_memory(CONFIG, [{"text": "a"}], "sft", num_processes=2, engine="zero3", rank=2)


def test_zero2_backward_holds_the_bucket_not_the_gradients_beside_it():
    from leantune.planning.zero import plan_parts

    # 4 trained parameters met by backward as 6, 3, 2 and 1 elements (12 in all), 2 processes, fp32, SGD + momentum;
    # a backward moment of the trace: 100 bytes of temporaries beside the first gradients (9 elements unless said)
    shapes = ParameterShapes([1, 2, 3, 6], [True] * 4, head=6, embedding=1, backward_order=[6, 3, 2, 1])
    parts = {"parameters": 12 * 4, "optimizer_states": 12 * 4, "activations": 10}
    moment = {**parts, "temporaries": 100}

    def backward(bucket, contiguous=True, accumulated=9):
        zero = {"reduce_bucket_size": bucket, "contiguous_gradients": contiguous}
        settings = zero_settings("zero2", {"deepspeed": {"zero_optimization": zero}}, 2, CONFIG, torch.float32)
        at = {**moment, "gradients": accumulated * 4}
        _, held, name = plan_parts(parts, shapes, settings, 12, torch.float32, 1, True, at)
        assert name == "backward", name
        return held.get("gradients"), held.get("temporaries")

    # each gradient copied into the bucket once accumulated, its own storage freed: the bucket alone (stage_1_and_2.py)
    assert backward(100) == (100 * 4, 100)
    # 6 + 3 overflow a bucket of 8: the first one reduced, the rank's slice kept (12 / 2 elements in fp32)
    assert backward(8) == (8 * 4, 100 + 6 * 4)
    # a gradient larger than the bucket keeps its own storage until the next one reduces it
    assert backward(5, accumulated=6) == (5 * 4 + 6 * 4, 100)
    assert backward(5) == (5 * 4, 100 + 6 * 4)
    # without contiguous gradients there is no bucket: each gradient is its own tensor until reduced
    assert backward(100, contiguous=False) == (9 * 4, 100)


@pytest.mark.quick
def test_zero_offload_keeps_the_master_weights_states_and_fp32_gradients_on_the_host():
    """ZeRO-Offload on one GPU (examples/accelerate/zero2_offload.yaml: `offload_optimizer.device` cpu): the device
    holds no fp32 master, optimizer state or fp32 gradient partition; the host holds them (plan note)."""
    from leantune.planning.zero import host_bytes, reduce_moment

    shapes = ParameterShapes([5, 4, 1], [True, True, False], head=4, embedding=5, backward_order=[4, 5])
    zero = {"reduce_bucket_size": 2}  # smaller than the trained parameters: the fp32 partition moment
    kept = zero_settings("zero2", {"deepspeed": {"zero_optimization": zero}}, 1, CONFIG, torch.bfloat16)
    offload = zero_settings("zero2", {"deepspeed": {"zero_optimization": {
        **zero, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}}, 1, CONFIG, torch.bfloat16)
    assert offload.offload_optimizer and not kept.offload_optimizer
    on_device, offloaded = rank_terms(shapes, kept, 2.0), rank_terms(shapes, offload, 2.0)  # AdamW: 2 states
    assert on_device.master_and_states == 10 * 4 * 3 and offloaded.master_and_states == 0  # 9 trained, padded to 10
    assert offloaded.parameters == on_device.parameters  # the bf16 weights stay on the device
    assert host_bytes(shapes, offload, 2.0) == 10 * 4 * (1 + 2 + 1) and host_bytes(shapes, kept, 2.0) == 0
    # the end of backward: the fp32 gradient partition the update reads is on the host too
    assert reduce_moment(on_device, shapes, kept, 0, False).get("temporaries") == 10 * 4
    assert not reduce_moment(offloaded, shapes, offload, 0, False).get("temporaries")


HOST_NEEDS = re.compile(r"needs ([0-9.]+) GiB of host memory \(([0-9.]+) GiB for ZeRO-Offload's .*\), and the host has "
                        r"([0-9.]+) GiB available")


def zero_offload_plan(tokenizer, gsm8k_rows, host_memory, **fields):
    """The plan of a ZeRO-2 run with its optimizer states offloaded to the CPU (ZeRO-Offload), the host `host_memory`."""
    from leantune.planning import plan_memory

    from ..fixtures.data import gsm8k_prompt_completion

    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    return plan_memory(CONFIG, gsm8k_prompt_completion(gsm8k_rows, 2), "sft", processing_class=tokenizer,
                       engine="zero2", deepspeed=offload, max_length=64, per_device_train_batch_size=2,
                       measured_step=False, host_memory=host_memory, **fields)


def zero_host_gib(tokenizer, gsm8k_rows) -> float:
    """What the plan's note says ZeRO-Offload's states hold on the host, in GiB."""
    note = next(n for n in zero_offload_plan(tokenizer, gsm8k_rows, "128GiB").notes
                if n.startswith("host memory (ZeRO-Offload"))
    return float(re.search(r"([0-9.]+) GiB", note).group(1))


def test_zero_offloads_host_bytes_are_held_to_the_host(tokenizer, gsm8k_rows):
    """ZeRO-Offload's host bytes (the plan's note) feed the host check as checkpoint offload's do: a host that cannot
    hold them is refused in one line naming both numbers."""
    host = zero_host_gib(tokenizer, gsm8k_rows)
    assert host > 0
    with pytest.raises(ValueError, match=HOST_NEEDS) as caught:
        zero_offload_plan(tokenizer, gsm8k_rows, f"{int(host * 2**30) // 2}B")  # half of what the states need
    needed, zero, available = map(float, HOST_NEEDS.search(str(caught.value)).groups())
    assert needed == zero == pytest.approx(host, abs=0.01) and available < needed and "\n" not in str(caught.value)


@pytest.mark.skipif(unsupported_by_transformers() is not None,
                    reason="checkpoint offload is refused on this transformers (memory/checkpoint_offload.py)")
def test_zero_offloads_host_bytes_are_held_to_the_host_beside_checkpoint_offloads(tokenizer, gsm8k_rows):
    """Beside the offloaded layer inputs, the host must hold both: one that holds the states and half the inputs is
    refused, naming the inputs."""
    host = zero_host_gib(tokenizer, gsm8k_rows)
    fields = {"checkpoint_offload_layers": 1, "gradient_checkpointing": True}
    inputs = zero_offload_plan(tokenizer, gsm8k_rows, "128GiB", **fields).offload.host_bytes
    assert inputs > 0
    with pytest.raises(ValueError, match=HOST_NEEDS) as caught:
        zero_offload_plan(tokenizer, gsm8k_rows, f"{int(host * 2**30) + inputs // 2}B", **fields)
    assert "for `checkpoint_offload_layers`' inputs" in str(caught.value)


def test_a_run_whose_zero_offload_the_host_cannot_hold_is_refused_before_loading():
    """The run's own check, before any weight loads (trainers/base.py): a 70B full fine-tune's fp32 master weights and
    Adam states under ZeRO-Offload (~1 TiB) against this machine's memory, refused in one line naming both numbers;
    the same run training LoRA adapters keeps a few MiB on the host, and passes."""
    from types import SimpleNamespace

    from peft import LoraConfig

    from leantune import SFTTrainer
    from leantune.planning.checkpoint_offload_plan import refuse_run_before_loading

    from ..fixtures.planning import LLAMA_3_70B

    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    model = LlamaConfig(**LLAMA_3_70B)
    args = SimpleNamespace(deepspeed=offload, bf16=True, fp16=False, use_cpu=True, model_init_kwargs=None,
                           checkpoint_offload_layers=None, per_device_train_batch_size=1, max_length=64)
    with pytest.raises(ValueError, match=HOST_NEEDS) as caught:
        refuse_run_before_loading(SFTTrainer, model, args)
    needed, zero, available = map(float, HOST_NEEDS.search(str(caught.value)).groups())
    assert needed == zero > 1000 > available and "\n" not in str(caught.value)
    lora = LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM")
    refuse_run_before_loading(SFTTrainer, model, args, lora)  # adapters: nothing to refuse
    refuse_run_before_loading(SFTTrainer, model, SimpleNamespace(**{**vars(args), "deepspeed": None}))
