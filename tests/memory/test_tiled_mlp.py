"""The sequence-tiled MLP (memory/tiled_mlp.py): the same losses per token and the same gradients as the untiled MLP
(inputs, every parameter, LoRA's A and B, 4-bit QLoRA's adapters), under gradient checkpointing and packed rows,
through the trainers; and no [tokens, intermediate] tensor while it runs.

Tolerance (EXACT): the tiled and untiled paths compute the same fp32 products; a parameter's gradient is the same sum
over tokens taken tile by tile (then added) instead of in one matmul, and an input row's gradient the same row
product from a smaller matmul, so they can differ only by fp32 rounding of sums in another order: ~sqrt(terms) x
1.2e-7 of the terms' magnitude. Compared as the difference's norm over the reference's norm per tensor (the scale
of the sum's terms, which an entry near zero does not have), 1e-6 leaves that rounding room (measured <= 3e-7) and
is far below any wrong tile or missed token (a whole tile's share of the sum: >= 1e-2 here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from leantune.memory.sequence_tiles import tiled_forward
from leantune.memory.tiled_mlp import (
    MIN_TILE_TOKENS,
    TiledMLP,
    install_tiled_mlp,
    remove_tiled_mlp,
    tile_tokens,
)
from leantune.utils.imports import is_available

from ..fixtures.comparisons import GradientRecorder
from ..fixtures.data import gsm8k_prompt_completion

EXACT = 1e-6
HIDDEN, INTERMEDIATE = 64, 256  # intermediate 4x hidden, as Llama's and Qwen2's (Qwen2.5-0.5B: 896 / 4,864)
TILE = 16


def mlp_model(arch: str = "qwen2", vocab_size: int = 32000, seed: int = 0):
    """A 2-layer Qwen2 or Llama of random fp32 weights whose MLP is 4x wider than its residual stream."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    return model_class(config_class(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation="sdpa")).float()


def lora_model(model, dropout: float = 0.0):
    """`model` with LoRA on every linear layer, B random (its default zeros would leave A's gradient zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear",
                                            init_lora_weights=False))


def rel_diff(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def max_rel_diff(got: dict, reference: dict) -> float:
    assert got.keys() == reference.keys() and reference
    for name, tensor in reference.items():
        assert tensor.abs().max() > 0, f"{name}: a zero gradient compares nothing"
    return max(rel_diff(got[name], reference[name]) for name in reference)


def token_losses_and_grads(model, input_ids, **inputs):
    """Per-token next-token losses, and the gradients of their sum (every trainable parameter, and the embeddings'
    output: the input gradient of the first layer's MLP flows through it)."""
    model.zero_grad()
    embeddings = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings, **inputs).logits[:, :-1].float()
    losses = F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none")
    losses.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    grads["inputs_embeds"] = embeddings.grad.clone()
    return losses.detach(), grads


def tiled_and_untiled(model, input_ids, tile=TILE, **inputs):
    """The same model's per-token losses and gradients untiled, then tiled (`tile` tokens), then untiled again."""
    untiled = token_losses_and_grads(model, input_ids, **inputs)
    assert install_tiled_mlp(model, tile) == 2
    tiled = token_losses_and_grads(model, input_ids, **inputs)
    remove_tiled_mlp(model)
    return tiled, untiled


def assert_exact(tiled, untiled) -> None:
    (tiled_losses, tiled_grads), (losses, grads) = tiled, untiled
    # per token, against the largest loss (a loss is a log-sum-exp of logits of that scale)
    torch.testing.assert_close(tiled_losses, losses, rtol=0, atol=EXACT * float(losses.abs().max()))
    assert max_rel_diff(tiled_grads, grads) <= EXACT


