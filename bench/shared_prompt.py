"""Shared-prompt scoring (`shared_prompt=True`) against the unshared layouts: the GRPO update step, one run.

    python bench/shared_prompt.py [--rows 256:64:8,160:160:8,...] [--repeats 2] [--json out.json]
    python bench/shared_prompt.py --attention --rows 1024:256:16,64:256:16 --repeats 3   # one layer's attention

Each row is prompt tokens : completion tokens : G (num_generations). One micro-batch = one group (G completions of
one prompt). Modes, each a GRPOTrainer built the same way on the same model (fp32, `use_cpu`, beta 0, loss "dapo",
gradient checkpointing off so activation memory shows as it is, `--checkpointing` for leantune's default):
- unshared padded: G rows of prompt + completion (leantune's default layout);
- unshared padding-free: one row of the G sequences (segment attention);
- shared: one row [prompt, completion_1, ..., completion_G] (`shared_prompt=True`);
- TRL 1.16 (unshared padded): TRL's GRPOTrainer with the same settings, its own `compute_loss` on the same group (it
  has no shared-prompt or padding-free layout; its head computes full [tokens, vocabulary] logits of the completions).
The update step is the trainer's own `compute_loss` (the chunked head, the GRPO loss) + backward + AdamW step on
that micro-batch: median process CPU time (one torch thread: the measure least moved by other jobs on a shared
machine) and wall time of `--repeats` steps after a warm-up; then the loss's forward and backward once
more, watched by leantune's memory meter (MemTracker: the peak, and "activations" = that peak less the weights,
gradients and AdamW states held at it: activations, temporaries such as the head's chunk) and by the process's peak
RSS (VmHWM reset before, reported above the RSS before). The optimizer step itself is the same in every layout. Generation is not part of the update step and not run:
prompts are GSM8K questions laid end to end and cut to length, completions are GSM8K answers cut to length
(real tokens of the 32k tokenizer). Model: bench.common.tiny_llama (hidden 256, 4 layers, 32,000 vocabulary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    GSM8K_TRAIN,
    MIB,
    load_tokenizer,
    machine_description,
    markdown_table,
    peak_rss_bytes,
    quiet,
    release_memory,
    reset_peak_rss,
    rss_bytes,
    tiny_llama,
)

DEFAULT_ROWS = "256:64:8,160:160:8,64:256:8,256:64:16,160:160:16,64:256:16"
MODES = {"unshared padded": {"shared_prompt": False}, "unshared padding-free": {"padding_free": True, "shared_prompt": False},
         "shared": {"shared_prompt": True}, "TRL 1.16 (unshared padded)": None}
TRL = "TRL 1.16 (unshared padded)"


def gsm8k_tokens(tokenizer, prompt_length: int, completion_length: int, group: int):
    """One prompt of `prompt_length` tokens and `group` completions of `completion_length` tokens (real text)."""
    with open(GSM8K_TRAIN, encoding="utf-8") as handle:
        rows = [json.loads(line) for _, line in zip(range(400), handle)]
    prompt = []
    for row in rows:
        prompt += tokenizer(row["question"], add_special_tokens=False).input_ids
        if len(prompt) >= prompt_length:
            break
    completions = []
    for row in rows[:group]:
        ids = []
        while len(ids) < completion_length:
            ids += tokenizer(" " + row["answer"], add_special_tokens=False).input_ids
        completions.append(ids[:completion_length])
    return prompt[:prompt_length], completions


def loss_backward(trainer, batch) -> float:
    # TRL's `_prepare_inputs` generates a round; its batch is already what its loss reads
    inputs = trainer._prepare_inputs(dict(batch)) if "prompt_ids" not in batch else dict(batch)
    loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=None)
    loss.backward()
    return loss.detach()


def update_step(trainer, batch):
    loss = loss_backward(trainer, batch)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss


def warm_up(trainer, batch) -> float:
    """The first update step (AdamW's states made); returns its gradient norm. The GRPO loss of an on-policy step
    is -mean(advantages) whatever the weights (ratio 1), so the gradient is what says two layouts agree."""
    import torch

    loss_backward(trainer, batch)
    norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in trainer.model.parameters() if p.grad is not None))
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(norm)


def on_device(batch: dict, device) -> dict:
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def trl_trainer_and_batch(prompt, completions, checkpointing: bool, model=None, tokenizer=None, cuda: bool = False):
    """TRL's GRPOTrainer with the same model, group and settings, and the inputs its own update step reads (one
    prompt repeated G times, left of G completions; no padding: every sequence has the same length)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    group = len(completions)
    tokenizer = tokenizer or load_tokenizer()
    args = GRPOConfig(output_dir="/tmp/leantune-bench-shared-prompt-trl", use_cpu=not cuda, bf16=cuda, report_to=[],
                      save_strategy="no", per_device_train_batch_size=group, num_generations=group,
                      max_completion_length=len(completions[0]), beta=0.0, loss_type="dapo",
                      gradient_checkpointing=checkpointing, disable_tqdm=True, seed=0)
    model = model if model is not None else tiny_llama(0, len(tokenizer))
    trainer = GRPOTrainer(model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]}), processing_class=tokenizer)
    prompt_ids = torch.tensor([prompt] * group)
    completion_ids = torch.tensor(completions)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
             "completion_ids": completion_ids, "completion_mask": torch.ones_like(completion_ids),
             "advantages": torch.randn(group, generator=torch.Generator().manual_seed(0)),
             "num_items_in_batch": torch.tensor(float(completion_ids.numel()))}
    return trainer, batch


