"""`leantune plan` for QLoRA (bitsandbytes 4/8-bit base weights): the plan of a tiny QLoRA SFT step equals the step a
real bitsandbytes run measures, part by part; the measured parameters are bitsandbytes' packed layout byte for byte
(quantization states included); the weight dequantized inside bitsandbytes' fused 4-bit matmul is counted; a 4-bit
Llama-3-70B plans from its config alone."""

from __future__ import annotations

import contextlib
import io
import json
import math
import resource
import time

import pytest
import torch

from leantune.planning import plan_memory
from leantune.utils.imports import is_available

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model
from ..fixtures.planning import LLAMA_3_70B

pytestmark = pytest.mark.skipif(not is_available("bitsandbytes"), reason="needs leantune[bitsandbytes]")

NF4_DOUBLE = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}


def all_linear_lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def expected_quantized_bytes(module) -> int:
    """bitsandbytes 0.50's layout of one quantized linear layer, from its shape alone (functional.quantize_4bit,
    quantize_blockwise, int8_vectorwise_quant)."""
    import bitsandbytes as bnb

    out_features, in_features = module.out_features, module.in_features
    n = out_features * in_features
    if isinstance(module, bnb.nn.Linear8bitLt):
        return n + 4 * out_features  # int8 rows + one float32 scale per row
    blocks = math.ceil(n / 64)  # 64 values per block
    size = n // 2 + 16 * 4  # two values a byte + the 16-entry float32 code table
    if module.weight.quant_state.nested:  # 8-bit block scales, their float32 scales per 256, offset, 256-entry code
        return size + blocks + 4 * math.ceil(blocks / 256) + 4 + 256 * 4
    return size + 4 * blocks  # float32 block scales


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan-qlora") / "tiny-llama"
    tiny_model("llama").save_pretrained(path)
    return path


def test_qlora_plan_equals_the_measured_step(model_dir, tokenizer, gsm8k_rows, quantization=NF4_DOUBLE):
    """4-bit nf4 with double quantization (8-bit, fp4, DPO, GRPO: bench/plan_accuracy.py's qlora rows)."""
    import bitsandbytes as bnb

    from leantune import SFTConfig, SFTTrainer

    dataset = gsm8k_prompt_completion(gsm8k_rows, 8)
    fields = dict(per_device_train_batch_size=2, max_length=96)
    plan = plan_memory(tiny_model("llama").config, dataset, "sft", processing_class=tokenizer,
                       peft_config=all_linear_lora(), quantization_config=quantization, **fields)
    args = SFTConfig(output_dir="/tmp/leantune-test-plan-qlora", use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True, memory_breakdown=True, max_steps=2,
                     model_init_kwargs={"quantization_config": quantization}, **fields)
    trainer = SFTTrainer(model=str(model_dir), args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=all_linear_lora())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    measured, predicted = trainer.memory_breakdown, plan.measured_step

    quantized = [m for m in trainer.model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    assert len(quantized) == 14  # 7 linear layers in each of 2 blocks; the output head stays fp32 (transformers)
    plain = sum(p.numel() * p.element_size() for name, p in trainer.model.named_parameters()
                if not name.endswith("base_layer.weight"))
    # the measured parameters are the packed weights with their quantization states, to the byte
    assert measured.parts["parameters"] == plain + sum(expected_quantized_bytes(m) for m in quantized)
    # Both numbers are MemTracker's sums of the byte sizes of the same tensors (real in the run, fake in the plan):
    # they agree to the byte (docs/benchmarks.md); 2% of the peak is the bound the plan promises, per part too.
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes
    for part in set(measured.parts) | set(predicted.parts):
        assert abs(predicted.parts.get(part, 0) - measured.parts.get(part, 0)) <= 0.02 * measured.peak_bytes, part
    assert plan.num_parameters == sum(p.numel() for p in tiny_model("llama").parameters()) + \
        plan.trainable_parameters  # a 4-bit weight counts the parameters it packs


def test_the_weight_dequantized_inside_the_fused_4bit_matmul_is_counted():
    """bitsandbytes' forward op dequantizes the whole weight inside one op; the meter must see that temporary."""
    import bitsandbytes as bnb

    from leantune.metrics.memory_breakdown import StepMemoryMeter

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(256, 1024, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(1024, 256), requires_grad=False, quant_type="nf4").to("cpu")
    layer.support_avx512bf16_for_cpu = False  # the training path (models/loading.py keep_4bit_layers_trainable)
    inputs = torch.randn(2, 256)
    meter = StepMemoryMeter("cpu")
    meter.start(layer)
    with torch.no_grad():
        output = layer(inputs)
    breakdown = meter.stop(1)
    weight = 1024 * 256 * 4  # the fp32 dequantized weight
    scales = 1024 * 256 // 64 * 4  # the block scales, dequantized from 8 bits to fp32 first (double quantization)
    # peak = packed weight with its states (a parameter) + output + the op's two temporaries, exact byte counts (the
    # input was made before the meter started); without the decomposition the temporaries, 1.0 MiB, are missed
    assert breakdown.peak_bytes == expected_quantized_bytes(layer) + output.nbytes + weight + scales
    assert breakdown.parts["activations"] == output.nbytes + weight + scales


def test_a_4bit_70b_plans_from_config_only(tmp_path, tokenizer, gsm8k_rows):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_70B))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu_started = time.process_time()  # CPU time, not wall time: the machine may be shared
    plan = plan_memory(str(tmp_path), gsm8k_prompt_completion(gsm8k_rows, 8), "sft", processing_class=tokenizer,
                       peft_config=all_linear_lora(), per_device_train_batch_size=1, max_length=64,
                       measured_step=False, max_batches=1, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                       bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="bfloat16",
                       model_init_kwargs={"dtype": "bfloat16"}, bf16=True)
    cpu_seconds = time.process_time() - cpu_started
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 1024  # no weight allocated
    hidden, inner, vocab, layers = 8192, 28672, 128256, 80
    per_layer = [(hidden, hidden), (1024, hidden), (1024, hidden), (hidden, hidden)] + [(inner, hidden)] * 3
    quantized = 0
    for out_features, in_features in per_layer:
        n, blocks = out_features * in_features, out_features * in_features // 64
        quantized += n // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 + 256 * 4 + 16 * 4
    lora = sum(4 * (out_features + in_features) for out_features, in_features in per_layer)
    # the unquantized weights (embeddings, head, norms) stay in the loaded dtype, bf16 (no fp32 cast: loading.py)
    unquantized = 2 * (2 * vocab * hidden + (2 * layers + 1) * hidden)
    expected = layers * (quantized + 4 * lora) + unquantized
    assert plan.worst.parts["parameters"] == expected  # ~0.53 byte a quantized parameter: 41.5 GiB
    assert abs(plan.num_parameters - plan.trainable_parameters - 70.55e9) < 0.01e9
    assert plan.trainable_parameters == layers * lora
    assert cpu_seconds < 60


@pytest.mark.quick
def test_quantization_fields_that_cannot_apply_are_named(tokenizer, gsm8k_rows):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 2)
    config = tiny_model("llama").config
    with pytest.raises(ValueError, match="`bnb_4bit_quant_type` has no effect without `load_in_4bit`"):
        plan_memory(config, dataset, "sft", processing_class=tokenizer, bnb_4bit_quant_type="nf4")
    with pytest.raises(ValueError, match="`load_in_4bit` and a `quantization_config` are both given"):
        plan_memory(config, dataset, "sft", processing_class=tokenizer, load_in_4bit=True,
                    model_init_kwargs={"quantization_config": NF4_DOUBLE})