@pytest.mark.quick
def test_tiled_mlp_equals_untiled_per_token_and_in_every_gradient():
    model = lora_model(mlp_model())
    input_ids = torch.randint(3, 32000, (2, 50), generator=torch.Generator().manual_seed(0))
    tiled, untiled = tiled_and_untiled(model, input_ids)  # 100 tokens: 7 tiles, the last one short
    assert_exact(tiled, untiled)
    assert sum("lora_A" in name or "lora_B" in name for name in untiled[1]) == 28  # 7 linears x 2 layers x A, B
    assert not any(isinstance(module, TiledMLP) for module in model.modules())  # removed: its own class again


class DifferentiatedTiles:
    """The tiles run as `tiled_forward` runs them in the forward (same order, same draws), with grad: a reference."""

    def __call__(self, hidden):
        return tiled_forward(super().__call__, hidden, TILE)


@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_full_fine_tune_with_gradient_checkpointing(checkpointing, arch):
    """Every parameter trains, the layers recompute under checkpointing: the recompute runs the tiled MLP again."""
    model = mlp_model(arch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    model.train()
    input_ids = torch.randint(3, 32000, (2, 40), generator=torch.Generator().manual_seed(1))
    assert_exact(*tiled_and_untiled(model, input_ids))


def test_packed_rows_tile_across_their_sequences():
    """Three sequences packed in one row (positions restarting): tiles cut across sequences, per-token all the same."""
    model = lora_model(mlp_model())
    input_ids = torch.randint(3, 32000, (1, 90), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(n) for n in (37, 21, 32)])[None]
    assert_exact(*tiled_and_untiled(model, input_ids, position_ids=position_ids))


def test_lora_dropout_replays_the_forward_masks_in_the_backward():
    """With dropout the tiles draw their own masks; the backward must recompute each tile with the mask its forward
    drew. Reference: the same tiles run with autograd through them (the forward's masks, graph kept)."""
    model = lora_model(mlp_model(), dropout=0.5)
    model.train()
    input_ids = torch.randint(3, 32000, (1, 64), generator=torch.Generator().manual_seed(3))
    install_tiled_mlp(model, TILE)
    torch.manual_seed(7)
    tiled = token_losses_and_grads(model, input_ids)
    remove_tiled_mlp(model)
    mlps = [module.mlp for module in model.modules() if hasattr(module, "self_attn")]
    for mlp in mlps:  # the reference: the same tiles with autograd through them (graph kept, no recompute)
        mlp.__class__ = type("Differentiated", (DifferentiatedTiles, type(mlp)), {})
    torch.manual_seed(7)
    reference = token_losses_and_grads(model, input_ids)
    for mlp in mlps:
        mlp.__class__ = type(mlp).__mro__[2]
    assert_exact(tiled, reference)
    torch.manual_seed(8)  # another draw differs: the comparison above sees the masks
    assert rel_diff(token_losses_and_grads(model, input_ids)[0], reference[0]) > 1e-3


class LargestRows(TorchDispatchMode):
    """The most rows ([rows, width] as numel // width) of any tensor an op returns that `counted` accepts; a tensor
    of `weight_rows` rows (a weight's view or gradient, not an activation) counts as none."""

    def __init__(self, counted, weight_rows: int | None = None):
        super().__init__()
        self.counted, self.weight_rows, self.rows = counted, weight_rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and self.counted(tensor):
                rows = tensor.numel() // tensor.shape[-1]
                self.rows = max(self.rows, 0 if rows == self.weight_rows else rows)
        return out


def largest_intermediate() -> LargestRows:
    """Activations whose last dimension is the MLP's intermediate size (the weights' [hidden, intermediate] views and
    gradients, HIDDEN rows, are not activations)."""
    return LargestRows(lambda tensor: tensor.shape[-1] == INTERMEDIATE, weight_rows=HIDDEN)


def dropping_second(rows, size):
    """A tile loop's starts with its second tile left out (the negative controls' broken tiling)."""
    return [start for i, start in enumerate(range(0, rows.shape[0], size)) if i != 1]