def measure(mode: str, prompt, completions, repeats: int, checkpointing: bool = False, model=None, tokenizer=None,
            cuda: bool = False) -> dict:
    """`model`/`tokenizer`/`cuda`: the GPU kit's model (bf16 on CUDA, bench/gpu/diagnose.py's `shared_prompt`);
    left out, the CPU benchmark's tiny Llama and 32k tokenizer in fp32."""
    import torch
    from datasets import Dataset

    from leantune import GRPOConfig, GRPOTrainer
    from leantune.data.collators import prompt_completion_row

    if mode == TRL:
        trainer, batch = trl_trainer_and_batch(prompt, completions, checkpointing, model, tokenizer, cuda)
        trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before a step
        trainer.create_optimizer()
        trainer.model.train()
        return timed_and_metered(mode, trainer, on_device(batch, trainer.model.device), repeats, cuda)
    group = len(completions)
    tokenizer = tokenizer or load_tokenizer()
    args = GRPOConfig(output_dir="/tmp/leantune-bench-shared-prompt", use_cpu=not cuda, bf16=cuda, report_to=[],
                      save_strategy="no",
                      per_device_train_batch_size=group, num_generations=group, max_completion_length=len(completions[0]),
                      beta=0.0, loss_type="dapo", gradient_checkpointing=checkpointing, memory_breakdown=False,
                      disable_tqdm=True, seed=0, **MODES[mode])
    model = model if model is not None else tiny_llama(0, len(tokenizer))
    trainer = GRPOTrainer(model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]}), processing_class=tokenizer)
    if checkpointing:
        from leantune.models.checkpointing import checkpointing_setting, enable_model_checkpointing

        enable_model_checkpointing(trainer.model, checkpointing_setting(trainer.args)[1])
    trainer.create_optimizer()
    trainer.model.train()
    examples = []
    for completion in completions:
        examples.append(prompt_completion_row(prompt, completion))
        examples[-1]["prompt_length"] = len(prompt)
    batch = trainer.rounds.collate(examples)
    batch["num_sequences"] = torch.tensor(group)
    batch["advantages"] = torch.randn(group, generator=torch.Generator().manual_seed(0))
    batch["loss_items"] = trainer.loss_items(batch)
    return timed_and_metered(mode, trainer, on_device(batch, trainer.model.device), repeats, cuda)


def timed_and_metered(mode: str, trainer, batch, repeats: int, cuda: bool = False) -> dict:
    """The update step timed (after a warm-up that makes AdamW's states), then its forward and backward metered."""
    import torch

    from leantune.metrics.memory_breakdown import StepMemoryMeter

    if cuda:
        return cuda_timed(mode, trainer, batch, repeats)
    grad_norm = warm_up(trainer, batch)
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        update_step(trainer, batch)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    release_memory()
    meter = StepMemoryMeter("cpu")
    before = rss_bytes()
    reset_peak_rss()
    meter.start(trainer.model, trainer.optimizer)
    loss_backward(trainer, batch)
    breakdown = meter.stop(1)
    rss_peak = peak_rss_bytes() - before
    trainer.optimizer.zero_grad(set_to_none=True)
    held = sum(breakdown.parts.get(name, 0) for name in ("parameters", "buffers", "gradients", "optimizer_states"))
    tokens = batch["input_ids"] if "input_ids" in batch else torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    return {"mode": mode, "tokens": int(tokens.numel()), "seconds": statistics.median(times), "grad_norm": grad_norm,
            "cpu_seconds": statistics.median(cpu_times),
            "peak_mib": breakdown.peak_bytes / MIB, "activations_mib": (breakdown.peak_bytes - held) / MIB,
            "rss_mib": rss_peak / MIB}


