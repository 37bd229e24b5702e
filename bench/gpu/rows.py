"""The kit's rows, most valuable first. Each row fills its `row` dict as it goes (so a row cut by its time budget
keeps what it measured) and raises on failure; bench/gpu/kit.py runs them, times them and writes the results."""

from __future__ import annotations

import random
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .harness import (
    GIB,
    Meter,
    ProbeTimeout,
    RowTimeout,
    Settings,
    build_model,
    compare_losses,
    dataset,
    error_record,
    free_memory,
    is_oom,
    load_4bit,
    log,
    lora_config,
    loss_tolerance,
    preference_rows,
    prompt_rows,
    quantized_checkpoint,
    random_text,
    text_rows,
    time_limit,
    train_measured,
    unpaired_rows,
)
from .plan_worker import PlanJob, PlanWorkers

LIBRARIES = ("leantune", "trl")
# --dry plans in this row only (and the longest-context seeds), and runs its warm rerun of leantune in this row only.
DRY_PLANNED_ROW = "sft_qwen2.5-1.5b_padded"
LONGEST_CONTEXT_ROW = "longest_context_llama-3.1-8b_qlora"


@dataclass
class Context:
    settings: Settings
    tok: object
    scratch: Path
    planner: PlanWorkers
    seed_plans: dict = field(default_factory=dict)  # longest context: planner seed length -> plan job id


def config_class(library: str, method: str):
    import importlib

    module = importlib.import_module("leantune" if library == "leantune" else "trl")
    return getattr(module, f"{method}Config"), getattr(module, f"{method}Trainer")


# TRL's CUDA-only paths: on CPU (--dry) TRL runs without them, and its losses are still the reference, since
# neither changes the arithmetic. TRL's `use_liger_kernel` patches the model with Liger's RMSNorm/RoPE/SwiGLU
# kernels, which Triton's interpreter cannot run; its activation offloading needs a CUDA stream.
TRL_CUDA_ONLY = ("use_liger_kernel", "activation_offloading")


def library_fields(library: str, fields: dict, leantune_only: dict | None = None, dry: bool = False) -> dict:
    fields = dict(fields)
    if library == "leantune":
        fields["memory_breakdown"] = False  # the kit's own meter measures both libraries alike
        fields.update(leantune_only or {})
    elif dry:
        for name in TRL_CUDA_ONLY:
            fields.pop(name, None)
    return fields


