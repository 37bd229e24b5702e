"""The planner and the budget search with the attention block's norms and projections tiled
(`tiled_attention_projections`, memory/tiled_projections.py): the fake step traces the tiled modules, so the planned
peak drops by what a tile no longer holds, the plan equals the run's own breakdown and the CPU allocator's measure,
and the search offers the technique in its most frugal candidate and turns it off again where the step fits
without it."""

from __future__ import annotations

import contextlib
import io

import pytest
from datasets import Dataset
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig

from devkit.allocator_meter import AllocatorMeter
from leantune import SFTConfig, SFTTrainer
from leantune.memory.checkpoint_offload import unsupported_by_transformers
from leantune.memory.tiled_projections import TiledProjection
from leantune.planning import plan_memory
from leantune.planning.recommend import candidates, most_frugal, recommend
from leantune.planning.run_facts import RunFacts

HIDDEN, TOKENS = 256, 2048
# a Llama whose attention side is as wide as its MLP's half: at 2,048 tokens a layer's fp32 [tokens, hidden] (2 MiB)
# is what the norms' upcasts and the LoRA dropout masks and inputs are made of
LLAMA = dict(vocab_size=32000, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
FIELDS = dict(per_device_train_batch_size=1, max_length=TOKENS, padding_free=True, loss_chunk_size=64,
              tiled_mlp=True, tiled_mlp_tile_size=256)


def lora() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")


def long_rows() -> Dataset:
    """Two rows cut to `TOKENS` tokens (numbers): one call of each module holds that many tokens."""
    return Dataset.from_dict({"prompt": ["count: "] * 2, "completion": [" ".join(str(i % 97) for i in range(900))] * 2})


@pytest.mark.quick
def test_the_search_offers_it_beside_the_tiled_mlp_and_in_the_most_frugal_candidate():
    llama, fields = LlamaConfig(**LLAMA), {**FIELDS, "tiled_mlp": False, "tiled_mlp_tile_size": None}
    found = candidates("sft", fields, None, 1, RunFacts("sft", llama, fields))
    on = [c for c in found if c.fields.get("tiled_attention_projections")]
    assert on and all(c.fields["tiled_mlp"] for c in on)  # never without the tiled MLP (its tile is the MLP's)
    assert any(c.fields["tiled_mlp"] and not c.fields.get("tiled_attention_projections") for c in found)
    assert most_frugal(found).fields["tiled_attention_projections"] is True
    # a run with the tiled MLP on already (kept as it is) is offered the projections beside it
    kept = {**fields, "tiled_mlp": True}
    assert any(c.fields.get("tiled_attention_projections")
               for c in candidates("sft", kept, None, 1, RunFacts("sft", llama, kept)))
    # negative control: OPT's MLP is not one the tiled MLP tiles, so neither is offered
    opt = OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
                    word_embed_proj_dim=64)
    assert not any(c.fields.get("tiled_attention_projections")
                   for c in candidates("sft", fields, None, 1, RunFacts("sft", opt, fields)))


def test_the_planned_peak_drops_and_equals_the_run_and_the_allocator(tokenizer, tmp_path):
    """Planned with and without the block tiled (LoRA with TRL's dropout 0.05, the tiled MLP on in both); the tiled
    configuration then trained for real, its second step measured by the run's breakdown (MemTracker) and by the CPU
    allocator (devkit/allocator_meter.py: torch.profiler's memory events, nothing of the planner's)."""
    config, dataset = LlamaConfig(**LLAMA), long_rows()

    def plan(**extra):
        return plan_memory(config, dataset, "sft", processing_class=tokenizer, peft_config=lora(), **FIELDS, **extra)

    untiled, tiled = plan(), plan(tiled_attention_projections=True)
    fp32_rows = TOKENS * HIDDEN * 4  # one fp32 [tokens, hidden]: 2 MiB
    # measured 12.9 MB less (activations 35.8 -> 18.7 MB): at least four fp32 [tokens, hidden] (the norms' upcast
    # inputs, the adapters' fp32 inputs and dropout masks) no longer held at full length
    assert untiled.peak_bytes - tiled.peak_bytes >= 4 * fp32_rows, (untiled.peak_bytes, tiled.peak_bytes)
    assert "tiled attention projections" in " ".join(tiled.notes)

    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    args = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True, max_steps=2, logging_steps=1, tiled_attention_projections=True, **FIELDS)
    before = AllocatorMeter.live_storage_bytes()
    trainer = SFTTrainer(model=str(tmp_path / "model"), args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora())
    assert sum(isinstance(module, TiledProjection) for module in trainer.model.modules()) == 12
    meter = AllocatorMeter(step=1)  # the second step, the one the plan's `measured_step` predicts
    with contextlib.redirect_stdout(io.StringIO()), meter.profiling(trainer):
        trainer.train()
    assert trainer.memory_breakdown.peak_bytes == tiled.measured_step.peak_bytes  # the same tensors, to the byte
    allocator = meter.peak_bytes - before
    # the allocator also sees op-internal scratch that no tensor of the trace holds (metrics/op_scratch.py): 2%
    assert abs(allocator - tiled.measured_step.peak_bytes) <= 0.02 * allocator, (allocator, tiled.measured_step)


