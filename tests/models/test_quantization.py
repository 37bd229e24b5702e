"""4/8-bit base weights (bitsandbytes) with LoRA on whatever device bitsandbytes runs on, CPU included.

A QLoRA step must compute the gradients of an fp32 model holding the dequantised base weights: bitsandbytes'
differentiable paths dequantise each weight to the compute dtype (fp32 here) and run an ordinary matmul, forward and
backward. Tolerance: per tensor, 1e-5 of the tensor's largest entry. The two models run the same fp32 operations on
the same values (measured difference 0 for 4-bit and for 8-bit, whose reference dequantises in bitsandbytes' order
of operations), so only fp32 rounding of sums taken in another order (another thread count, another kernel) could
differ, which is bounded by the magnitude of the largest terms summed, i.e. by the tensor's largest entry, not by
each entry.

The trap this file guards: on a CPU with AVX512-BF16, a 4-bit layer that runs once in eval mode without gradient
(right after from_pretrained, an evaluation, a generation or reference pass) repacks its weights for inference, and
every later forward goes through a kernel without backward: the LoRA gradients silently go wrong.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from leantune.utils.imports import is_available

from ..fixtures.comparisons import GradientRecorder
from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

needs_bnb = pytest.mark.skipif(not is_available("bitsandbytes"), reason="needs leantune[bitsandbytes]")

QUANT = {4: {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, 8: {"load_in_8bit": True}}
HH_PAIRS_ROWS = 8


def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return "avx512_bf16" in handle.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Llama saved to disk (from_pretrained with a quantization_config needs a path). Its linear layers'
    dimensions (64, 128, 32) are multiples of bitsandbytes' 4-bit block (64 values) and of the 32-row tiles of the
    CPU repacking, so the trap below can fire."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("quant") / "tiny-llama"
    tiny_model().save_pretrained(path)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(path)
    return path


def lora(init_random: bool = False):
    from peft import LoraConfig

    # random B (init_lora_weights=False): every LoRA matrix gets a nonzero gradient, so all 28 are compared
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                      init_lora_weights=not init_random)


def settings(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, max_steps=2,
                per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, seed=0, disable_tqdm=True,
                memory_breakdown=False, gradient_checkpointing=True, max_length=128)
    base.update(overrides)
    return base


def dequantised_weight(module) -> torch.Tensor:
    import bitsandbytes as bnb

    weight = module.weight
    if isinstance(module, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if isinstance(module, bnb.nn.Linear8bitLt):  # row-wise absmax int8: W = CB * (SCB / 127), bitsandbytes' order
        return weight.data.float() * (weight.SCB.float()[:, None] * (1.0 / 127.0))
    return weight.data.float()


def fp32_twin(quantised_trainer, model_dir, auto_class=None):
    """An fp32 model from the same checkpoint holding the quantised model's dequantised weights."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    reference = (auto_class or AutoModelForCausalLM).from_pretrained(str(model_dir), dtype=torch.float32,
                                                                     **({"num_labels": 1} if auto_class else {}))
    quantised = {name.replace("base_model.model.", "", 1).replace(".base_layer", ""): module
                 for name, module in quantised_trainer.model.named_modules()
                 if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}
    assert quantised, "no bitsandbytes layer in the quantised model"
    for name, module in reference.named_modules():
        if name in quantised:
            module.weight.data.copy_(dequantised_weight(quantised.pop(name)).reshape(module.weight.shape))
    assert not quantised, f"layers without a twin: {sorted(quantised)}"
    return reference


def copy_adapter(source, target) -> None:
    adapter = {name: p for name, p in source.named_parameters() if p.requires_grad}
    for name, p in target.named_parameters():
        if p.requires_grad:
            p.data.copy_(adapter.pop(name).data)
    assert not adapter


def first_step_grads(trainer):
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    result = trainer.train()
    return recorder.grads, result.metrics["train_loss"]