def cuda_timed(mode: str, trainer, batch, repeats: int) -> dict:
    """On CUDA: the warm-up's gradient norm (the untrained weights: the same in every layout), the warm steps' median
    (synchronised), and the peak of one more step over what is held before it (weights, gradients' absence, AdamW)."""
    import torch

    grad_norm = warm_up(trainer, batch)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        update_step(trainer, batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    update_step(trainer, batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    tokens = batch["input_ids"] if "input_ids" in batch else torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    return {"mode": mode, "tokens": int(tokens.numel()), "seconds": statistics.median(times), "grad_norm": grad_norm,
            "peak_mib": peak / MIB, "activations_mib": (peak - held) / MIB}


def attention_paths(prompt_length: int, completion_length: int, group: int, repeats: int, heads: int = 4,
                    dim: int = 64) -> dict:
    """One layer's attention of a shared group alone, forward + backward, process CPU seconds (best of `repeats`
    after a warm-up), in each form a shared row could take: one SDPA call over prefix blocks (leantune's, with its
    selective recompute), a call per completion over cat(prompt, completion) recomputed in the backward (leantune's
    form before), one call with a dense [L, L] boolean mask over the whole row, and the unshared causal rows."""
    import torch
    import torch.nn.functional as F

    from leantune.data.collators import prefix_blocks
    from leantune.models.gathered_attention import recomputed
    from leantune.models.segment_attention import prefix_block_attention, recomputed_but_attention

    lengths, prompt_of = [prompt_length] + [completion_length] * group, [-1] + [0] * group
    row = sum(lengths)
    query, key, value = (torch.randn(heads, row, dim, requires_grad=True) for _ in range(3))
    blocks = prefix_blocks(lengths, prompt_of)
    positions = torch.arange(row)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    dense = (positions[:, None] >= positions[None, :]) & ((segment[:, None] == segment[None, :]) | (segment[None, :] == 0))
    branch = torch.ones(completion_length, row - completion_length * (group - 1), dtype=torch.bool)
    branch[:, prompt_length:] = branch[:, prompt_length:].tril()

    def per_completion(q, k, v, p_k, p_v):
        return F.scaled_dot_product_attention(q, torch.cat((p_k, k), 1), torch.cat((p_v, v), 1), attn_mask=branch)

    def g_calls():
        qs, ks, vs = (states.split(lengths, dim=1) for states in (query, key, value))
        pieces = [F.scaled_dot_product_attention(qs[0], ks[0], vs[0], is_causal=True)]
        pieces += [recomputed(per_completion, qs[i], ks[i], vs[i], ks[0], vs[0]) for i in range(1, group + 1)]
        return torch.cat(pieces, dim=1)

    unshared = torch.randn(group, heads, prompt_length + completion_length, dim, requires_grad=True)
    forms = {
        "one call, prefix blocks": lambda: recomputed_but_attention(
            prefix_block_attention, query, key, value, blocks["queries"], blocks["keys"], blocks["mask"],
            blocks["output"]),
        "G calls": g_calls,
        "one call, dense [L, L] mask": lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=dense),
        "unshared causal rows": lambda: F.scaled_dot_product_attention(unshared, unshared, unshared, is_causal=True),
    }
    seconds = {}
    for name, form in forms.items():
        times = []
        for _ in range(repeats + 1):
            start = time.process_time()
            form().sum().backward()
            times.append(time.process_time() - start)
        seconds[name] = min(times[1:])
    return {"dense_mask_mib": dense.numel() / MIB, "block_mask_mib": blocks["mask"].numel() / MIB, **seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="prompt:completion:G, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on (leantune's default)")
    parser.add_argument("--attention", action="store_true",
                        help="time one layer's attention in each form a shared row could take (attention_paths)")
    options = parser.parse_args()
    import torch

    torch.set_num_threads(options.threads)
    if options.attention:
        for spec in options.rows.split(","):
            print(json.dumps({"row": spec, **attention_paths(*(int(v) for v in spec.split(":")), options.repeats)}))
        return
    quiet()
    tokenizer = load_tokenizer()
    results, table = [], []
    for spec in options.rows.split(","):
        prompt_length, completion_length, group = (int(v) for v in spec.split(":"))
        prompt, completions = gsm8k_tokens(tokenizer, prompt_length, completion_length, group)
        measured = {}
        for mode in options.modes.split(","):
            measured[mode] = measure(mode, prompt, completions, options.repeats, options.checkpointing)
            release_memory()
            print(json.dumps({"row": spec, **measured[mode]}), flush=True)
        shared = measured.get("shared")
        for mode, m in measured.items():
            ratio = ""
            if shared is not None and mode != "shared":
                ratio = (f"{m['cpu_seconds'] / shared['cpu_seconds']:.2f}x / "
                         f"{m['activations_mib'] / shared['activations_mib']:.2f}x / {m['peak_mib'] / shared['peak_mib']:.2f}x")
            table.append([f"{prompt_length}:{completion_length}", group, mode, m["tokens"], f"{m['cpu_seconds']:.2f} ({m['seconds']:.2f})",
                          f"{m['peak_mib']:.1f}", f"{m['activations_mib']:.1f}", f"{m['rss_mib']:.1f}", ratio])
            results.append({"row": spec, **m})
    print()
    print(machine_description())
    print(markdown_table(["prompt:completion", "G", "layout", "tokens", "update CPU s (wall s)", "fwd+bwd peak MiB (MemTracker)",
                          "activations MiB", "peak RSS over start MiB", "shared's gain: CPU time / activations / peak"],
                         table))
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