def test_the_search_keeps_it_on_only_where_the_step_needs_it(tokenizer):
    """From the frugal end (the run asked for is far over its budget): under a budget between the frugal plans with
    and without the block tiled it stays on ("off again: over the budget, so kept"); under one the step fits without
    it the search turns it off again."""
    config, dataset = LlamaConfig(**LLAMA), long_rows()
    fields = dict(per_device_train_batch_size=1, max_length=TOKENS, padding_free=True, gradient_checkpointing=False,
                  loss_chunk_size=16)  # the loss head's chunk small: the layers hold the peak

    def plan(**extra):
        return plan_memory(config, dataset, "sft", processing_class=tokenizer, peft_config=lora(),
                           measured_step=False, **{**fields, **extra})

    configured = plan()
    frugal = dict(gradient_checkpointing=True, tiled_mlp=True, tiled_mlp_tile_size=256)
    with_block, without = plan(**frugal, tiled_attention_projections=True), plan(**frugal)
    assert with_block.device_total_bytes < without.device_total_bytes < configured.device_total_bytes / 1.25
    plan_args = type("PlanArgs", (), dict(device="cpu", memory_budget="1B", num_processes=1, engine="ddp"))

    def search(budget):
        return recommend(configured, budget, config, dataset, "sft", lora(), plan_args, fields, tokenizer, limit=5)

    tight = search((with_block.device_total_bytes + without.device_total_bytes) // 2)
    assert tight.considered[0].fields["tiled_attention_projections"] is True
    assert tight.chosen is not None and tight.chosen.fields["tiled_attention_projections"] is True
    assert "  tiled_attention_projections off again: over the budget, so kept" in tight.steps
    assert "on: tiled_attention_projections=True: " in "\n".join(tight.lines())
    # a budget the frugal end fits with the block untiled (checkpoint offload on: on a CPU plan its copies stay on
    # the device) but that checkpointing off does not, even with the block tiled: the block's tiling is turned off
    offload = {} if unsupported_by_transformers() else {"checkpoint_offload_layers": "auto"}  # refused on 5.17
    offloaded = plan(**frugal, **offload)
    unchecked = plan(**{**frugal, "gradient_checkpointing": False}, tiled_attention_projections=True)
    assert offloaded.device_total_bytes < unchecked.device_total_bytes  # measured 115.5 against 116.2 MB
    loose = search((offloaded.device_total_bytes + unchecked.device_total_bytes) // 2)
    assert loose.chosen is not None and not loose.chosen.fields.get("tiled_attention_projections")


@pytest.mark.skipif(unsupported_by_transformers() is not None, reason="checkpoint offload is refused by this "
                    "transformers (it checkpoints a layer's whole call)")
def test_a_two_layer_trace_that_peaks_elsewhere_is_retraced_from_three_layers(tokenizer, monkeypatch):
    """The 8B QLoRA row at 500,000 tokens, small: with the MLP and the attention block tiled and the layer inputs on
    the host, the 2-layer trace peaks in the final norm's backward (a moment the layers do not grow), so 2, 3 and 4
    layers are not linear (with checkpoint offload's traces, every layer's input but the last on the host); 3, 4
    and 5 are, and the plan from them equals the trace of all 6 layers to the byte.
    Before, such a plan traced every layer (at 500,000 tokens minutes a plan, each candidate of the budget search)."""
    from leantune.planning import planner

    tokens = 8192  # long against the hidden size, as 500,000 is against 4,096: the final norm's fp32 rows show
    config = LlamaConfig(**{**LLAMA, "num_hidden_layers": 6, "max_position_embeddings": 2 * tokens})
    dataset = Dataset.from_dict({"prompt": ["count: "], "completion": [" ".join(str(i % 97) for i in range(tokens))]})

    def plan():
        return planner.plan_memory(config, dataset, "sft", processing_class=tokenizer, peft_config=lora(),
                                   measured_step=False, device="h100", host_memory="128GiB",
                                   checkpoint_offload_layers="auto", tiled_attention_projections=True,
                                   **{**FIELDS, "max_length": tokens})

    retraced = plan()
    assert any(note.startswith("traced with 3, 4, 5 of the 6 layers") for note in retraced.notes), retraced.notes
    monkeypatch.setattr(planner, "_layer_count", lambda config: None)  # all 6 layers traced
    whole = plan()
    assert retraced.peak_bytes == whole.peak_bytes
    assert (retraced.offload.layers, retraced.offload.host_bytes) == (whole.offload.layers, whole.offload.host_bytes)