@pytest.mark.parametrize("tiled", [True, False])
def test_no_tensor_holds_more_than_a_tile_of_intermediates(tiled):
    """Forward and backward (with checkpointing's recompute): with tiling no op returns more than one tile's
    [tile, intermediate]; untiled (the negative control) the whole [tokens, intermediate] appears."""
    model = mlp_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if tiled:
        install_tiled_mlp(model, TILE)
    input_ids = torch.randint(3, 32000, (2, 50), generator=torch.Generator().manual_seed(4))  # 100 tokens, not HIDDEN
    with largest_intermediate() as meter:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert meter.rows == (TILE if tiled else input_ids.numel())


@pytest.mark.skipif(not is_available("bitsandbytes"), reason="needs leantune[bitsandbytes]")
def test_4bit_qlora_adapters_get_the_untiled_gradients(tmp_path):
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    mlp_model().save_pretrained(tmp_path)
    quantised = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, device_map={"": "cpu"},
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32))
    model = lora_model(prepare_model_for_kbit_training(quantised, use_gradient_checkpointing=False))
    model.train()
    input_ids = torch.randint(3, 32000, (2, 48), generator=torch.Generator().manual_seed(5))
    tiled, untiled = tiled_and_untiled(model, input_ids)
    assert sum("lora_" in name for name in untiled[1]) == 28
    assert_exact(tiled, untiled)


@pytest.mark.liger_interpreter  # TRITON_INTERPRET=1 kept for this test (tests/conftest.py): Liger's kernel on CPU
def test_liger_swiglu_bound_after_tiling_is_tiled_too(monkeypatch):
    """Trainer.train() binds Liger's SwiGLU forward onto each MLP after the trainer tiled it: the tiles then run
    Liger's kernel, with the gradients of Liger's untiled MLP."""
    pytest.importorskip("liger_kernel", reason="needs leantune[liger]")
    from devkit.liger_cpu import bridge_interpreter_gaps, liger_kernels_interpreted

    if (reason := liger_kernels_interpreted()) is not None:
        pytest.skip(f"Liger's kernels do not run on CPU here: {reason}")
    from liger_kernel.transformers.monkey_patch import _patch_swiglu_module
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    bridge_interpreter_gaps(monkeypatch)  # the SwiGLU kernel's float argument, as compiled Triton passes it
    model = lora_model(mlp_model())
    mlps = [module.mlp for module in model.modules() if hasattr(module, "self_attn")]
    for mlp in mlps:
        _patch_swiglu_module(mlp, LigerSwiGLUMLP)
    input_ids = torch.randint(3, 32000, (1, 40), generator=torch.Generator().manual_seed(6))
    untiled = token_losses_and_grads(model, input_ids)
    install_tiled_mlp(model, TILE)
    for mlp in mlps:  # again, as Trainer.train() does after the trainer was built
        _patch_swiglu_module(mlp, LigerSwiGLUMLP)
    with largest_intermediate() as meter:
        tiled = token_losses_and_grads(model, input_ids)
    assert meter.rows == TILE and all(mlp._get_name() == "LigerSwiGLUMLP" for mlp in mlps)
    assert_exact(tiled, untiled)


def test_tile_rule_is_a_share_of_the_budget_above_the_launch_floor():
    gib = 1 << 30
    # 16 GiB free, bf16, Llama-8B's 14,336: 1 GiB / 28,672 B = 37,449 tokens a tile
    assert tile_tokens(500_000, 14_336, 2, 16 * gib, "cuda") == 37_449
    assert tile_tokens(500_000, 14_336, 2, 10 << 20, "cuda") == MIN_TILE_TOKENS["cuda"]  # scarce: the floor
    assert tile_tokens(2_000, 14_336, 2, 16 * gib, "cuda") == 2_000  # short: one tile, as untiled
    assert tile_tokens(8_192, 4_864, 4, 0, "cpu") == MIN_TILE_TOKENS["cpu"]
    with pytest.raises(ValueError, match="positive"):
        tile_tokens(0, 14_336, 2, gib, "cuda")


