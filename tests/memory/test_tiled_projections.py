"""The attention block's norms and projections over sequence tiles (memory/tiled_projections.py, over
memory/sequence_tiles.py): the same losses per token and the same gradients as untiled (inputs, every weight of a
full fine-tune, LoRA's A and B, 4-bit QLoRA's adapters), under gradient checkpointing, packed rows, the tiled MLP,
checkpoint offload and real optimizer steps; no fp32 [tokens, hidden] tensor in a decoder layer while it runs.

Tolerance (EXACT, as tests/memory/test_tiled_mlp.py's): tiled and untiled compute the same fp32 products per row; a
weight's gradient is the same sum over tokens taken tile by tile (then added in fp32) instead of in one matmul, so
they differ by fp32 rounding of sums in another order, ~sqrt(terms) x 1.2e-7 of the terms' magnitude. Compared as
the difference's norm over the reference's norm per tensor (the scale of the sum's terms), 1e-6 leaves that room
(measured <= 6.6e-7 at OMP 1, 2 and 4: Qwen2's k_proj bias, whose gradient over a softmax's keys nearly cancels,
then LoRA A/B weights <= 6.3e-7) and is far below a wrong or dropped tile (its share of the sum: >= 1e-2 here).
A per-token loss is compared against the largest loss (a log-sum-exp of logits of that scale).
"""

from __future__ import annotations

import pytest
import torch

import leantune.memory.sequence_tiles as sequence_tiles_module
from leantune.memory.checkpoint_offload import unsupported_by_transformers
from leantune.memory.sequence_tiles import tiled_class, tiled_forward
from leantune.memory.tiled_mlp import install_tiled_mlp, remove_tiled_mlp
from leantune.memory.tiled_projections import (
    TiledProjection,
    attention_block_modules,
    install_tiled_projections,
    remove_tiled_projections,
)
from leantune.utils.imports import is_available

from ..fixtures.data import gsm8k_prompt_completion
from .test_tiled_mlp import (
    HIDDEN,
    TILE,
    LargestRows,
    assert_exact,
    assert_runs_equal,
    dropping_second,
    lora_model,
    max_rel_diff,
    mlp_model,
    rel_diff,
    token_losses_and_grads,
    trained,
)

BLOCK_MODULES = 12  # 2 layers x (2 norms + q, k, v, o)


def tiled_and_untiled(model, input_ids, mlp: bool = True, **inputs):
    """The same model's per-token losses and gradients untiled, then with its attention block's norms and
    projections tiled (and its MLPs, with `mlp`), `TILE` tokens a tile."""
    untiled = token_losses_and_grads(model, input_ids, **inputs)
    if mlp:
        install_tiled_mlp(model, TILE)
    assert install_tiled_projections(model, TILE) == BLOCK_MODULES
    tiled = token_losses_and_grads(model, input_ids, **inputs)
    remove_tiled_projections(model)
    remove_tiled_mlp(model)
    return tiled, untiled


def ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 32000, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.quick
def test_tiled_block_equals_untiled_per_token_and_in_every_gradient():
    model = lora_model(mlp_model("llama"))
    tiled, untiled = tiled_and_untiled(model, ids(2, 50, 0))  # 100 tokens: 7 tiles, the last one short
    assert_exact(tiled, untiled)
    assert sum("lora_A" in name or "lora_B" in name for name in untiled[1]) == 28  # 7 linears x 2 layers x A, B
    assert not any(isinstance(module, TiledProjection) for module in model.modules())  # removed: own classes again
    kinds = sorted({type(module).__name__ for module in attention_block_modules(model)})
    assert kinds == ["Linear", "LlamaRMSNorm"]  # PEFT's LoRA Linear around each projection, and the two norms


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_full_fine_tune_with_gradient_checkpointing(arch):
    """Every weight trains (Qwen2's q/k/v biases too), the layers recompute under non-reentrant checkpointing: the
    recompute runs the tiled modules again, each tile under its own checkpoint inside the layer's."""
    model = mlp_model(arch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tiled, untiled = tiled_and_untiled(model, ids(2, 40, 1))
    assert_exact(tiled, untiled)
    assert {"model.layers.1.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight"} <= untiled[1].keys()


def test_packed_rows_tile_across_their_sequences():
    """Three sequences packed in one row (positions restarting), tiles cut across sequences; the projections alone
    (the tiled MLP off) give the untiled numbers too."""
    model = lora_model(mlp_model("qwen2"))
    position_ids = torch.cat([torch.arange(n) for n in (37, 21, 32)])[None]
    assert_exact(*tiled_and_untiled(model, ids(1, 90, 2), mlp=False, position_ids=position_ids))


@pytest.mark.skipif(not is_available("bitsandbytes"), reason="needs leantune[bitsandbytes]")
def test_4bit_qlora_adapters_get_the_untiled_gradients(tmp_path):
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    mlp_model("llama").save_pretrained(tmp_path)
    quantised = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, device_map={"": "cpu"},
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32))
    model = lora_model(prepare_model_for_kbit_training(quantised, use_gradient_checkpointing=False))
    model.train()
    tiled, untiled = tiled_and_untiled(model, ids(2, 48, 5))
    assert sum("lora_" in name for name in untiled[1]) == 28
    assert "Linear4bit" in {type(module).__name__ for module in attention_block_modules(model)}
    assert_exact(tiled, untiled)