def run_pair(ctx: Context, row: dict, method: str, shape: str, train_rows: list[dict], fields: dict,
             leantune_only: dict | None = None, peft: bool = False, quantized: bool = False,
             compare: bool = True, trainer_kwargs: dict | None = None, reference: bool = False) -> None:
    """leantune, then TRL, then (on the GPU) leantune again, on the same model (same seed), data and settings. The
    planner gets leantune's run in its own process (plan_worker.py); its figures join the row when they arrive.

    The rerun: the first run in a row pays the CUDA warm-up of the row's new shapes (cuBLAS and SDPA pick their
    kernels per shape), which the next run reuses. On the H100, DPO twice in one process: leantune 2,169 tok/s
    against TRL's 12,649 the first time, 11,605 against 13,531 the second. So leantune's `tokens_per_s` is its warm
    rerun's (TRL's run is warm already: it follows leantune's), the first is kept as `tokens_per_s_cold`. On CPU
    (--dry) the rerun's losses must equal the first run's (same seed) within the row's tolerance; on CUDA their
    difference is the run-to-run noise that widens the leantune-vs-TRL tolerance (harness.compare_losses)."""
    settings = ctx.settings
    results = row.setdefault("libraries", {})
    shared_4bit = None
    if quantized:  # one 4-bit load for every run (an 8B load quantizes 16 GB): each trainer adds the adapter
        started = time.perf_counter()
        shared_4bit = load_4bit(settings, quantized_checkpoint(settings, shape, ctx.tok, ctx.scratch / shape))
        row["load_4bit_s"] = round(time.perf_counter() - started, 1)
    run = dict(ctx=ctx, row=row, method=method, shape=shape, train_rows=train_rows, fields=fields,
               leantune_only=leantune_only, peft=peft, shared_4bit=shared_4bit, trainer_kwargs=trainer_kwargs,
               reference=reference)
    for library in LIBRARIES:
        results[library] = run_library(library, **run)
        if library == "leantune":
            submit_plan(ctx, row, PlanJob(shape, train_rows, method.lower(),
                                          library_fields("leantune", fields, leantune_only),
                                          lora_config() if peft else None, quantized,
                                          (trainer_kwargs or {}).get("reward_funcs")))
    lt = results["leantune"]
    rerun = None
    if "error" not in lt:
        lt["tokens_per_s_cold"] = lt["tokens_per_s"]
        skip = rerun_skipped(ctx, row, results["trl"])
        if skip:
            lt["warm_rerun"] = f"skipped: {skip}"
        else:
            rerun = run_library("leantune", **run, label="leantune (warm rerun)")
            lt["warm_rerun"] = {k: rerun[k] for k in ("losses", "tokens_per_s", "step_seconds", "max_allocated_gib",
                                                      "run_s", "error", "generation_seconds", "rest_seconds")
                                if k in rerun}
            if "error" not in rerun:
                lt["tokens_per_s"] = rerun["tokens_per_s"]
    del shared_4bit, run
    free_memory()
    dropped = [name for name in TRL_CUDA_ONLY if fields.get(name)] if settings.dry else []
    if dropped:
        row["summary"] = f"dry (CPU): TRL ran without {dropped} (CUDA only); losses compared with leantune's"
    errors = [f"{lib}: {r['error']}" for lib, r in results.items() if "error" in r]
    if rerun is not None and "error" in rerun:
        errors.append(f"leantune (warm rerun): {rerun['error']}")
    if errors:
        raise RuntimeError("; ".join(errors))
    # Sampled completions (GRPO): the rerun times the warm path; its losses are another sample, not a check.
    same = compare_losses(settings, rerun["losses"], lt["losses"]) if rerun is not None and compare else None
    noise = None
    if same is not None:
        lt["warm_rerun"]["loss_max_rel_diff"] = same["loss_max_rel_diff"]
        if not settings.dry:  # CUDA's run-to-run noise: measured, not a failure (see below)
            noise, same = same["loss_max_rel_diff"], None
    if compare:
        row.update(compare_losses(settings, lt["losses"], results["trl"]["losses"], noise))
        if not row["losses_match"]:
            raise AssertionError(f"per-step losses differ by {row['loss_max_rel_diff']:.3g} relative "
                                 f"(tolerance {row['loss_rtol']:.3g}): leantune {lt['losses']}, "
                                 f"TRL {results['trl']['losses']}")
    if same is not None and not same["losses_match"]:
        raise AssertionError(f"leantune's warm rerun (same seed) differs from its first run by "
                             f"{same['loss_max_rel_diff']} relative (tolerance {same['loss_rtol']:.3g}): "
                             f"{rerun['losses']} vs {lt['losses']}")


def run_library(library: str, ctx: Context, row: dict, method: str, shape: str, train_rows: list[dict],
                fields: dict, leantune_only: dict | None, peft: bool, shared_4bit, trainer_kwargs: dict | None,
                reference: bool, label: str | None = None) -> dict:
    """One library's measured run on a fresh model (or the shared 4-bit one): its result, or its error record (one
    library failing must not hide the other)."""
    settings = ctx.settings
    model = trainer = None
    started = time.perf_counter()
    try:
        model = shared_4bit if shared_4bit is not None else build_model(settings, shape, ctx.tok)
        config_cls, trainer_cls = config_class(library, method)
        args = config_cls(**library_fields(library, fields, leantune_only, settings.dry))
        kwargs = dict(trainer_kwargs or {})
        if reference:  # the same frozen copy for both (TRL would load it from the Hub id, which there is none)
            kwargs["ref_model"] = build_model(settings, shape, ctx.tok)
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset(train_rows), processing_class=ctx.tok,
                              peft_config=lora_config() if peft else None, **kwargs)
        kwargs.clear()
        setup_s = time.perf_counter() - started
        result = train_measured(settings, trainer, model)
        result["setup_s"] = round(setup_s, 1)
        log(settings, f"  {row['name']} / {label or library}: peak {result['max_allocated_gib']:.2f} GiB "
                      f"({result['meter']}), {result['tokens_per_s'] or 0:,.0f} tok/s, losses {result['losses']}")
    except RowTimeout:
        raise
    except Exception as error:  # noqa: BLE001 - reported by the caller
        result = error_record(error)
        log(settings, f"  {row['name']} / {label or library}: ERROR {result['error']}")
    finally:
        if trainer is not None and shared_4bit is not None:
            unload_adapter(trainer)
        del model, trainer
        free_memory()
    result["run_s"] = round(time.perf_counter() - started, 1)
    return result


