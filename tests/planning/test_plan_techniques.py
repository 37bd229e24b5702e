"""The budget search's state and activation techniques (planning/recommend.py TECHNIQUES): the tiled MLP, turned on
with the largest tile whose plan fits (planning/tile_size.py), only for a model whose MLPs it can tile; the optimizer
step inside the backward, only where the run's config accepts it (planning/run_facts.py). A run sizing itself with
`memory_budget` trains with the tile the plan chose, within the budget."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
from datasets import Dataset
from transformers import GPT2Config, LlamaConfig, OPTConfig, Qwen2MoeConfig

from leantune.memory.tiled_mlp import TiledMLP
from leantune.planning import plan_memory
from leantune.planning.recommend import candidates, recommend
from leantune.planning.run_facts import RunFacts

MIB = 1 << 20
# hidden 64, MLP 64x wider: at ~1,800 tokens a layer's [tokens, 4,096] fp32 intermediates (~28 MiB each) are the step
LLAMA = dict(vocab_size=32000, hidden_size=64, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FIELDS = dict(per_device_train_batch_size=1, max_length=2048, padding_free=True, loss_chunk_size=64)


def long_rows() -> Dataset:
    """Two rows of ~1,800 tokens (numbers): one MLP call holds that many tokens."""
    return Dataset.from_dict({"prompt": ["count: "] * 2, "completion": [" ".join(str(i % 97) for i in range(900))] * 2})


def tiled_candidates(config, fields, **facts) -> list:
    return [c for c in candidates("sft", fields, None, 1, RunFacts("sft", config, fields, **facts))
            if c.fields.get("tiled_mlp")]


@pytest.mark.quick
def test_tiled_mlp_is_offered_only_for_models_whose_mlps_it_tiles():
    llama = LlamaConfig(**LLAMA)
    assert tiled_candidates(llama, FIELDS)  # gate/up/down per token
    # GPT-2's non-gated MLP and a mixture of experts' experts tile too (memory/mlp_kinds.py); negative control: OPT's
    # MLP projections live on the layer itself, no MLP module to wrap
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000)
    moe = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, vocab_size=1000)
    opt = OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
                    word_embed_proj_dim=64)
    assert tiled_candidates(gpt2, FIELDS) and tiled_candidates(moe, FIELDS) and tiled_candidates(opt, FIELDS) == []
    # a run that has it on already keeps it (KEEP: the search never turns a technique the run set off)
    assert tiled_candidates(llama, {**FIELDS, "tiled_mlp": True}) and all(
        c.fields["tiled_mlp"] for c in candidates("sft", {**FIELDS, "tiled_mlp": True}, None, 1,
                                                  RunFacts("sft", llama, {**FIELDS, "tiled_mlp": True})))


@pytest.mark.quick
def test_the_step_inside_the_backward_is_offered_only_where_the_config_accepts_it():
    llama = LlamaConfig(**LLAMA)

    def offered(fields, **facts) -> bool:
        found = candidates("sft", fields, None, 1, RunFacts("sft", llama, fields, **facts))
        return any(c.fields.get("optimizer_in_backward") for c in found)

    unclipped = {**FIELDS, "max_grad_norm": 0.0}
    assert offered(unclipped)
    # TRL's default clipping (1.0) is refused by the config: the search never turns clipping off to get it
    assert not offered(FIELDS)
    assert not offered({**unclipped, "nonfinite_policy": "skip"})
    assert not offered({**unclipped, "optim": "lomo"})
    assert not offered(unclipped, adapters=True)  # a LoRA run's gradients are its adapters': nothing to win
    assert not offered(unclipped, num_processes=2)
    assert not offered(unclipped, engine="zero2")


@pytest.mark.quick
def test_the_techniques_costs_are_the_documented_ones():
    import re

    from leantune.planning.recommend import IN_BACKWARD_COST, TILED_MLP_COST

    from ..fixtures.paths import REPO

    table = (REPO / "docs" / "plan.md").read_text()
    for rule, cost in (("tiled MLP", TILED_MLP_COST), ("optimizer step inside the backward", IN_BACKWARD_COST)):
        assert float(re.search(rf"\| {rule} \| x([0-9.]+)", table).group(1)) == cost


def test_the_budget_turns_on_the_tiled_mlp_with_the_largest_tile_that_fits(tokenizer):
    config, dataset = LlamaConfig(**LLAMA), long_rows()

    def plan(**extra):
        return plan_memory(config, dataset, "sft", processing_class=tokenizer, measured_step=False, **FIELDS, **extra)

    untiled, at_512 = plan(), plan(tiled_mlp=True, tiled_mlp_tile_size=512)
    budget = (untiled.peak_bytes + at_512.peak_bytes) // 2  # tiles of 512 fit, untiled does not
    plan_args = type("PlanArgs", (), dict(device="cpu", memory_budget=str(budget), num_processes=1, engine="ddp"))

    def keep(candidate) -> bool:  # the run's layout, checkpointing on: the tiled MLP is what decides
        return candidate.fields["padding_free"] and candidate.fields["gradient_checkpointing"]

    found = recommend(untiled, budget, config, dataset, "sft", None, plan_args, FIELDS, tokenizer, keep=keep)
    chosen = found.chosen
    assert chosen is not None and chosen.fields["tiled_mlp"] is True
    tile = chosen.fields["tiled_mlp_tile_size"]
    assert tile >= 512 and tile % 256 == 0 and chosen.total_bytes <= budget  # 256: the CPU's launch floor
    assert plan(tiled_mlp=True, tiled_mlp_tile_size=tile).device_total_bytes == chosen.total_bytes
    assert plan(tiled_mlp=True, tiled_mlp_tile_size=2 * tile).device_total_bytes > budget  # the next tile does not
    assert f"  --tiled_mlp_tile_size {tile}" in found.lines()


def test_a_run_under_its_budget_trains_with_the_planned_tile_within_it(tokenizer, tmp_path, caplog):
    """The run sizes itself (memory_budget): the tiled MLP turned on, with a tile, said in one line with why; then it
    trains two real steps and its measured step peak (the memory breakdown, step 2) is within the budget."""
    from transformers import LlamaForCausalLM

    from leantune import SFTConfig, SFTTrainer

    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(tmp_path / "model")
    config, dataset = LlamaConfig(**LLAMA), long_rows()
    untiled = plan_memory(config, dataset, "sft", processing_class=tokenizer, measured_step=False, **FIELDS)
    at_256 = plan_memory(config, dataset, "sft", processing_class=tokenizer, measured_step=False, tiled_mlp=True,
                         tiled_mlp_tile_size=256, **FIELDS)
    budget = (untiled.peak_bytes + at_256.peak_bytes) // 2
    args = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", max_steps=2,
                     disable_tqdm=True, logging_steps=1, memory_budget=f"{budget}B", **FIELDS)
    with caplog.at_level(logging.INFO, logger="leantune.plan"):
        trainer = SFTTrainer(model=str(tmp_path / "model"), args=args, train_dataset=dataset,
                             processing_class=tokenizer)
    changes = trainer.memory_budget_fit.changes
    assert changes["tiled_mlp"] == (False, True) and trainer.args.tiled_mlp
    tile = trainer.args.tiled_mlp_tile_size
    assert changes["tiled_mlp_tile_size"] == (None, tile) and tile >= 256
    turned_on = [r.getMessage() for r in caplog.records if r.getMessage().startswith("turned on tiled_mlp=True")]
    assert len(turned_on) == 1 and "never holding [tokens, intermediate]" in turned_on[0]
    mlps = [m for m in trainer.model.modules() if isinstance(m, TiledMLP)]
    assert len(mlps) == 2 and all(m.tiled_mlp_tile_size == tile for m in mlps)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.memory_breakdown.peak_bytes <= budget


def test_without_a_budget_the_plan_traces_and_names_the_runs_own_tile_rule(tokenizer):
    """`tiled_mlp=True` with no tile and no budget: the plan traces the tile the run's rule gives on the device planned
    for (an H100's memory here, not this machine's), and says so."""
    from leantune.memory.tiled_mlp import tile_tokens
    from leantune.metrics.devices import parse_budget
    from leantune.planning.tile_size import UNBOUNDED_TOKENS

    plan = plan_memory(LlamaConfig(**LLAMA), long_rows(), "sft", processing_class=tokenizer, measured_step=False,
                       device="h100", tiled_mlp=True, **FIELDS)
    tile = tile_tokens(UNBOUNDED_TOKENS, LLAMA["intermediate_size"], 4, parse_budget("h100"), "cuda")  # fp32 weights
    assert plan.config["tiled_mlp_tile_size"] == tile > 1024
    assert any(line.startswith(f"note: tiled MLP: {tile:,} tokens per tile, the run's rule against h100's memory")
               for line in plan.lines())


def test_a_run_far_over_its_budget_is_searched_from_the_frugal_end(tokenizer):
    """The run as asked needs over 1.25x its budget (here over twice): the search plans the most frugal candidate first (every technique
    that applies on, the tiled MLP at the launch floor) and turns techniques off again while the step fits, instead of
    spending its limit on fast candidates that miss by far. The answer fits, to the byte of its own plan."""
    config, dataset = LlamaConfig(**LLAMA), long_rows()
    fields = {**FIELDS, "loss_chunk_size": None, "gradient_checkpointing": False}

    def plan(**extra):
        return plan_memory(config, dataset, "sft", processing_class=tokenizer, measured_step=False,
                           **{**fields, **extra})

    configured = plan()
    frugal = plan(gradient_checkpointing=True, tiled_mlp=True, tiled_mlp_tile_size=256, loss_chunk_size=131)
    budget = (configured.peak_bytes // 2 + frugal.peak_bytes) // 2  # the frugal end fits; the run asked, over twice
    assert configured.device_total_bytes > 2 * budget and frugal.device_total_bytes < budget
    plan_args = type("PlanArgs", (), dict(device="cpu", memory_budget=str(budget), num_processes=1, engine="ddp"))
    found = recommend(configured, budget, config, dataset, "sft", None, plan_args, fields, tokenizer, limit=4)
    first, chosen = found.considered[0], found.chosen
    assert found.from_frugal_end == configured.device_total_bytes
    assert first.fields["gradient_checkpointing"] and first.fields["tiled_mlp"] and first.fields["loss_chunk_size"] == 131
    assert first.fields["tiled_mlp_tile_size"] == 256 and first.total_bytes <= budget  # the CPU's launch floor
    assert chosen is not None and chosen.fields["tiled_mlp"] and chosen.total_bytes <= budget
    assert chosen.relative_time < first.relative_time  # something was turned off again for speed
    assert len(found.considered) <= 4 and len(found.steps) == len(found.considered) - 1
    assert plan(**chosen.fields).device_total_bytes == chosen.total_bytes
    lines = "\n".join(found.lines())
    assert "so the search starts from the most frugal candidate" in lines and "on: tiled_mlp=True: " in lines


@pytest.mark.quick
def test_a_search_from_the_frugal_end_that_fits_plans_no_shorter_length():
    """The shorter `max_length` is searched when the same-result search gave speed up; from the frugal end every answer
    did (the first planned is the slowest), so it is searched there only when nothing fits (each search is several
    plans: the 8B row at 131,072 tokens spent minutes on it after its answer fitted)."""
    from leantune import SFTConfig
    from leantune.planning.length_suggestion import suggest_for_budget
    from leantune.planning.recommend import Candidate, Recommendation

    frugal, answer = Candidate({"max_length": 2048}, 1.6, 10, 10), Candidate({"max_length": 2048}, 1.2, 20, 20)
    searched = []

    def search(fields):
        searched.append(fields)
        return Recommendation(30)

    lengths = [2048] + [100] * 200
    fitted = Recommendation(30, [frugal, answer], answer, from_frugal_end=100)
    assert suggest_for_budget(fitted, lengths, SFTConfig, {"max_length": 2048}, 0.9, search).search is None
    assert not searched
    none_fits = Recommendation(30, [frugal], None, from_frugal_end=100)
    assert suggest_for_budget(none_fits, lengths, SFTConfig, {"max_length": 2048}, 0.9, search).search is not None
    fastest_first = Recommendation(30, [frugal, answer], answer)  # gave speed up: searched, as before
    assert suggest_for_budget(fastest_first, lengths, SFTConfig, {"max_length": 2048}, 0.9, search).search is not None


@pytest.mark.quick
def test_none_fits_offers_lora_only_to_a_run_without_adapters():
    """The 8B QLoRA row at 500,000 tokens said "a smaller model, LoRA, ..." to a run that was QLoRA already: a run
    with adapters is offered a shorter max_length in LoRA's place."""
    from leantune.planning.recommend import Candidate, Recommendation

    frugal = Candidate({"max_length": 2048}, 1.6, 50, 50)
    full = Recommendation(30, [frugal], None, from_frugal_end=100).lines()[-1]
    adapters = Recommendation(30, [frugal], None, from_frugal_end=100, adapters=True).lines()[-1]
    assert full.startswith("none fits") and "LoRA" in full and "max_length" not in full
    assert adapters.startswith("none fits") and "LoRA" not in adapters and "a shorter max_length" in adapters
