"""The tiled MLP beyond Llama's gated MLP (memory/mlp_kinds.py): non-gated dense MLPs (GPT-2's Conv1D, GPT-NeoX,
Phi, Falcon, Bloom's MLP called with the residual) and mixture-of-experts layers (Mixtral, Qwen2-MoE with its shared
expert, gpt-oss with its biases and tuple-returning block, OLMoE): the same per-token losses, load-balancing loss,
router logits and gradients as untiled; with gradient checkpointing, packed rows, LoRA (on the experts' parameters
too) and 4-bit QLoRA; what is refused; the planner's view; a trainer's real steps.

Tolerance (EXACT, 1e-6, as tests/memory/test_tiled_mlp.py): the tiled path computes the same fp32 products; a
parameter's gradient is the same sum over tokens taken tile by tile, an expert's over the tile's tokens routed to
it, so the two differ only by fp32 rounding of sums in another order, ~sqrt(terms) x 1.2e-7 of the terms' scale,
compared as a norm ratio per tensor (measured <= 5e-7 at these shapes). One exception, derived per tensor: the
adapters PEFT puts on the experts' parameters (`target_parameters`; `all-linear` on Mixtral) get their gradient as
each tile's [experts, in, out] weight gradient contracted with the other factor, then summed over the tiles; those
per-tile products cancel, so the sum's norm is smaller than its terms' and the same rounding is a larger share of it
(measured up to 1.2e-6 at 2 threads). Their bound is twice the untiled fp32 gradient's own distance from the fp64
one (at least EXACT): the tiled path may not be further from the untiled than the untiled is from the exact sum.
A dropped tile or token moves a gradient by its share of the sum (>= 1e-2 here: the negative control below).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import leantune.memory.sequence_tiles as sequence_tiles_module
from leantune.memory.mlp_kinds import config_intermediate_width
from leantune.memory.tiled_mlp import TiledMLP, can_tile, install_tiled_mlp, remove_tiled_mlp
from leantune.utils.imports import is_available

from .test_tiled_mlp import EXACT, LargestRows, dropping_second, lora_model, max_rel_diff, rel_diff

HIDDEN, WIDE, EXPERT = 64, 256, 48  # dense MLPs 4x wide; an expert 48 wide (gated: 96 in its gate-up projection)
TILE, VOCAB = 16, 1000
DENSE_KINDS = ["gpt2", "gpt_neox", "phi", "falcon", "bloom"]
MOE_KINDS = ["mixtral", "qwen2_moe", "gpt_oss", "olmoe"]


def kind_config(kind: str, vocab_size: int = VOCAB):
    """A 2-layer config of `kind`: its MLP 4x the residual stream wide, or 4 experts (top 2) of `EXPERT` each."""
    from transformers import AutoConfig

    sizes = dict(
        gpt2=dict(n_embd=HIDDEN, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        gpt_neox=dict(intermediate_size=WIDE), phi=dict(intermediate_size=WIDE),
        falcon=dict(ffn_hidden_size=WIDE, new_decoder_architecture=False, multi_query=True), bloom=dict(n_head=4),
        mixtral=dict(intermediate_size=EXPERT, num_local_experts=4),
        qwen2_moe=dict(intermediate_size=WIDE, moe_intermediate_size=EXPERT, shared_expert_intermediate_size=WIDE,
                       num_experts=4),
        gpt_oss=dict(intermediate_size=EXPERT, num_local_experts=4, head_dim=16, layer_types=["full_attention"] * 2),
        olmoe=dict(intermediate_size=EXPERT, num_experts=4),
    )[kind]
    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_dropout=0.0,
                  attention_dropout=0.0, num_experts_per_tok=2, output_router_logits=kind in MOE_KINDS)
    config = AutoConfig.for_model(kind)
    for name, value in {**common, **sizes}.items():
        if name in sizes or hasattr(config, name) or name == "output_router_logits":
            setattr(config, name, value)
    return config


def kind_model(kind: str, seed: int = 0, vocab_size: int = VOCAB):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(kind_config(kind, vocab_size)).float()


def losses_and_grads(model, input_ids, **inputs):
    """Per-token losses, the load-balancing loss (MoE) and each layer's router logits, and the gradients of the
    per-token losses' sum plus the load-balancing loss (every trainable parameter, and the embeddings' output)."""
    model.zero_grad()
    embeddings = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeddings, **inputs)
    logits = out.logits[:, :-1].flatten(0, 1)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    losses = F.cross_entropy(logits, input_ids[:, 1:].flatten(), reduction="none")
    aux = getattr(out, "aux_loss", None)
    (losses.sum() + (aux if aux is not None else 0)).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    grads["inputs_embeds"] = embeddings.grad.clone()
    routers = [logits.detach() for logits in getattr(out, "router_logits", None) or ()]
    return losses.detach(), aux, routers, grads


def tiled_and_untiled(model, input_ids, tile=TILE, **inputs):
    untiled = losses_and_grads(model, input_ids, **inputs)
    parts = install_tiled_mlp(model, tile)
    tiled = losses_and_grads(model, input_ids, **inputs)
    remove_tiled_mlp(model)
    return tiled, untiled, parts


def experts_adapter_bounds(model, untiled_grads, input_ids, **inputs) -> dict[str, float]:
    """For each adapter on the experts' parameters: twice the untiled fp32 gradient's distance from the fp64 one
    (at least EXACT; the module docstring says why)."""
    double = copy.deepcopy(model).double()
    double.get_base_model().set_experts_implementation("eager")  # grouped matmuls take no fp64
    exact = losses_and_grads(double, input_ids, **inputs)[3]
    return {name: max(EXACT, 2 * rel_diff(untiled_grads[name].double(), exact[name]))
            for name in untiled_grads if ".experts." in name and "lora_" in name}


def assert_exact(tiled, untiled, bounds: dict[str, float] | None = None) -> None:
    (losses, aux, routers, grads), (ref_losses, ref_aux, ref_routers, ref_grads) = tiled, untiled
    # per token, against the largest loss (a loss is a log-sum-exp of logits of that scale)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=EXACT * float(ref_losses.abs().max()))
    assert (aux is None) == (ref_aux is None) and len(routers) == len(ref_routers)
    if aux is not None:  # the router runs untiled: its logits differ only through the layers below (fp32 rounding)
        assert len(routers) == 2 and abs(float(aux - ref_aux)) <= EXACT * abs(float(ref_aux))
        assert max(rel_diff(got, ref) for got, ref in zip(routers, ref_routers)) <= EXACT
    bounds = bounds or {}
    assert grads.keys() == ref_grads.keys() and all(ref.abs().max() > 0 for ref in ref_grads.values())
    assert max(rel_diff(grads[name], ref) / bounds.get(name, EXACT) for name, ref in ref_grads.items()) <= 1


def token_ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.quick
def test_gpt2_conv1d_mlp_with_lora_tiles_exactly():
    """GPT-2: `attn` (not `self_attn`), Conv1D projections ([in, out] weights), LoRA on each of them."""
    model = lora_model(kind_model("gpt2"))
    tiled, untiled, parts = tiled_and_untiled(model, token_ids(2, 50, 0))  # 100 tokens: 7 tiles, the last short
    assert parts == 2 and sum("lora_A" in name for name in untiled[3]) == 8  # c_attn, c_proj, c_fc, mlp c_proj x 2
    assert_exact(tiled, untiled)
    assert not any(isinstance(module, TiledMLP) for module in model.modules())


@pytest.mark.parametrize("kind", DENSE_KINDS)
def test_non_gated_dense_mlps_full_fine_tune_with_checkpointing(kind):
    """Every parameter trains, the layers recompute under checkpointing (the recompute tiles again). Bloom's MLP is
    called with the residual too: both are cut at the same rows; Falcon adds to the MLP's output in place."""
    model = kind_model(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tiled, untiled, parts = tiled_and_untiled(model, token_ids(2, 40, 1))
    assert parts == 2
    assert_exact(tiled, untiled)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_experts_tile_with_the_untiled_router_logits_and_aux_loss(kind):
    """The experts (and Qwen2-MoE's shared expert) tiled, the router untiled: per-token losses, the load-balancing
    loss, each layer's router logits and every gradient (the router's through the routing weights and the aux loss)
    as untiled, under checkpointing."""
    model = kind_model(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tiled, untiled, parts = tiled_and_untiled(model, token_ids(2, 40, 2))
    assert parts == (4 if kind == "qwen2_moe" else 2)  # experts (+ shared expert) per layer
    assert any("gate" in name or "router" in name for name in untiled[3])
    assert_exact(tiled, untiled)


@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
def test_packed_rows_tile_across_their_sequences(kind):
    """Three sequences packed in one row, positions restarting (padding-free): tiles cut across the sequences."""
    model = lora_model(kind_model(kind))
    input_ids, position_ids = token_ids(1, 90, 3), torch.cat([torch.arange(n) for n in (37, 21, 32)])[None]
    tiled, untiled, _ = tiled_and_untiled(model, input_ids, position_ids=position_ids)
    assert_exact(tiled, untiled, experts_adapter_bounds(model, untiled[3], input_ids, position_ids=position_ids))


def test_lora_on_the_experts_parameters_tiles_through_peft_wrappers():
    """PEFT's `target_parameters` wraps the experts (twice: gate-up and down); the outer wrapper is tiled, and the
    experts' adapters get the untiled gradients."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(kind_model("mixtral"), LoraConfig(
        r=4, target_modules="all-linear", target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        init_lora_weights=False))
    input_ids = token_ids(2, 40, 4)
    tiled, untiled, parts = tiled_and_untiled(model, input_ids)
    bounds = experts_adapter_bounds(model, untiled[3], input_ids)
    assert parts == 2 and len(bounds) == 8  # gate-up and down, A and B, 2 layers
    assert_exact(tiled, untiled, bounds)


@pytest.mark.parametrize("kind", ["mixtral", "gpt2"])
def test_a_dropped_tile_is_seen(kind, monkeypatch):
    """Negative control: a tile loop that skips its second tile (in the forward and the backward) fails the
    comparison above, far outside its tolerance."""
    model = kind_model(kind)
    model.train()
    untiled = losses_and_grads(model, token_ids(2, 40, 5))

    monkeypatch.setattr(sequence_tiles_module, "chunk_starts", dropping_second)
    install_tiled_mlp(model, TILE)
    tiled = losses_and_grads(model, token_ids(2, 40, 5))
    # not `> 1e-2`: the dropped tile's rows are never written, so they may hold NaN (uninitialised memory)
    assert not max_rel_diff(tiled[3], untiled[3]) <= 1e-2
    with pytest.raises(AssertionError):
        assert_exact(tiled, untiled)


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
def test_no_op_holds_more_than_a_tile_of_intermediates(kind, tiled):
    """Forward and backward with checkpointing: tiled, no [rows, intermediate] op output exceeds the tile's rows (an
    MoE's: the tile's tokens x top-k, together in transformers' grouped experts, or one expert's share of them);
    untiled (the negative control) the whole sequence's appear."""
    model = kind_model(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if tiled:
        install_tiled_mlp(model, TILE)
    input_ids = token_ids(2, 50, 6)
    widths = {WIDE} if kind == "gpt2" else {EXPERT, 2 * EXPERT}  # 2-D: a 3-D [experts, ...] is a weight
    with LargestRows(lambda tensor: tensor.dim() == 2 and tensor.shape[-1] in widths, weight_rows=HIDDEN) as meter:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    top_k = 1 if kind == "gpt2" else 2
    assert 0 < meter.rows <= TILE * top_k if tiled else meter.rows > TILE * top_k


@pytest.mark.skipif(not is_available("bitsandbytes"), reason="needs leantune[bitsandbytes]")
@pytest.mark.parametrize("kind", ["gpt_neox", "mixtral"])
def test_4bit_qlora_adapters_get_the_untiled_gradients(kind, tmp_path):
    """QLoRA: GPT-NeoX's MLP projections in 4 bits, LoRA on them; Mixtral's attention in 4 bits (its experts are
    parameters, not linear layers: kept in fp32), LoRA on the attention (the experts' adapters: the test above)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kind_model(kind).save_pretrained(tmp_path)
    quantised = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, device_map={"": "cpu"},
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32))
    torch.manual_seed(1)
    targets = "all-linear" if kind == "gpt_neox" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = get_peft_model(prepare_model_for_kbit_training(quantised, use_gradient_checkpointing=False),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    model.train()
    tiled, untiled, parts = tiled_and_untiled(model, token_ids(2, 40, 7))
    assert parts == 2 and any("lora_" in name for name in untiled[3])
    assert_exact(tiled, untiled)


def opt_model():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
                                    vocab_size=100, word_embed_proj_dim=32))


def llama4_model():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    return Llama4ForCausalLM(Llama4TextConfig(
        hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=100, num_local_experts=2, num_experts_per_tok=1))


@pytest.mark.parametrize("build, kind", [(opt_model, "no decoder layer with an MLP module"),
                                         (llama4_model, "Llama4TextMoe")])
def test_mlps_it_cannot_tile_are_refused_in_one_line(build, kind):
    """OPT keeps its MLP's projections on the layer; Llama-4's experts run over [experts x tokens] rows, not per
    token. The planner does not offer them (`can_tile`)."""
    model = build()
    assert not can_tile(model)
    with pytest.raises(ValueError, match=rf"^`tiled_mlp=True` tiles .*has {kind}: set `tiled_mlp=False`\.$"):
        install_tiled_mlp(model, TILE)


def test_experts_split_over_ranks_are_refused():
    """Expert parallelism: each tile would be an all-to-all of its own, a count the ranks need not share."""
    model = kind_model("mixtral")
    for layer in model.model.layers:
        layer.mlp.experts._is_expert_parallel = True
    assert not can_tile(model)


def test_the_planner_offers_these_kinds_and_sizes_their_tile():
    from transformers import OPTConfig

    from leantune import SFTTrainer
    from leantune.planning.tile_size import tiles_model

    assert all(tiles_model(kind_config(kind), SFTTrainer) for kind in ("gpt2", "gpt_neox", "mixtral", "qwen2_moe"))
    assert not tiles_model(OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
                                     vocab_size=100, word_embed_proj_dim=32), SFTTrainer)
    # what one tile's token holds: a dense MLP's width; an MoE layer's top-k experts' together
    assert config_intermediate_width(kind_config("gpt2")) == 4 * HIDDEN  # GPT-2's n_inner=None
    assert config_intermediate_width(kind_config("falcon")) == WIDE
    assert config_intermediate_width(kind_config("mixtral")) == 2 * EXPERT
    assert config_intermediate_width(kind_config("qwen2_moe")) == WIDE  # its dense layers' 256 > 2 x 48


@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
def test_sft_trains_the_same_with_tiled_mlp(kind, tokenizer, gsm8k_rows, tmp_path):
    """Real optimizer steps, packed padding-free rows; Mixtral's training loss includes its load-balancing loss."""
    from leantune import SFTConfig, SFTTrainer

    from ..fixtures.data import gsm8k_prompt_completion
    from .test_tiled_mlp import assert_runs_equal, trained

    def run(tiled: bool, folder: str):
        tiling = dict(tiled_mlp=True, tiled_mlp_tile_size=TILE) if tiled else {}
        args = SFTConfig(output_dir=str(tmp_path / folder), report_to=[], save_strategy="no", use_cpu=True,
                         max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, seed=0,
                         disable_tqdm=True, memory_breakdown=False, max_grad_norm=0.0, max_length=128, packing=True,
                         padding_free=True, **tiling)
        trainer = SFTTrainer(model=kind_model(kind, vocab_size=32000), args=args,
                             train_dataset=gsm8k_prompt_completion(gsm8k_rows, 8), processing_class=tokenizer)
        assert sum(isinstance(module, TiledMLP) for module in trainer.model.modules()) == (2 if tiled else 0)
        return trained(trainer)

    assert_runs_equal(run(True, "t"), run(False, "u"), 2)