def test_a_model_without_a_recognised_mlp_is_refused_in_one_line():
    """OPT keeps its MLP's projections on the layer itself (no MLP module to wrap); test_tiled_mlp_kinds.py: more."""
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
                                     vocab_size=100, word_embed_proj_dim=32))
    with pytest.raises(ValueError, match=r"^`tiled_mlp=True` tiles .*OPTForCausalLM .*`tiled_mlp=False`\.$"):
        install_tiled_mlp(model, TILE)


def test_a_tile_size_without_tiled_mlp_is_rejected_when_the_config_is_built(tmp_path):
    from leantune import SFTConfig

    with pytest.raises(ValueError, match="`tiled_mlp_tile_size` needs `tiled_mlp=True`"):
        SFTConfig(output_dir=str(tmp_path), report_to=[], tiled_mlp_tile_size=512)


# --- the trainers: tiled_mlp on equals off, real optimizer steps ----------------------------------------------------

def trained(trainer):
    """(the first step's gradients as the optimizer saw them, every step's logged loss)."""
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return recorder.grads, losses


def assert_runs_equal(tiled_run, untiled_run, steps: int) -> None:
    (tiled_grads, tiled_losses), (grads, losses) = tiled_run, untiled_run
    assert len(losses) == steps and max_rel_diff(tiled_grads, grads) <= EXACT
    # each step's loss, after real optimizer steps on each side (logged to 4 digits by Trainer's log)
    assert tiled_losses == pytest.approx(losses, rel=EXACT, abs=1e-4)


def sft(tokenizer, rows, tmp_path, tiled: bool, **overrides):
    from leantune import SFTConfig, SFTTrainer

    tiling = dict(tiled_mlp=True, tiled_mlp_tile_size=TILE) if tiled else {}
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, max_steps=2,
                     per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, seed=0, disable_tqdm=True,
                     memory_breakdown=False, max_grad_norm=0.0, max_length=128, **tiling, **overrides)
    return SFTTrainer(model=mlp_model(), args=args, train_dataset=gsm8k_prompt_completion(rows, 8),
                      processing_class=tokenizer)


@pytest.mark.parametrize("layout", [dict(), dict(packing=True, padding_free=True)])
def test_sft_trains_the_same_with_tiled_mlp(layout, tokenizer, gsm8k_rows, tmp_path):
    tiled = sft(tokenizer, gsm8k_rows, tmp_path / "t", True, **layout)
    assert sum(isinstance(module, TiledMLP) for module in tiled.model.modules()) == 2
    assert_runs_equal(trained(tiled), trained(sft(tokenizer, gsm8k_rows, tmp_path / "u", False, **layout)), 2)


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_dpo_trains_the_same_with_tiled_mlp(method, tokenizer, hh_pairs, tmp_path):
    """DPO (chosen and rejected rows in one batch) and KTO (completions and their KL partners: hh_pairs unpaired)."""
    from leantune import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    from ..fixtures.preference import preference_trainer

    trainer_class, config_class = (DPOTrainer, DPOConfig) if method == "dpo" else (KTOTrainer, KTOConfig)

    def run(tiled: bool, folder: str):
        tiling = dict(tiled_mlp=True, tiled_mlp_tile_size=TILE) if tiled else {}
        trainer = preference_trainer(trainer_class, config_class, tokenizer, hh_pairs, tmp_path / folder,
                                     mlp_model(), max_length=128, max_steps=2, **tiling)
        assert sum(isinstance(module, TiledMLP) for module in trainer.model.modules()) == (2 if tiled else 0)
        return trained(trainer)

    assert_runs_equal(run(True, "t"), run(False, "u"), 2)


def test_gkd_trains_the_same_with_tiled_mlp(char_tokenizer, tmp_path):
    """GKD: the student's MLPs tiled (the frozen teacher runs under no_grad, untiled), its divergence from the teacher
    per completion token the same; with on-policy steps (`lmbda=0.5`) the completions are generated by the tiled
    student in the first run and by the untiled one in the second, from the same seed."""
    from ..trainers.test_gkd import char_model, gkd_trainer

    def run(tiled: bool, folder: str):
        tiling = dict(tiled_mlp=True, tiled_mlp_tile_size=4) if tiled else {}
        trainer = gkd_trainer(char_tokenizer, tmp_path / folder, teacher=char_model(char_tokenizer, seed=0),
                              lmbda=0.5, max_new_tokens=4, **tiling)
        assert sum(isinstance(module, TiledMLP) for module in trainer.model.modules()) == (2 if tiled else 0)
        return trained(trainer)

    assert_runs_equal(run(True, "t"), run(False, "u"), 2)