class DifferentiatedTiles:
    """The tiles run as `tiled_forward` runs them in the forward (same order, same draws), with grad: a reference
    with the forward's dropout masks kept in the graph, no recompute."""

    def __call__(self, hidden):
        return tiled_forward(super().__call__, hidden, TILE)


def test_lora_dropout_replays_the_forward_masks_in_the_recompute():
    """With `lora_dropout` each tile draws its own mask; each tile's recompute must draw the same one, under the
    layer's checkpoint too. Reference: the same tiles run with autograd through them, from the same seed."""
    model = lora_model(mlp_model("llama"), dropout=0.5)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    input_ids = ids(1, 64, 3)
    install_tiled_projections(model, TILE)
    torch.manual_seed(7)
    tiled = token_losses_and_grads(model, input_ids)
    remove_tiled_projections(model)
    modules = attention_block_modules(model)
    for module in modules:
        module.__class__ = type("Differentiated", (DifferentiatedTiles, type(module)), {"own": type(module)})
    torch.manual_seed(7)
    reference = token_losses_and_grads(model, input_ids)
    for module in modules:
        module.__class__ = module.own
    assert_exact(tiled, reference)
    torch.manual_seed(8)  # another draw differs: the comparison above sees the masks
    assert rel_diff(token_losses_and_grads(model, input_ids)[0], reference[0]) > 1e-3


def test_a_dropped_or_misplaced_tile_is_seen(monkeypatch):
    """Negative controls: a tile loop that skips its second tile, or one that writes each tile one row late, in the
    projections and norms only (the MLP untiled), fails the comparison above, far outside its tolerance."""
    model = lora_model(mlp_model("llama"))
    untiled = token_losses_and_grads(model, ids(2, 40, 5))

    monkeypatch.setattr(sequence_tiles_module, "chunk_starts", dropping_second)
    install_tiled_projections(model, TILE)
    dropped = token_losses_and_grads(model, ids(2, 40, 5))
    # not `> 1e-2`: the dropped tile's rows are never written, so they may hold NaN (uninitialised memory)
    assert not max_rel_diff(dropped[1], untiled[1]) <= 1e-2
    with pytest.raises(AssertionError):
        assert_exact(dropped, untiled)
    monkeypatch.setattr(sequence_tiles_module, "chunk_starts",
                        lambda rows, size: [min(start + 1, rows.shape[0] - 1) for start in range(0, rows.shape[0],
                                                                                                 size)])
    shifted = token_losses_and_grads(model, ids(2, 40, 5))
    assert not max_rel_diff(shifted[1], untiled[1]) <= 1e-2