def submit_plan(ctx: Context, row: dict, job: PlanJob) -> None:
    """leantune's run, planned in the planner's process; the row does not wait for it."""
    lt = row["libraries"]["leantune"]
    if "error" in lt:
        return
    if ctx.settings.dry and row["name"] != DRY_PLANNED_ROW:
        lt["plan_error"] = f"skipped in --dry (its trace is most of a tiny row's CPU time; see {DRY_PLANNED_ROW})"
        return
    ctx.planner.submit(job, row)


def rerun_skipped(ctx: Context, row: dict, trl: dict) -> str | None:
    """Why leantune's warm rerun is not run in this row, or None to run it."""
    if ctx.settings.dry and row["name"] != DRY_PLANNED_ROW:
        return f"in --dry it runs in {DRY_PLANNED_ROW} only (tiny CPU rows have no CUDA warm-up)"
    # TRL's run followed leantune's on the same shapes: warm, as the rerun will be; 1.5x and 3 s of margin.
    if "error" in trl:
        return "TRL's run failed: no warm-up to match"
    needed = 1.5 * trl.get("run_s", 0.0) + 3.0
    left = row["_budget_left"]()
    if left < needed:
        return f"{left:.0f} s of the row's budget left, the rerun needs ~{needed:.0f} s (1.5x TRL's run + 3 s)"
    return None


def unload_adapter(trainer) -> None:
    """Take the trainer's LoRA adapter out of the shared 4-bit base model, in place, and put back the dtypes the
    base was loaded with: a library may cast weights in place (leantune's QLoRA preparation cast the embeddings, head
    and norms to fp32 until 2026-11-28, so TRL's runs after it measured that fp32 model)."""
    wrapped = trainer.model
    while not hasattr(wrapped, "unload") and hasattr(wrapped, "module"):
        wrapped = wrapped.module
    base = wrapped.unload() if hasattr(wrapped, "unload") else wrapped
    dtypes = getattr(base, "_kit_load_dtypes", {})
    for name, param in base.named_parameters():
        if name in dtypes and param.dtype != dtypes[name]:
            param.data = param.data.to(dtypes[name])  # frozen base weights: bf16 -> fp32 -> bf16 is exact


# --- correctness on the device, fp32, tiny model ------------------------------------------------------------------