def test_grpo_update_step_is_the_same_with_tiled_mlp(char_tokenizer, tmp_path):
    """GRPO's update on one generated round, the same completions scored tiled and untiled; then real steps."""
    from leantune import GRPOTrainer

    from ..fixtures.data import count_a
    from ..fixtures.data import reversal_prompts_with_answers as prompts
    from ..fixtures.models import char_model
    from ..fixtures.online_rounds import grpo_config, loss_and_grads, one_round

    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, train_dataset=prompts(), processing_class=char_tokenizer,
                          args=grpo_config(output_dir=str(tmp_path), tiled_mlp=True, tiled_mlp_tile_size=4))
    assert sum(isinstance(module, TiledMLP) for module in trainer.model.modules()) == 2
    batch = one_round(trainer)[0]
    tiled = loss_and_grads(trainer, batch)
    remove_tiled_mlp(trainer.model)
    untiled = loss_and_grads(trainer, batch)
    torch.testing.assert_close(tiled[0], untiled[0], rtol=EXACT, atol=0)
    assert max_rel_diff(tiled[1], untiled[1]) <= EXACT
    install_tiled_mlp(trainer.model, 4)
    trainer.train()  # real optimizer steps on rounds generated and scored by the tiled model
    assert trainer.state.global_step == 2


def test_the_plan_traces_the_tiled_mlp_and_predicts_its_step_peak(tokenizer, gsm8k_rows):
    """The planner builds the trainer, so its fake step runs the tiled MLP (fake tensors through the autograd
    function, MemTracker's module hooks on every tile): its prediction is the measured peak (MemTracker's sums of
    the same tensors, fake and real: 2%, the plan's promise). What tiling saves at length: bench/tiled_mlp.py."""
    from leantune import SFTConfig, SFTTrainer
    from leantune.planning import plan_memory

    from ..fixtures.planning import measured_breakdown

    dataset = gsm8k_prompt_completion(gsm8k_rows, 8)
    model = mlp_model()
    fields = dict(per_device_train_batch_size=8, max_length=128, tiled_mlp=True, tiled_mlp_tile_size=TILE)
    plan = plan_memory(model.config, dataset, "sft", processing_class=tokenizer, **fields)
    measured = measured_breakdown(SFTTrainer, SFTConfig, model, dataset, tokenizer, fields)
    predicted = plan.measured_step
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes


def test_reward_model_trains_the_same_with_tiled_mlp(tokenizer, hh_pairs, tmp_path):
    """A sequence-classification model's decoder layers tile alike (its score is read after the last layer)."""
    from leantune import RewardConfig, RewardTrainer

    from ..fixtures.models import tiny_reward_model

    def run(tiled: bool, folder: str):
        tiling = dict(tiled_mlp=True, tiled_mlp_tile_size=TILE) if tiled else {}
        args = RewardConfig(output_dir=str(tmp_path / folder), report_to=[], use_cpu=True, disable_tqdm=True,
                            save_strategy="no", max_length=128, per_device_train_batch_size=4, memory_breakdown=False,
                            max_steps=2, max_grad_norm=0.0, seed=0, logging_steps=1, **tiling)
        trainer = RewardTrainer(tiny_reward_model(), args=args, train_dataset=hh_pairs, processing_class=tokenizer)
        assert sum(isinstance(module, TiledMLP) for module in trainer.model.modules()) == (2 if tiled else 0)
        return trained(trainer)

    assert_runs_equal(run(True, "t"), run(False, "u"), 2)
