"""`policy_weights_for_sync`: checkpoint names and values for plain, wrapped and PEFT models (CPU).

ZeRO-3's module-at-a-time gathering needs DeepSpeed on a GPU: tests/generation/test_gpu_online.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from leantune.generation.weight_sync import policy_weights_for_sync

from ..fixtures.models import tiny_model

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

VOCAB = 512


def synced(model, accelerator=None) -> dict[str, torch.Tensor]:
    """What a sync sends, copied as it comes (a yielded tensor may be a scratch copy)."""
    out = {}
    for name, tensor in policy_weights_for_sync(model, accelerator):
        assert name not in out, f"{name} sent twice"
        out[name] = tensor.clone()
    return out


def assert_same_tensors(got: dict, expected: dict, atol: float = 0.0):
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        assert torch.allclose(got[name], tensor, atol=atol, rtol=0), f"{name}: {(got[name] - tensor).abs().max()}"


def lora_model(seed: int = 0, **lora_kwargs):
    """A tiny Llama with LoRA on q_proj/v_proj whose B matrices are non-zero, so the adapter changes outputs."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **lora_kwargs)
    model = get_peft_model(tiny_model(vocab_size=VOCAB, seed=seed), config)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    return model.eval()


def logits(model, ids=((1, 17, 42, 99, 7),)):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def test_full_model_is_its_state_dict():
    model = tiny_model(vocab_size=VOCAB)
    assert not model.config.tie_word_embeddings
    assert_same_tensors(synced(model), model.state_dict())


def test_tied_embeddings_are_sent_once_under_the_embedding_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = tiny_model(vocab_size=VOCAB).config
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(LlamaConfig.from_dict(config.to_dict()))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # as save_pretrained writes it
    assert_same_tensors(synced(model), expected)


def test_non_persistent_buffers_are_not_sent_and_wrappers_are_unwrapped():
    model = tiny_model(vocab_size=VOCAB)
    compiled = torch.compile(model)  # names gain `_orig_mod.`; not run, so nothing compiles
    got = synced(compiled)
    assert not any("inv_freq" in name or "_orig_mod" in name for name in got)
    assert_same_tensors(got, model.state_dict())


def test_ddp_wrapper_is_unwrapped(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = tiny_model(vocab_size=VOCAB)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(model)
        assert_same_tensors(synced(wrapped), model.state_dict())
    finally:
        dist.destroy_process_group()


def test_lora_is_merged_and_the_peft_model_is_left_as_it_was():
    model = lora_model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    outputs_before = logits(model)
    with model.disable_adapter():
        # the adapter matters: logits move by far more than 1e-3 (measured ~0.8)
        assert not torch.allclose(logits(model), outputs_before, atol=1e-3)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()

    got = synced(model)
    assert not any("lora_" in name or "base_layer" in name or name.startswith("base_model") for name in got)
    # W + s B A in fp32 with |W| <= ~0.1: a merge in another order rounds by ulps (~1e-8; measured: bitwise equal);
    # a wrong scale or a missing adapter is far larger (the adapter moves the logits by ~0.8, above)
    assert_same_tensors(got, expected, atol=1e-6)
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[name], before[name]) for name in before)  # base and adapter weights, bitwise
    assert not any(getattr(m, "merged", False) for m in model.modules() if hasattr(m, "merged_adapters"))
    assert torch.equal(logits(model), outputs_before)  # the adapter is still active


def test_dora_is_merged_like_merge_and_unload():
    model = lora_model(use_dora=True)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert_same_tensors(synced(model), expected, atol=1e-6)  # as above (DoRA adds a norm: still ulps)
    assert all(torch.equal(model.state_dict()[name], before[name]) for name in before)


def test_disabled_adapter_sends_the_base_weights():
    model = lora_model()
    base = {name.removeprefix("base_model.model.").replace(".base_layer", ""): tensor.clone()
            for name, tensor in model.state_dict().items() if "lora_" not in name}
    with model.disable_adapter():
        assert_same_tensors(synced(model), base)


def test_modules_to_save_sends_the_trained_copy_under_the_original_name():
    model = lora_model(modules_to_save=["lm_head"])
    wrapper = model.base_model.model.lm_head
    original = wrapper.original_module.weight.detach().clone()
    with torch.no_grad():
        wrapper.modules_to_save["default"].weight.add_(1.0)  # "trained"
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    got = synced(model)
    assert not any("modules_to_save" in name or "original_module" in name for name in got)
    assert_same_tensors(got, expected, atol=1e-6)  # as above
    assert torch.equal(got["lm_head.weight"], wrapper.modules_to_save["default"].weight)
    assert torch.equal(wrapper.original_module.weight, original)


def test_prompt_learning_models_are_refused():
    from peft import PromptTuningConfig, get_peft_model

    model = get_peft_model(tiny_model(vocab_size=VOCAB), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(NotImplementedError, match="prompt-learning"):
        synced(model)