@pytest.mark.parametrize("tiled", [True, False])
def test_no_fp32_tensor_of_the_layers_holds_more_than_a_tile(tiled):
    """A bf16 model with LoRA (PEFT keeps the adapters in fp32 and casts their inputs) and dropout, checkpointed:
    with the block tiled no op returns an fp32 [rows, hidden] of more than a tile; untiled (the negative control)
    the whole [tokens, hidden] appears. The final norm (outside the layers) is tiled by hand in both, so that what
    is measured is the layers'."""
    model = lora_model(mlp_model("llama").to(torch.bfloat16), dropout=0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    final_norm = model.base_model.model.model.norm
    final_norm.__class__ = tiled_class(type(final_norm), TiledProjection)
    final_norm.tiled_projection_tile_size = TILE
    if tiled:
        install_tiled_mlp(model, TILE)
        install_tiled_projections(model, TILE)
    input_ids = ids(2, 50, 4)  # 100 tokens, not HIDDEN
    # fp32 [rows, hidden]: the upcasts of RMSNorm and of LoRA's inputs (an adapter's [r, hidden] has r rows)
    fp32_rows = LargestRows(lambda tensor: tensor.dtype == torch.float32 and tensor.shape[-1] == HIDDEN)
    with fp32_rows as meter:
        model(input_ids=input_ids).logits[:, :-1].float().logsumexp(-1).sum().backward()
    assert meter.rows == (TILE if tiled else input_ids.numel())


def test_projections_without_tiled_mlp_are_rejected_when_the_config_is_built(tmp_path):
    from leantune import SFTConfig

    with pytest.raises(ValueError, match="`tiled_attention_projections=True` tiles .* set `tiled_mlp=True` too"):
        SFTConfig(output_dir=str(tmp_path), report_to=[], tiled_attention_projections=True)


# --- a trainer: the block tiled equals untiled, real optimizer steps -------------------------------------------------

def sft(tokenizer, rows, tmp_path, tiled: bool, **overrides):
    from leantune import SFTConfig, SFTTrainer

    tiling = dict(tiled_mlp=True, tiled_mlp_tile_size=TILE, tiled_attention_projections=True) if tiled else {}
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, max_steps=2,
                     per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, seed=0, disable_tqdm=True,
                     memory_breakdown=False, max_grad_norm=0.0, max_length=128, **tiling, **overrides)
    return SFTTrainer(model=mlp_model("llama"), args=args, train_dataset=gsm8k_prompt_completion(rows, 8),
                      processing_class=tokenizer)


OFFLOAD = pytest.mark.skipif(unsupported_by_transformers() is not None, reason="checkpoint offload refused here")


@pytest.mark.parametrize("layout", [
    dict(),
    dict(packing=True, padding_free=True),
    pytest.param(dict(padding_free=True, checkpoint_offload_layers=1), marks=OFFLOAD, id="offload"),
])
def test_sft_trains_the_same_with_the_block_tiled(layout, tokenizer, gsm8k_rows, tmp_path):
    tiled = sft(tokenizer, gsm8k_rows, tmp_path / "t", True, **layout)
    assert sum(isinstance(module, TiledProjection) for module in tiled.model.modules()) == BLOCK_MODULES
    assert_runs_equal(trained(tiled), trained(sft(tokenizer, gsm8k_rows, tmp_path / "u", False, **layout)), 2)



@pytest.mark.quick
def test_without_a_tile_the_rule_sizes_it_once_against_the_free_memory(monkeypatch):
    """No tile given: the tiled MLP's rule (`tile_tokens`) at the width given, against the free memory measured at a
    module's first call and kept, so the same tokens always get the same tiles. A budget as small as the width's
    one row makes the rule's floor (`MIN_TILE_TOKENS`, set to 16 tokens here) the tile, which the tiles then follow."""
    model = lora_model(mlp_model("llama"))
    untiled = token_losses_and_grads(model, ids(2, 50, 3))
    measured = []

    def tiny_budget(device):
        measured.append(device)
        return 1

    monkeypatch.setattr(sequence_tiles_module, "free_device_bytes", tiny_budget)
    tiles = []
    monkeypatch.setattr(sequence_tiles_module, "chunk_starts",
                        lambda rows, size: tiles.append(size) or list(range(0, rows.shape[0], size)))
    monkeypatch.setitem(sequence_tiles_module.MIN_TILE_TOKENS, "cpu", 16)  # below the 100 tokens: several tiles
    install_tiled_projections(model, None, rule_width=HIDDEN)
    tiled = token_losses_and_grads(model, ids(2, 50, 3))
    token_losses_and_grads(model, ids(2, 50, 3))
    assert len(measured) == BLOCK_MODULES  # once per module, not once per call
    assert set(tiles) == {16}  # the floor: a 1-byte budget holds no row
    assert_exact(tiled, untiled)
    remove_tiled_projections(model)