def assert_grads_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys() and len(expected) >= 28
    for name, reference in expected.items():
        assert float(reference.abs().max()) > 0, name
        torch.testing.assert_close(got[name], reference, rtol=0, atol=1e-5 * float(reference.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def sft_pair(bits, model_dir, gsm8k_rows, tmp_path, evaluate_first=False):
    """First-step LoRA gradients of a 4/8-bit SFT run and of its fp32 twin."""
    from leantune import SFTConfig, SFTTrainer

    data = gsm8k_prompt_completion(gsm8k_rows, 8)
    extra = dict(eval_dataset=data) if evaluate_first else {}
    quantised = SFTTrainer(model=str(model_dir), train_dataset=data, peft_config=lora(True), **extra,
                           args=SFTConfig(**settings(tmp_path / "q", max_steps=1, max_grad_norm=0.0,
                                                     model_init_kwargs={"quantization_config": QUANT[bits]})))
    twin = fp32_twin(quantised, model_dir)  # before any forward of the quantised model
    reference = SFTTrainer(model=twin, train_dataset=data, peft_config=lora(True), **extra,
                           args=SFTConfig(**settings(tmp_path / "r", max_steps=1, max_grad_norm=0.0)))
    copy_adapter(quantised.model, reference.model)
    if evaluate_first:  # eval mode, no grad: the trigger of the CPU repacking
        quantised.evaluate()
        reference.evaluate()
    return first_step_grads(quantised), first_step_grads(reference)


@needs_bnb
@pytest.mark.parametrize("bits", [4, 8])
def test_sft_lora_gradients_equal_the_dequantised_fp32_model(bits, model_dir, gsm8k_rows, tmp_path):
    (got, loss), (expected, reference_loss) = sft_pair(bits, model_dir, gsm8k_rows, tmp_path)
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert_grads_equal(got, expected)


@needs_bnb
@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the CPU lacks AVX512-BF16: bitsandbytes never repacks")
def test_an_evaluation_before_training_leaves_4bit_gradients_exact(model_dir, gsm8k_rows, tmp_path):
    """Without leantune's guard (`keep_4bit_layers_trainable`) the evaluation repacks every 4-bit layer and this fails
    (measured: every entry of layer 0's q_proj lora_A gradient differs, by up to 1.1e-2 where 2.9e-7 is allowed)."""
    (got, _), (expected, _) = sft_pair(4, model_dir, gsm8k_rows, tmp_path, evaluate_first=True)
    assert_grads_equal(got, expected)


@needs_bnb
@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the CPU lacks AVX512-BF16: bitsandbytes never repacks")
def test_a_model_object_repacked_before_the_trainer_is_unpacked(model_dir, gsm8k_rows, tmp_path, caplog):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from leantune import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), quantization_config=BitsAndBytesConfig(**QUANT[4]),
                                                 device_map={"": "cpu"})
    with torch.no_grad():  # eval mode, as from_pretrained returns it: bitsandbytes repacks
        model(input_ids=torch.tensor([[1, 5, 9, 13]]))
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.weight.quant_state.packing_format_for_cpu
    with caplog.at_level("WARNING", logger="leantune.models"):
        trainer = SFTTrainer(model=model, train_dataset=gsm8k_prompt_completion(gsm8k_rows, 8), peft_config=lora(),
                             args=SFTConfig(**settings(tmp_path, max_steps=1)))
    assert "repacked by bitsandbytes for CPU inference" in caplog.text
    assert not layer.weight.quant_state.packing_format_for_cpu and not layer.support_avx512bf16_for_cpu
    assert math.isfinite(trainer.train().metrics["train_loss"])