def tiny_fp32_model(settings: Settings, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512 if settings.dry else 4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(settings.device, torch.float32)


def rel_diff(a, b) -> float:

    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def liger_chunked_full(ctx: Context, row: dict) -> None:
    """Per-token log-probs and their gradient wrt the hidden states: Liger's fused kernel, leantune's chunked head
    and the full logits. Tolerance as tests/losses/test_liger_cpu.py: fp32 log-softmax in other orders differs by ~1e-6
    on log-probs of ~10 (1e-7 relative): 1e-5 relative to the largest value; gradients 5e-5 (compounded ulps)."""
    import torch

    from leantune.losses.liger import liger_target_logprobs
    from leantune.losses.token_logprobs import chunked_logprobs, logprobs_from_logits, select_targets
    from leantune.models.output_head import OutputHead

    settings = ctx.settings
    model = tiny_fp32_model(settings, ctx.tok)
    torch.manual_seed(1)
    width = 40 if settings.dry else 200  # Triton's interpreter (dry) runs a kernel program by program in numpy
    ids = torch.randint(3, 100, (2, width), device=settings.device)
    labels = ids.clone()
    labels[1, width * 3 // 4:] = -100  # a padded tail: ignored targets
    hidden0 = model.model(input_ids=ids).last_hidden_state.detach()
    head = OutputHead.of(model)
    targets = select_targets(labels)
    values, grads = {}, {}
    for name in ("full", "chunked", "liger"):
        hidden = hidden0.clone().requires_grad_(True)
        if name == "full":
            logps = logprobs_from_logits(head.logits(hidden), targets)
        elif name == "chunked":
            logps = chunked_logprobs(hidden, head, targets, chunk_size=64)
        else:
            logps = liger_target_logprobs(hidden, head, targets)
        (logps * torch.linspace(0.5, 1.5, logps.numel(), device=logps.device)).sum().backward()
        values[name], grads[name] = logps.detach(), hidden.grad.detach()
    row["targets"] = int(targets.tokens.numel())
    row["chunked_vs_full"] = rel_diff(values["chunked"], values["full"])
    row["liger_vs_full"] = rel_diff(values["liger"], values["full"])
    row["chunked_grad_vs_full"] = rel_diff(grads["chunked"], grads["full"])
    row["liger_grad_vs_full"] = rel_diff(grads["liger"], grads["full"])
    bad = {k: row[k] for k in ("chunked_vs_full", "liger_vs_full") if not row[k] <= 1e-5}
    bad.update({k: row[k] for k in ("chunked_grad_vs_full", "liger_grad_vs_full") if not row[k] <= 5e-5})
    row["summary"] = (f"{row['targets']} targets: chunked {row['chunked_vs_full']:.2g}, Liger {row['liger_vs_full']:.2g} "
                      f"(grad {row['chunked_grad_vs_full']:.2g}, {row['liger_grad_vs_full']:.2g}) vs full")
    if bad:
        raise AssertionError(f"over tolerance: {bad}")


def padded_vs_padding_free(ctx: Context, row: dict) -> None:
    """Per-token next-token NLL of every sequence: leantune's padded batch and its padding-free row (one flattened
    row, position ids restarting per sequence) through the same fp32 model on the device. Tolerance 1e-5 relative to
    the largest NLL: the same arithmetic per token, only the attention's batching differs (few fp32 ulps)."""
    import torch
    import torch.nn.functional as F

    from leantune import SFTConfig, SFTTrainer

    settings = ctx.settings
    model = tiny_fp32_model(settings, ctx.tok)
    rows = dataset(text_rows(6, 60 if settings.dry else 400, seed=3))
    per_layout = {}
    for layout, extra in (("padded", {}), ("padding_free", {"padding_free": True})):
        args = SFTConfig(output_dir=str(ctx.scratch / layout), max_length=512, report_to=[], save_strategy="no",
                         per_device_train_batch_size=6, max_steps=1, memory_breakdown=False,
                         use_cpu=settings.dry, **extra)
        trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=ctx.tok)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
        batch = {k: v.to(settings.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_real_tokens")}
        with torch.no_grad():
            logits = model(**inputs).logits.float()
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none",
                              ignore_index=-100)
        sequences = {}
        for r in range(batch["input_ids"].shape[0]):
            ids = batch["input_ids"][r]
            if "attention_mask" in batch:
                n = int(batch["attention_mask"][r].sum())
                bounds = [(0, n)]
            else:
                starts = torch.nonzero(batch["position_ids"][r] == 0).flatten().tolist() + [len(ids)]
                bounds = list(zip(starts[:-1], starts[1:]))
            for a, b in bounds:  # the last position of a sequence predicts nothing of its own
                sequences[tuple(ids[a:b].tolist())] = nll[r, a:b - 1]
        per_layout[layout] = sequences
        del trainer
    padded, flat = per_layout["padded"], per_layout["padding_free"]
    if set(padded) != set(flat):
        raise AssertionError(f"the layouts hold different sequences ({len(padded)} vs {len(flat)})")
    worst = max(rel_diff(flat[key], padded[key]) for key in padded)
    row["sequences"], row["max_rel_diff"] = len(padded), worst
    row["summary"] = f"{len(padded)} sequences, per-token NLL max rel diff {worst:.2g} (tolerance 1e-5)"
    if not worst <= 1e-5:
        raise AssertionError(row["summary"])


# --- the SFT, DPO, KTO, GRPO rows ---------------------------------------------------------------------------------

SFT_VARIANTS = {
    "padded": ({}, {}),
    "packed_padding_free": ({"packing": True, "padding_free": True}, {}),
    "liger": ({"use_liger_kernel": True}, {}),
    "offload_streams": ({"activation_offloading": True}, {"activation_offloading_use_streams": True}),
}


@contextmanager
def liger_patches_undone(dry: bool):
    """Liger's model patching (TRL's `use_liger_kernel`, leantune's on CUDA) also replaces module-level names of
    transformers' modeling_qwen2 / modeling_llama (RoPE, RMSNorm, MLP) and may replace torch's cross_entropy:
    restored after the row, so later rows build the plain models. Dry: Liger's kernels under Triton's interpreter
    need the two bridges of devkit/liger_cpu.py (a float kernel argument; libdevice's tanh/rsqrt)."""
    import torch.nn.functional as F
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    saved = [(module, dict(vars(module))) for module in (modeling_llama, modeling_qwen2)]
    forwards = [(cls, cls.__dict__["forward"]) for cls in (modeling_llama.LlamaForCausalLM,
                                                            modeling_qwen2.Qwen2ForCausalLM)]
    cross_entropy = F.cross_entropy
    bridge = None
    if dry:
        import pytest

        from devkit.liger_cpu import bridge_interpreter_gaps

        bridge = pytest.MonkeyPatch()
        bridge_interpreter_gaps(bridge)
    try:
        yield
    finally:
        for module, names in saved:
            for name in [n for n in vars(module) if n not in names]:
                delattr(module, name)
            for name, value in names.items():
                if vars(module).get(name) is not value:
                    setattr(module, name, value)
        for cls, forward in forwards:
            cls.forward = forward
        F.cross_entropy = cross_entropy
        if bridge is not None:
            bridge.undo()


def sft(shape: str, variant: str, peft: bool = False, quantized: bool = False):
    def row_fn(ctx: Context, row: dict) -> None:
        if variant == "liger":
            with liger_patches_undone(ctx.settings.dry):
                return sft_row(ctx, row, shape, variant, peft, quantized)
        return sft_row(ctx, row, shape, variant, peft, quantized)

    return row_fn


def sft_row(ctx: Context, row: dict, shape: str, variant: str, peft: bool, quantized: bool) -> None:
    settings = ctx.settings
    length, batch = settings.seq_len(shape), settings.batch(shape)
    extra, leantune_only = SFT_VARIANTS.get(variant, ({}, {}))
    rows = text_rows(settings.steps() * batch * 2, length)
    fields = {**settings.common_fields(str(ctx.scratch / row["name"])), "max_length": length,
              "per_device_train_batch_size": batch, "shuffle_dataset": False, **extra}
    run_pair(ctx, row, "SFT", shape, rows, fields, leantune_only, peft=peft, quantized=quantized)


def dpo(ctx: Context, row: dict) -> None:
    settings, shape = ctx.settings, "qwen2.5-1.5b"
    length, batch = settings.seq_len(shape), settings.batch(shape)
    fields = {**settings.common_fields(str(ctx.scratch / row["name"])), "max_length": length, "beta": 0.1,
              "per_device_train_batch_size": batch}
    run_pair(ctx, row, "DPO", shape, preference_rows(settings.steps() * batch, length), fields, reference=True)


def kto(ctx: Context, row: dict) -> None:
    settings, shape = ctx.settings, "qwen2.5-1.5b"
    length, batch = settings.seq_len(shape), settings.batch(shape)
    # The same batches and KL partners for both: TRL draws batches in order and pairs each prompt with its batch
    # neighbour's completion; leantune's default (shuffled batches, a seeded permutation) is another sample of the
    # same estimate, equal only at step 1 (loss 0.5 for any batch). tests/trainers/test_kto.py checks this on CPU.
    fields = {**settings.common_fields(str(ctx.scratch / row["name"])), "max_length": length, "beta": 0.1,
              "per_device_train_batch_size": batch, "train_sampling_strategy": "sequential"}
    run_pair(ctx, row, "KTO", shape, unpaired_rows(settings.steps() * batch, length), fields,
             leantune_only={"kl_pairing": "batch"}, reference=True)


def length_reward(completions, **kwargs):
    """A reward both libraries compute alike: the completion's share of letters."""
    return [sum(ch.isalpha() for ch in str(c)) / max(1, len(str(c))) for c in completions]


def grpo(ctx: Context, row: dict) -> None:
    """transformers generation (no vLLM on the machine). Completions are sampled: the two libraries draw them in
    their own order, so their losses are reported, not compared."""
    settings, shape = ctx.settings, "qwen2.5-1.5b"
    batch = settings.batch(shape)
    completion = 8 if settings.dry else 64
    from .shapes import model_config

    vocab = model_config(shape, ctx.tok, settings.dry).vocab_size
    fields = {**settings.common_fields(str(ctx.scratch / row["name"])), "per_device_train_batch_size": batch,
              "num_generations": batch, "max_completion_length": completion, "temperature": 1.0, "beta": 0.0,
              "loss_type": "dapo", "shuffle_dataset": False,
              # Both generate the full length; ids the tokenizer cannot decode are never sampled.
              "generation_kwargs": {"min_new_tokens": completion, "suppress_tokens": list(range(len(ctx.tok), vocab))}}
    run_pair(ctx, row, "GRPO", shape, prompt_rows(settings.steps() * batch, 32 if settings.dry else 128), fields,
             compare=False, trainer_kwargs={"reward_funcs": length_reward})
    row["step_split"] = step_split(row["libraries"])
    parts = [f"{name} {split['generation_s']:.3f} + {split['rest_s']:.3f}" for name, split in row["step_split"].items()]
    row["summary"] = (f"losses not compared: sampled completions; after the first step, median s generating + the rest "
                      f"of the step: {', '.join(parts)}")


def step_split(libraries: dict) -> dict:
    """Median seconds per step after the first (the warm-up): generating, and the rest of the step; leantune's from
    its warm rerun where it ran (TRL's run follows leantune's first, so it is warm too)."""
    runs = {"leantune (cold)": libraries["leantune"], "trl": libraries["trl"]}
    rerun = libraries["leantune"].get("warm_rerun")
    if isinstance(rerun, dict) and "generation_seconds" in rerun:
        runs["leantune (warm)"] = rerun
    return {name: {"generation_s": statistics.median(run["generation_seconds"][1:]),
                   "rest_s": statistics.median(run["rest_seconds"][1:])}
            for name, run in runs.items() if len(run.get("generation_seconds", [])) > 1}


# --- longest context ----------------------------------------------------------------------------------------------


def probe(ctx: Context, model, library: str, length: int, base_fields: dict, capacity: int, deadline: float,
          search: dict) -> bool | None:
    """One training step of one `length`-token row: True (it fits), False (out of memory; in --dry: over the RSS
    budget), None (out of time)."""
    settings = ctx.settings
    config_cls, trainer_cls = config_class(library, "SFT")
    args = config_cls(**library_fields(library, {**base_fields, "max_length": length}))
    # One row of max_length tokens (the character tokenizer: one token a character, + BOS and EOS).
    trainer = trainer_cls(model=model, args=args, processing_class=ctx.tok, peft_config=lora_config(),
                          train_dataset=dataset([{"text": random_text(random.Random(length), length - 4)}]))
    started = time.perf_counter()
    fits, error = True, None
    meter = Meter(settings)
    meter.start()
    try:
        with time_limit(max(5.0, deadline - time.monotonic()), ProbeTimeout):
            trainer.train()
        peak = meter.stop()["max_allocated_gib"] * GIB
        if not settings.dry:  # the two libraries' memory at the same length, not only whether it fit
            search.setdefault("max_allocated_gib", {})[str(length)] = round(peak / GIB, 2)
        if settings.dry:
            fits = peak - meter.before <= capacity
    except RowTimeout:
        raise
    except ProbeTimeout:
        fits, error = None, "timed out (the library's share of the row's time)"
    except Exception as exc:  # noqa: BLE001 - an OOM is the answer; anything else is reported
        if not is_oom(exc):
            raise
        fits, error = False, "OOM"
    finally:
        unload_adapter(trainer)
        del trainer
        free_memory()
    search["probes"].append({"max_length": length, "fits": fits, "seconds": round(time.perf_counter() -
                                                                                  started, 1),
                             **({"error": error} if error else {})})
    log(settings, f"  longest context / {library}: {length:,} tokens "
                  f"{'fits' if fits else 'out of time' if fits is None else 'does not fit'}")
    return fits


SEED_LENGTHS, SEED_LENGTHS_DRY = (4096, 8192), (128, 256)  # the planner's two points of the longest-context line


def longest_context_fields(ctx: Context) -> dict:
    return {**ctx.settings.common_fields(str(ctx.scratch / "longest_context")), "per_device_train_batch_size": 1,
            "max_steps": 1}


def submit_longest_context_seeds(ctx: Context) -> None:
    """At the kit's start, ahead of every row's plan: the longest-context row needs them when it starts. One row, so
    the trainer's own step 2 (measured_step) is the traced batch again: left out, the same peak in half the time
    (dry, measured: 1,367,772 and 1,729,452 bytes either way; 13 s instead of 24 s, 12 s instead of 21 s)."""
    for n in SEED_LENGTHS_DRY if ctx.settings.dry else SEED_LENGTHS:
        ctx.seed_plans[n] = ctx.planner.submit(PlanJob(
            "llama-3.1-8b", text_rows(1, n, seed=n), "sft",
            library_fields("leantune", {**longest_context_fields(ctx), "max_length": n}), lora_config(), True,
            measured_step=False))


def longest_context(ctx: Context, row: dict) -> None:
    """The longest row that trains one step of Llama-3.1-8B QLoRA (batch 1), for leantune and for TRL: a bisection
    on real steps, seeded by the planner's line through two short lengths extrapolated to the GPU's memory.
    Unsloth's published anchor for this setting: 342,733 tokens (Unsloth) vs 28,454 (TRL + FA2) on one H100 80GB.
    Dry: the same search against a 256 MiB RSS budget on tiny shapes."""
    import torch
    settings, shape = ctx.settings, "llama-3.1-8b"
    capacity = 64 * 1024**2 if settings.dry else torch.cuda.mem_get_info()[1]
    row["capacity_gib"] = capacity / GIB
    short = SEED_LENGTHS_DRY if settings.dry else SEED_LENGTHS
    base_fields = longest_context_fields(ctx)
    seed = None
    # The seeds were submitted at the kit's start (submit_longest_context_seeds): usually ready; else wait for
    # them with a quarter of the row's budget, or bisect from 4x the short length without them.
    waited = time.monotonic()
    ids = [ctx.seed_plans.get(n) for n in short]
    got = ctx.planner.wait([i for i in ids if i is not None], row["_budget_left"]() * 0.25) if all(
        i is not None for i in ids) else {}
    row["planner_wait_s"] = round(time.monotonic() - waited, 1)
    plans = [got.get(i, {}) for i in ids]
    if all("plan_peak_gib" in p for p in plans):
        slope = (plans[1]["plan_peak_gib"] - plans[0]["plan_peak_gib"]) * GIB / (short[1] - short[0])
        seed = int(short[1] + (0.9 * capacity - plans[1]["plan_peak_gib"] * GIB) / max(slope, 1.0))
        row["planner_points"] = {str(n): p["plan_peak_gib"] for n, p in zip(short, plans)}
        row["planner_seconds"] = {str(n): p.get("plan_seconds") for n, p in zip(short, plans)}
    else:
        errors = [p["plan_error"] for p in plans if "plan_error" in p]
        row["plan_error"] = "; ".join(errors) if errors else (
            f"the planner's seeds were not ready after {row['planner_wait_s']:.0f} s")
        row["note"] = f"bisection seeded without the planner ({row['plan_error'][:120]})"
    # One step at L tokens costs ~12 L^2 d layers FLOPs of attention (forward, recompute, backward): at 65,536 tokens
    # about 2e16, ~1 minute on an H100 with the 4-bit dequantization; Unsloth's 342,733 would take ~15 minutes, past
    # the call. So the GPU search stops at 65,536: "fits at the ceiling" reads as ">= 65,536".
    ceiling = 512 if settings.dry else 65536
    seed = max(short[1], min(seed or short[1] * 4, ceiling))
    row["planner_seed"] = seed

    # One 4-bit load for every probe: each trainer adds the LoRA adapter (peft_config) and the probe unloads it
    # again. (Passing one PeftModel to every trainer is what TRL takes, but leantune refuses a quantized PeftModel
    # without peft_config: leantune/models/loading.py apply_peft, reported by this kit.)
    model = load_4bit(settings, quantized_checkpoint(settings, shape, ctx.tok, ctx.scratch / shape))
    results = row.setdefault("libraries", {})
    share = 0.55  # of the row's remaining time, for leantune; TRL gets the rest
    for library in LIBRARIES:
        deadline = time.monotonic() + (row["_budget_left"]() * share if library == "leantune" else
                                       row["_budget_left"]() * 0.8)
        results[library] = search = {"probes": []}

        lo, hi = 0, None
        length = seed
        try:
            while True:  # at least one probe, then as long as the library's share of the time lasts
                fits = probe(ctx, model, library, length, base_fields, capacity, deadline, search)
                if fits is None:  # out of time: what is known stands
                    break
                if fits:
                    lo = length
                    if length >= ceiling:
                        break
                    length = min(ceiling, length * 2) if hi is None else (lo + hi) // 2
                else:
                    hi = length
                    length = length // 2 if lo == 0 else (lo + hi) // 2
                if hi is not None and lo and hi / lo < 1.1 or length < 64 or time.monotonic() >= deadline:
                    break
        except RowTimeout:
            raise
        except Exception as error:  # noqa: BLE001
            search.update(error_record(error))
        search.update(longest_fitting_max_length=lo, smallest_failing_max_length=hi)
    row["summary"] = (f"longest max_length that trained: leantune {results['leantune'].get('longest_fitting_max_length')}"
                      f", TRL {results['trl'].get('longest_fitting_max_length')} (capacity {row['capacity_gib']:.1f} GiB"
                      f", planner seed {seed:,})" + (f"; {row['note']}" if row.get("note") else ""))
    del model
    free_memory()
    failures = [lib for lib in LIBRARIES if "error" in results[lib] or not results[lib]["probes"]]
    if failures:
        raise RuntimeError(f"longest-context search failed for {failures}")


# --- checkpoint offload: the step with the layer inputs in host memory, against the step without -------------------

def checkpoint_offload(ctx: Context, row: dict) -> None:
    """leantune's SFT step with gradient checkpointing, the inputs of every decoder layer but the last in pinned host
    memory (`checkpoint_offload_layers=-1`) against none: the peak (the device's drop should be the inputs moved), the
    step time, and how much of the copies' time the prefetch hides: the copies' own time on their side streams
    (CUDA events) against what the step grew by. Losses must agree (the copies are exact)."""
    from leantune import SFTConfig, SFTTrainer

    settings = ctx.settings
    shape = "qwen2.5-1.5b"
    length = 48 if settings.dry else 16384
    rows = dataset(text_rows(settings.steps() * 2, length, seed=5))
    runs = row.setdefault("runs", {})
    for name, layers in (("off", None), ("on", -1)):
        model = build_model(settings, shape, ctx.tok)
        fields = {**settings.common_fields(str(ctx.scratch / f"{row['name']}_{name}")), "max_length": length,
                  "per_device_train_batch_size": 1, "shuffle_dataset": False, "memory_breakdown": False,
                  "checkpoint_offload_layers": layers}
        trainer = SFTTrainer(model=model, args=SFTConfig(**fields), train_dataset=rows, processing_class=ctx.tok)
        offloader = getattr(trainer.model, "checkpoint_offloader", None)
        if offloader is not None and not settings.dry:
            offloader.copy_events = []
        runs[name] = result = train_measured(settings, trainer, model)
        if offloader is not None:
            result["layers_offloaded"] = offloader.layers
            result["host_peak_gib"] = offloader.ledger.peak_bytes / GIB
            steps = max(result["steps"], 1)
            result["copy_s_per_step"] = None if settings.dry else offloader.copy_seconds() / steps
        del trainer, model
        free_memory()
    off, on = runs["off"], runs["on"]
    step_off = sum(off["step_seconds"][1:]) / max(len(off["step_seconds"]) - 1, 1)
    step_on = sum(on["step_seconds"][1:]) / max(len(on["step_seconds"]) - 1, 1)
    copy = on.get("copy_s_per_step")
    row["peak_drop_gib"] = off["max_allocated_gib"] - on["max_allocated_gib"]
    row["step_s_off"], row["step_s_on"] = step_off, step_on
    row["hidden_copy_share"] = None if not copy else max(0.0, 1 - max(step_on - step_off, 0.0) / copy)
    row["max_loss_diff"] = max((abs(a - b) for a, b in zip(on["losses"], off["losses"])), default=None)
    row["summary"] = (f"{on['layers_offloaded']} layers offloaded at {length:,} tokens: peak {off['max_allocated_gib']:.2f}"
                      f" -> {on['max_allocated_gib']:.2f} GiB, host {on['host_peak_gib']:.2f} GiB; step {step_off:.2f}"
                      f" -> {step_on:.2f} s" + ("" if not copy else f"; copies {copy:.2f} s/step, "
                                                  f"{row['hidden_copy_share']:.0%} hidden by the prefetch"))
    # the copies are exact: on CPU (--dry) the losses are bit-equal; on the GPU the two runs may differ only by the
    # attention backward's non-deterministic sums, far below the kit's leantune-vs-TRL tolerance
    tolerance = 0.0 if settings.dry else loss_tolerance(settings)
    if any(abs(a - b) > tolerance * abs(b) for a, b in zip(on["losses"], off["losses"])) or not on["losses"]:
        raise AssertionError(f"losses differ with the offload: {on['losses']} vs {off['losses']}")
