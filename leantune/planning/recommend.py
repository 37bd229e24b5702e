"""The fastest configuration that fits a memory budget, among those that learn the same thing.

What may change: the batch layout (padded, padding-free, packed: the same targets and, in leantune, the same loss
normalisation), gradient checkpointing, activation offloading, the chunked loss's chunk size (exact at any size), and
micro-batch x accumulation for the same global batch. What may not: the model, the data, the loss, LoRA or full training, the learning schedule.

Candidates are ranked by an expected relative step time (`relative_time`, stated rules, docs/plan.md) and planned in
that order; the first whose device total fits is the answer. Every candidate planned is printed with its peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .devices import GIB, MIB

CHECKPOINTING_COST = 1.33  # one more forward pass of the layers: forward ~1/3 of forward + backward
OFFLOADING_COST = 1.10  # copies overlap compute on CUDA streams, not entirely
HALVING_COST = 1.05  # per halving of the micro-batch: smaller matrix products, more optimizer-step overhead
PADDED_COST = 1.10  # padded rows compute their padding; padding-free and packed rows do not
SMALLER_CHUNK_COST = 1.02  # a quarter of the default chunk: four times as many, smaller head products


@dataclass
class Candidate:
    fields: dict
    relative_time: float
    peak_bytes: int | None = None
    total_bytes: int | None = None
    error: str | None = None

    def line(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.fields.items()) if k in VARIED)
        if self.error:
            return f"  time x{self.relative_time:.2f}  {shown}: not planned ({self.error})"
        return (f"  time x{self.relative_time:.2f}  {shown}: peak {_size(self.peak_bytes)}, on the device "
                f"{_size(self.total_bytes)}")


def _size(size: int) -> str:
    """GiB with two decimals from 1 GiB on; below, MiB (a small model's candidates differ by MiB)."""
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / MIB:.1f} MiB"


VARIED = ("gradient_checkpointing", "activation_offloading", "per_device_train_batch_size",
          "gradient_accumulation_steps", "steps_per_generation", "packing", "padding_free", "loss_chunk_size")


@dataclass
class Recommendation:
    budget: int
    considered: list[Candidate] = field(default_factory=list)
    chosen: Candidate | None = None

    def lines(self) -> list[str]:
        out = [f"memory budget {_size(self.budget)}: candidates that learn the same thing, fastest first"]
        out += [candidate.line() for candidate in self.considered]
        if self.chosen is None:
            out.append("none fits: a smaller model, LoRA, or more processes with a sharding engine is needed")
        else:
            out.append("recommended (fits, expected fastest):")
            out += [f"  --{k} {v}" for k, v in sorted(self.chosen.fields.items()) if k in VARIED]
        return out


def micro_batch_group(args) -> int:
    """Rows of `per_device_train_batch_size` that make one prompt group: an online method's micro-batch keeps whole
    groups (GRPO, RLOO: `num_generations` completions; Online DPO counts prompts, PPO has no groups: 1)."""
    plan = getattr(args, "generation_plan", None)
    if plan is None:
        return 1
    completions, steps = plan(1)
    per_row = completions // (args.per_device_train_batch_size * steps)  # Online DPO: 2 completions per prompt row
    return max(1, args.num_generations // max(1, per_row))


def candidates(method: str, fields: dict, vocab_size: int | None = None, group: int = 1) -> list[Candidate]:
    """Every same-result configuration, fastest first. With `vocab_size`, and the chunked loss on with its default
    chunk, a quarter of that chunk is a candidate too (its fp32 logits chunk, x3 while its gradient forms, is the
    loss's temporary memory). `group` (`micro_batch_group`): a smaller micro-batch still holds whole prompt groups,
    and an online round stays the same (an explicit `steps_per_generation` grows with the accumulation)."""
    batch = int(fields.get("per_device_train_batch_size", 8))
    accumulation = int(fields.get("gradient_accumulation_steps", 1))
    per_round = fields.get("steps_per_generation")
    from ..methods import find

    layouts = [{}]
    if find(method).layouts == "packing":
        layouts = [{"packing": True, "padding_free": False}, {"packing": False, "padding_free": True},
                   {"packing": False, "padding_free": False}]
    elif "padding_free" in fields or find(method).layouts == "padding_free":
        layouts = [{"padding_free": True}, {"padding_free": False}]
    found = []
    for layout in layouts:
        padded = not (layout.get("packing") or layout.get("padding_free"))
        for checkpointing in (False, True):
            for offloading in (False, True):
                split = 1
                while batch // split >= 1 and batch % split == 0 and (split == 1 or (batch // split) % group == 0):
                    time = (PADDED_COST if padded else 1.0) * (CHECKPOINTING_COST if checkpointing else 1.0) * \
                        (OFFLOADING_COST if offloading else 1.0) * HALVING_COST ** (split.bit_length() - 1)
                    rounds = {} if per_round is None else {"steps_per_generation": per_round * split}
                    found.append(Candidate({**fields, **layout, "gradient_checkpointing": checkpointing,
                                            "activation_offloading": offloading,
                                            "per_device_train_batch_size": batch // split,
                                            "gradient_accumulation_steps": accumulation * split, **rounds}, time))
                    split *= 2
    chunked = fields.get("chunked_loss", True) and not (fields.get("use_liger_kernel") or fields.get("use_liger_loss"))
    if vocab_size and chunked and fields.get("loss_chunk_size") is None:
        from ..losses.token_logprobs import chunk_tokens_for

        quarter = max(16, chunk_tokens_for(vocab_size) // 4)
        found += [Candidate({**c.fields, "loss_chunk_size": quarter}, c.relative_time * SMALLER_CHUNK_COST)
                  for c in list(found)]
    found.sort(key=lambda c: c.relative_time)
    return found


def recommend(plan, budget: int, model, train_dataset, trainer_class, peft_config, plan_args, fields: dict,
              processing_class=None, limit: int = 8, group: int = 1, keep=None, known=None) -> Recommendation:
    """Plan candidates fastest first until one fits (at most `limit` planned). `group`: see `candidates`; `keep`: a
    test a candidate must pass to be planned (a run sizing itself keeps its own packing, planning/self_sizing.py);
    `known`: candidate -> its plan when already made (the run's own configuration), else None."""
    from .planner import model_config_of, plan_memory

    result = Recommendation(budget)
    vocab_size = getattr(model_config_of(model).get_text_config(), "vocab_size", None)
    ranked = [c for c in candidates(plan.method, fields, vocab_size, group) if keep is None or keep(c)]
    for candidate in ranked[:limit * 4]:
        if len(result.considered) >= limit:
            break
        try:
            planned = known(candidate) if known is not None else None
            planned = planned or plan_memory(
                model, train_dataset, trainer_class, peft_config=peft_config, processing_class=processing_class,
                num_processes=plan_args.num_processes, engine=plan_args.engine,
                device=plan_args.device or plan_args.memory_budget, measured_step=False, **candidate.fields)
        except ValueError as error:
            candidate.error = str(error).splitlines()[0][:120]
            result.considered.append(candidate)
            continue
        candidate.peak_bytes, candidate.total_bytes = planned.peak_bytes, planned.device_total_bytes
        result.considered.append(candidate)
        if candidate.total_bytes <= budget:
            result.chosen = candidate
            break
    return result


__all__ = ["Candidate", "Recommendation", "candidates", "micro_batch_group", "recommend", "MIB"]