@needs_bnb
def test_a_4bit_model_that_already_has_its_adapter_trains_without_peft_config(model_dir, gsm8k_rows, tmp_path):
    """TRL trains a PeftModel over a 4-bit base given as the model (its adapter attached by the user); leantune
    refused it ("only through an adapter: pass peft_config") though the adapter was there. Only the adapter moves."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from leantune import SFTConfig, SFTTrainer

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), quantization_config=BitsAndBytesConfig(**QUANT[4]),
                                                device_map={"": "cpu"})
    model = get_peft_model(base, lora(init_random=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    trainer = SFTTrainer(model=model, train_dataset=gsm8k_prompt_completion(gsm8k_rows, 8),
                         args=SFTConfig(**settings(tmp_path, max_steps=1)))
    assert math.isfinite(trainer.train().metrics["train_loss"])
    after = dict(trainer.model.named_parameters())
    assert before and all("lora_" in n for n in before)
    assert all(not torch.equal(after[n].detach(), value) for n, value in before.items())
    assert torch.equal(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, frozen)


@needs_bnb
def test_a_bf16_4bit_model_keeps_its_unquantized_weights_and_residual_stream_in_bf16(model_dir, gsm8k_rows,
                                                                                      tmp_path):
    """PEFT's prepare_model_for_kbit_training (which leantune called until 2026-11-28; TRL 1.16 does not) casts the
    embeddings, head and norms to fp32, so the residual stream and every checkpointed layer input are fp32: twice
    the bf16 bytes (32 of the 66 GiB of Llama-3.1-8B QLoRA at 65,536 tokens on an H100, docs/benchmarks.md)."""
    from leantune import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model=str(model_dir), train_dataset=gsm8k_prompt_completion(gsm8k_rows, 2),
                         peft_config=lora(), args=SFTConfig(**settings(
                             tmp_path, max_steps=1, bf16=True, per_device_train_batch_size=2, max_length=64,
                             model_init_kwargs={
                                 "quantization_config": QUANT[4], "dtype": "bfloat16"})))
    base = trainer.model.get_base_model()
    layer_outputs = []
    base.model.layers[0].register_forward_hook(lambda module, args, out: layer_outputs.append(
        (out[0] if isinstance(out, tuple) else out).dtype))
    assert {p.dtype for n, p in base.named_parameters() if "lora_" not in n and p.dtype.is_floating_point} == {
        torch.bfloat16}  # embeddings, head, norms (the 4-bit weights are uint8)
    assert math.isfinite(trainer.train().metrics["train_loss"])
    assert layer_outputs and set(layer_outputs) == {torch.bfloat16}


@needs_bnb
@pytest.mark.parametrize("bits", [4, 8])
def test_dpo_lora_gradients_equal_the_dequantised_fp32_model(bits, model_dir, hh_pairs, tmp_path):
    """DPO runs the reference (adapter disabled) without gradient: the eval-mode no-grad pattern, inside training."""
    from leantune import DPOConfig, DPOTrainer

    def trainer(model, path, **extra):
        return DPOTrainer(model=model, train_dataset=hh_pairs, peft_config=lora(True),
                          args=DPOConfig(**settings(path, max_steps=1, max_grad_norm=0.0, max_length=160, **extra)))

    quantised = trainer(str(model_dir), tmp_path / "q", model_init_kwargs={"quantization_config": QUANT[bits]})
    reference = trainer(fp32_twin(quantised, model_dir), tmp_path / "r")
    copy_adapter(quantised.model, reference.model)
    (got, loss), (expected, reference_loss) = first_step_grads(quantised), first_step_grads(reference)
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert_grads_equal(got, expected)


def count_e(completions, **kwargs):
    return [text.count("e") / max(len(text), 1) for text in completions]


def online_trainer(kind, model_dir, tmp_path):
    from leantune import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    config, trainer = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    prompts = Dataset.from_dict({"prompt": [f"Question {i}: name a colour." for i in range(8)]})
    args = settings(tmp_path, num_generations=4, max_completion_length=6, beta=0.04,
                    model_init_kwargs={"quantization_config": QUANT[4]})
    del args["max_length"]  # an online config bounds prompts and completions instead
    return trainer(model=str(model_dir), reward_funcs=count_e, train_dataset=prompts, peft_config=lora(),
                   args=config(**args))


def preference_trainer(kind, model_dir, hh_pairs, tmp_path):
    from leantune import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer

    config, trainer = {"dpo": (DPOConfig, DPOTrainer), "kto": (KTOConfig, KTOTrainer),
                       "reward": (RewardConfig, RewardTrainer)}[kind]
    return trainer(model=str(model_dir), train_dataset=hh_pairs, peft_config=lora(),
                   args=config(**settings(tmp_path, max_length=160,
                                          model_init_kwargs={"quantization_config": QUANT[4]})))


@needs_bnb
@pytest.mark.parametrize("kind", ["sft", "dpo", "kto", "reward", "grpo", "rloo"])
def test_every_trainer_trains_4bit_lora_with_gradient_checkpointing(kind, model_dir, gsm8k_rows, hh_pairs,
                                                                    tmp_path):
    import bitsandbytes as bnb

    from leantune import SFTConfig, SFTTrainer

    if kind == "sft":
        trainer = SFTTrainer(model=str(model_dir), train_dataset=gsm8k_prompt_completion(gsm8k_rows, 8),
                             peft_config=lora(),
                             args=SFTConfig(**settings(tmp_path, model_init_kwargs={"quantization_config": QUANT[4]})))
    elif kind in ("grpo", "rloo"):  # generation runs the policy in eval mode without gradient every round
        trainer = online_trainer(kind, model_dir, tmp_path)
    else:
        trainer = preference_trainer(kind, model_dir, hh_pairs, tmp_path)
    layers = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) >= 14 and trainer.args.gradient_checkpointing
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("lora" in n or "score" in n for n in before)
    loss = trainer.train().metrics["train_loss"]
    assert math.isfinite(loss)
    after = dict(trainer.model.named_parameters())
    changed = [n for n, p in before.items() if not torch.equal(p, after[n].detach())]
    assert len(changed) >= len(before) // 2, f"{len(changed)} of {len(before)} adapter tensors changed"
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)


@needs_bnb
@pytest.mark.parametrize("flag", ["--load_in_4bit", "--load_in_8bit"])
def test_cli_load_in_4_or_8bit_trains_a_lora_adapter(flag, model_dir, gsm8k_rows, tmp_path, capsys):
    from leantune.cli.runner import run_method

    def run(argv):
        return run_method("sft", argv)

    data_file = tmp_path / "train.jsonl"
    gsm8k_prompt_completion(gsm8k_rows, 8).to_json(str(data_file))
    code = run(["--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--max_steps", "2",
                "--max_length", "128", "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "out"),
                "--report_to", "none", "--use_cpu", "true", "--memory_breakdown", "false", "--disable_tqdm", "true",
                flag, "true", "--use_peft", "true", "--lora_r", "4"])
    capsys.readouterr()
    assert code == 0
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_a_missing_bitsandbytes_names_the_extra(monkeypatch):
    from leantune.models import loading

    monkeypatch.setattr("leantune.utils.imports.is_available", lambda module: module != "bitsandbytes")
    with pytest.raises(ImportError, match=r"pip install 'leantune\[bitsandbytes\]'"):
        loading.load_causal_lm("unused", {"quantization_config": QUANT[4]})


@needs_bnb
def test_a_device_without_a_bitsandbytes_backend_is_a_clear_error(monkeypatch):
    import bitsandbytes

    from leantune.models import loading

    monkeypatch.setattr(bitsandbytes, "supported_torch_devices", {"some-accelerator"})
    with pytest.raises(RuntimeError, match=r"has no backend for this machine's training device \(cpu"):
        loading.load_causal_lm("unused", {"quantization_config": QUANT[8]})


@needs_bnb
def test_bitsandbytes_8bit_adamw_trains_4bit_lora(model_dir, gsm8k_rows, tmp_path):
    """`optim="adamw_bnb_8bit"` (bitsandbytes' AdamW with 8-bit states; tensors under 4,096 values keep 32-bit
    states, as bitsandbytes decides) runs where bitsandbytes runs, CPU included."""
    import bitsandbytes as bnb

    from leantune import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model=str(model_dir), train_dataset=gsm8k_prompt_completion(gsm8k_rows, 8), peft_config=lora(),
                         args=SFTConfig(**settings(tmp_path, optim="adamw_bnb_8bit",
                                                   model_init_kwargs={"quantization_config": QUANT[4]})))
    assert math.isfinite(trainer.train().metrics["train_loss"])
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(optimizer, bnb.optim.optimizer.Optimizer8bit)


def test_cli_without_bitsandbytes_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    from leantune.cli.main import main

    monkeypatch.setattr("leantune.utils.imports.is_available", lambda module: module != "bitsandbytes")
    code = main(["sft", "--model_name_or_path", "unused", "--dataset_name", "unused.jsonl", "--output_dir",
                 str(tmp_path), "--load_in_4bit", "true", "--use_peft", "true"])
    err = capsys.readouterr().err
    assert code == 2 and "--load_in_4bit needs bitsandbytes" in err and "leantune[bitsandbytes]" in err
    assert "Traceback" not in err
