"""The fastest configuration that fits a memory budget, among those that learn the same thing.

What may change: the batch layout (padded, padding-free, packed: the same targets and, in leantune, the same loss
normalisation), gradient checkpointing, activation offloading, the chunked loss's chunk size (exact at any size), and
micro-batch x accumulation for the same global batch. What may not: the model, the data, the loss, LoRA or full training, the learning schedule.

Candidates are ranked by an expected relative step time (`relative_time`, stated rules, docs/plan.md) and planned in
that order; the first whose device total fits is the answer. Every candidate planned is printed with its peak. A
candidate whose plan is known already (the run's own configuration) costs nothing, and when it fits only the faster
ones are planned. The search plans at most `limit` candidates and says so when it stops there; with `least`, the most
frugal candidate is planned too when nothing else fitted, so that "none fits" names the least the run can need.

A run asked for far over its budget (more than `FAR_OVER` times it: a long row, where the fast candidates, which turn
checkpointing off, miss by hundreds of GiB and would use up the limit) is searched from the frugal end instead (`_backed_off`): the most frugal
candidate first, every technique that applies on together (if it does not fit, nothing does: one plan answers),
then each technique turned off again, the one that costs the most time first, where the step still fits. The
answer is the last that fitted, its tiled MLP's tile then grown as far as it still fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..losses.token_logprobs import chunk_tokens_for
from ..memory.checkpoint_offload import unsupported_by_transformers
from ..methods import find
from ..metrics.devices import GIB, MIB
from ..models.checkpointing import checkpointing_setting
from .planned_run import model_config_of
from .planner import plan_memory
from .run_facts import RunFacts, in_backward_supported, tiling_supported
from .tile_size import launch_floor, solve_tile, token_bound

CHECKPOINTING_COST = 1.33  # one more forward pass of the layers: forward ~1/3 of forward + backward
OFFLOADING_COST = 1.10  # copies overlap compute on CUDA streams, not entirely
HALVING_COST = 1.05  # per halving of the micro-batch: smaller matrix products, more optimizer-step overhead
PADDED_COST = 1.10  # padded rows compute their padding; padding-free and packed rows do not
SMALLER_CHUNK_COST = 1.02  # a quarter of the default chunk: four times as many, smaller head products
CHECKPOINT_OFFLOAD_COST = 1.04  # layer inputs copied out and back on side streams, the next one fetched ahead
# one more forward of each MLP (its tiles recomputed in the backward: ~2/3 of a layer's forward at moderate lengths,
# so ~1/6 more of a checkpointed step's work, less as attention grows with the length), and a launch per tile
TILED_MLP_COST = 1.15
# one more forward of each layer's norms and q/k/v/o projections (their tiles recomputed in the backward): at Llama's
# shapes the projections are ~1/4 of the MLP's work (4,096 x 10,240 against 3 x 4,096 x 14,336), and a launch per tile
TILED_PROJECTIONS_COST = 1.05
IN_BACKWARD_COST = 1.03  # the same arithmetic; one optimizer per parameter loses the foreach kernels' batching
FAR_OVER = 1.25  # the run as asked needs over a quarter more than its budget: searched from the frugal end (`_backed_off`)


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
        return (f"  time x{self.relative_time:.2f}  {shown}: peak {size_words(self.peak_bytes)}, on the device "
                f"{size_words(self.total_bytes)}")


def size_words(size: int) -> str:
    """GiB with two decimals from 1 GiB on; below, MiB (a small model's candidates differ by MiB)."""
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / MIB:.1f} MiB"


KEEP = object()  # a technique's `off` that leaves the field as the run gives it


@dataclass(frozen=True)
class Technique:
    """A technique the search may turn on, in order of cost: `value` (or value(fields, vocab_size), None where it does
    not apply) turns it on at `cost` times the step time; `off` is its value otherwise; `why` is what it saves, as the
    run's log line says it when a budget turned it on (planning/self_sizing.py). Adding one is one entry here."""

    field: str
    value: object
    cost: float
    why: str
    off: object = False
    compatible: object = None  # the others' settings -> whether it can be on beside them (None: always)
    supported: object = None  # RunFacts -> whether this model and run can use it at all (None: always)


def why_turned_on(name: str) -> str | None:
    """What a technique the search turned on saves, for the log line that names it (None: not a technique)."""
    return next((technique.why for technique in TECHNIQUES if technique.field == name), None)


VARIED = ("gradient_checkpointing", "activation_offloading", "per_device_train_batch_size",
          "gradient_accumulation_steps", "steps_per_generation", "packing", "padding_free", "loss_chunk_size",
          "checkpoint_offload_layers", "tiled_mlp", "tiled_mlp_tile_size", "optimizer_in_backward",
          "tiled_attention_projections")
PIECES = "max_completions_per_generate"  # set before the search when the generation round is over (generation_batch.py)


@dataclass
class Recommendation:
    budget: int
    considered: list[Candidate] = field(default_factory=list)
    chosen: Candidate | None = None
    limit: int | None = None  # the search's limit on plans, where it stopped there
    unplanned: int = 0  # candidates faster than the answer (or, with none, any) left unplanned at the limit
    from_frugal_end: int | None = None  # the run's own need, where it was far over and searched from the frugal end
    steps: list[str] = field(default_factory=list)  # that search's steps: each technique turned off, and whether it fit
    adapters: bool = False  # the run trains adapters already (LoRA / QLoRA): the "none fits" hint does not offer them

    def least(self) -> Candidate | None:
        """The planned candidate that needs the least on the device."""
        return min((c for c in self.considered if c.total_bytes is not None), key=lambda c: c.total_bytes,
                   default=None)

    def lines(self) -> list[str]:
        if self.from_frugal_end is None:
            out = [f"memory budget {size_words(self.budget)}: candidates that learn the same thing, fastest first"]
        else:
            out = [f"memory budget {size_words(self.budget)}: the run as asked needs "
                   f"{size_words(self.from_frugal_end)}, over {FAR_OVER:g}x the budget, so the search starts from the "
                   f"most frugal candidate (every technique that applies on) and turns techniques off again, the "
                   f"costliest first, while the step fits"]
        out += [candidate.line() for candidate in self.considered]
        out += self.steps
        if self.limit is not None:
            out.append(f"the search stopped at its limit of {self.limit} plans: {self.unplanned} candidate(s) "
                       f"{'faster than the one recommended ' if self.chosen else ''}were not planned")
        if self.chosen is None:
            least = self.least()
            need = "" if least is None else f" (the least planned need: {size_words(least.total_bytes)})"
            instead = "a shorter max_length" if self.adapters else "LoRA"
            out.append(f"none fits{need}: a smaller model, {instead}, or more processes with a sharding engine is "
                       f"needed")
        else:
            out.append("recommended (fits, expected fastest):")
            out += [f"  --{k} {v}" for k, v in sorted(self.chosen.fields.items())
                    if k in VARIED or (k == PIECES and v is not None)]
            out += [f"on: {name}={value}: {why_turned_on(name)}" for name, value in sorted(self.chosen.fields.items())
                    if self.from_frugal_end is not None and why_turned_on(name) and value not in (None, False, 0)]
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


def current_value(config, name: str):
    """A varied field's value in a run's config (checkpointing under whichever name transformers reads)."""
    if name == "gradient_checkpointing":
        return checkpointing_setting(config)[0]
    return getattr(config, name, None)


def as_configured(config, planned):
    """`known` for `recommend`: the plan already made of the run as `config` sets it, for the candidate that is it."""
    def known(candidate: Candidate):
        same = all(value == current_value(config, name) for name, value in candidate.fields.items() if name in VARIED)
        untiled = not candidate.fields.get("tiled_mlp") or candidate.fields.get("tiled_mlp_tile_size") is not None
        return planned if same and untiled else None  # a tiled MLP without a tile: its tile is planned (_plan)

    return known


def candidates(method: str, fields: dict, vocab_size: int | None = None, group: int = 1,
               facts: RunFacts | None = None) -> list[Candidate]:
    """Every same-result configuration, fastest first. With `vocab_size`, and the chunked loss on with its default
    chunk, a quarter of that chunk is a candidate too (its fp32 logits chunk, x3 while its gradient forms, is the
    loss's temporary memory). `group` (`micro_batch_group`): a smaller micro-batch still holds whole prompt groups,
    and an online round stays the same (an explicit `steps_per_generation` grows with the accumulation). `facts`:
    the run, for the techniques that apply to some runs only (without it, those are left as the run has them)."""
    batch = int(fields.get("per_device_train_batch_size", 8))
    accumulation = int(fields.get("gradient_accumulation_steps", 1))
    per_round = fields.get("steps_per_generation")

    layouts = [{}]
    if find(method).layouts == "packing":
        layouts = [{"packing": True, "padding_free": False}, {"packing": False, "padding_free": True},
                   {"packing": False, "padding_free": False}]
    elif "padding_free" in fields or find(method).layouts == "padding_free":
        layouts = [{"padding_free": True}, {"padding_free": False}]
    found = []
    for layout in layouts:
        padded = not (layout.get("packing") or layout.get("padding_free"))
        for techniques in _technique_settings(fields, vocab_size, facts):
            split = 1
            while batch // split >= 1 and batch % split == 0 and (split == 1 or (batch // split) % group == 0):
                time = (PADDED_COST if padded else 1.0) * HALVING_COST ** (split.bit_length() - 1)
                for _, _, cost in techniques:
                    time *= cost
                rounds = {} if per_round is None else {"steps_per_generation": per_round * split}
                found.append(Candidate({**fields, **layout, **{name: value for name, value, _ in techniques},
                                        "per_device_train_batch_size": batch // split,
                                        "gradient_accumulation_steps": accumulation * split, **rounds}, time))
                split *= 2
    found.sort(key=lambda c: (c.relative_time, _technique_rank(c.fields, fields)))
    return found


def _technique_settings(fields: dict, vocab_size: int | None, facts: RunFacts | None = None) -> list[list[tuple]]:
    """Every combination of the techniques' settings, [(field, value, cost)] each: a technique off (its `off` value;
    none where it keeps the field as given) or on (where `supported` says the run can use it)."""
    combinations = [[]]
    for technique in TECHNIQUES:
        on = technique.value(fields, vocab_size) if callable(technique.value) else technique.value
        if technique.supported is not None and (facts is None or not technique.supported(facts)):
            on = None
        settings = [[] if technique.off is KEEP else [(technique.field, technique.off, 1.0)]]
        if on is not None:
            settings.append([(technique.field, on, technique.cost)])
        combinations = [done + setting for done in combinations for setting in settings]
    return [done for done in combinations if _possible(done, fields)]


def _possible(settings: list[tuple], fields: dict) -> bool:
    """Whether every technique on in `settings` can be on beside the others (its `compatible`, which sees the run's
    `fields` with `settings` over them: a technique kept as the run has it is the run's value)."""
    values = {name: value for name, value, _ in settings}
    return all(t.compatible is None or values.get(t.field, t.off) in (t.off, None) or t.compatible({**fields, **values})
               for t in TECHNIQUES)


def _technique_rank(candidate: dict, fields: dict) -> tuple:
    """Among equally fast candidates, the order TECHNIQUES lists them in: a later technique's on after an earlier
    one's (ties are rare: the costs are distinct)."""
    return tuple(candidate.get(t.field) != fields.get(t.field) for t in reversed(TECHNIQUES))


def _quarter_chunk(fields: dict, vocab_size: int | None):
    """A quarter of the chunked loss's default chunk, where the chunked loss runs with its default chunk."""
    chunked = fields.get("chunked_loss", True) and not (fields.get("use_liger_kernel") or fields.get("use_liger_loss"))
    if not vocab_size or not chunked or fields.get("loss_chunk_size") is not None:
        return None
    return max(16, chunk_tokens_for(vocab_size) // 4)


def _checkpoint_offload(fields: dict, vocab_size: int | None):
    """"auto" (the plan picks how many layers, planning/checkpoint_offload_plan.py, recorded as that number), where
    the installed transformers lets the offload take each layer's input (a release that checkpoints a layer's whole
    call refuses it: memory/checkpoint_offload.py)."""
    return "auto" if unsupported_by_transformers() is None else None


def _not_yet(name: str):
    """A switch the search turns on where the run has it off (one the run turned on stays on: KEEP)."""
    return lambda fields, vocab_size: None if fields.get(name) else True


TECHNIQUES = (
    Technique("gradient_checkpointing", True, CHECKPOINTING_COST,
              "each layer keeps its input only and recomputes its activations in the backward"),
    Technique("activation_offloading", True, OFFLOADING_COST,
              "the activations saved for the backward wait in host memory"),
    Technique("loss_chunk_size", _quarter_chunk, SMALLER_CHUNK_COST,
              "the loss's fp32 logits are formed a quarter as many tokens at a time", KEEP),
    Technique("checkpoint_offload_layers", _checkpoint_offload, CHECKPOINT_OFFLOAD_COST,
              "the first layers' checkpointed inputs wait in pinned host memory, as many as the plan needs to fit",
              KEEP, compatible=lambda on: on.get("gradient_checkpointing") and not on.get("activation_offloading")),
    Technique("tiled_mlp", _not_yet("tiled_mlp"), TILED_MLP_COST,
              "each decoder MLP runs over tiles of the tokens, never holding [tokens, intermediate]; the tile is the "
              "largest whose plan fits (fewest added launches)", KEEP, supported=tiling_supported),
    Technique("optimizer_in_backward", _not_yet("optimizer_in_backward"), IN_BACKWARD_COST,
              "each parameter is stepped and its gradient freed as soon as it is complete, never holding every "
              "gradient at once", KEEP, supported=in_backward_supported),
    Technique("tiled_attention_projections", _not_yet("tiled_attention_projections"), TILED_PROJECTIONS_COST,
              "each decoder layer's norms and attention projections (with their adapters) run over the tiled MLP's "
              "tiles, their fp32 upcasts and dropout masks one tile at a time; the attention itself stays whole",
              KEEP, compatible=lambda on: bool(on.get("tiled_mlp")), supported=tiling_supported),
)


def recommend(plan, budget: int, model, train_dataset, trainer_class, peft_config, plan_args, fields: dict,
              processing_class=None, limit: int = 8, group: int = 1, keep=None, known=None,
              least: bool = False) -> Recommendation:
    """Plan candidates fastest first until one fits (at most `limit` planned). `group`: see `candidates`; `keep`: a
    test a candidate must pass to be planned (a run sizing itself keeps its own packing, planning/self_sizing.py);
    `known`: candidate -> its plan when already made (the run's own configuration), else None; `least`: when none
    planned fits, plan the most frugal too (it is the answer if it fits; if it is known and over, nothing is planned).
    A run whose own plan (`plan`) needs more than `FAR_OVER` times the budget is searched from the frugal end."""
    result = Recommendation(budget, adapters=peft_config is not None)
    vocab_size = getattr(model_config_of(model).get_text_config(), "vocab_size", None)
    facts = RunFacts(trainer_class, model_config_of(model), fields, plan.num_processes, plan.engine,
                     peft_config is not None)
    ranked = [c for c in candidates(plan.method, fields, vocab_size, group, facts) if keep is None or keep(c)]
    plans = {id(c): known(c) for c in ranked} if known is not None else {}
    frugal = most_frugal(ranked) if least or plan.device_total_bytes > FAR_OVER * budget else None
    if frugal is not None and plan.device_total_bytes > FAR_OVER * budget and plans.get(id(frugal)) is None:
        def plan_one(candidate):
            return _plan(candidate, model, train_dataset, trainer_class, peft_config, processing_class, plan_args,
                         budget)

        def grow_tile(grown: dict, at_tile):
            tile = grown["tiled_mlp_tile_size"]
            larger, found, _ = solve_tile(lambda size: plan_one(Candidate({**grown, "tiled_mlp_tile_size": size}, 1.0)),
                                          budget, tile, token_bound(grown), at_tile)
            return larger, found

        result.from_frugal_end = plan.device_total_bytes
        return _backed_off(result, ranked, frugal, fields, plan_one, launch_floor(plan_args.device or
                                                                                  plan_args.memory_budget),
                           grow_tile, limit)
    if frugal is not None and plans.get(id(frugal)) is not None and plans[id(frugal)].device_total_bytes > budget:
        _record(frugal, plans[id(frugal)])  # the run already saves all a candidate can: nothing fits
        result.considered.append(frugal)
        return result
    bound = next((c for c in ranked if plans.get(id(c)) and plans[id(c)].device_total_bytes <= budget), None)
    made = 0
    for index, candidate in enumerate(ranked):
        planned = plans.get(id(candidate))
        if planned is None and candidate is not bound and made >= limit:
            faster = ranked[index:ranked.index(bound)] if bound is not None else ranked[index:]
            result.limit, result.unplanned = limit, sum(plans.get(id(c)) is None for c in faster)
            candidate = bound
            if bound is None:
                break
            planned = plans[id(bound)]
        if planned is None:
            made += 1
            try:
                planned = _plan(candidate, model, train_dataset, trainer_class, peft_config, processing_class,
                                plan_args, budget)
            except ValueError as error:
                candidate.error = str(error).splitlines()[0][:120]
                result.considered.append(candidate)
                continue
        _record(candidate, planned)
        result.considered.append(candidate)
        if candidate.total_bytes <= budget:
            result.chosen = candidate
            break
    if result.chosen is None and frugal is not None and all(c is not frugal for c in result.considered):
        try:
            _record(frugal, _plan(frugal, model, train_dataset, trainer_class, peft_config, processing_class,
                                  plan_args, budget))
        except ValueError as error:
            frugal.error = str(error).splitlines()[0][:120]
        result.considered.append(frugal)
        if frugal.total_bytes is not None and frugal.total_bytes <= budget:
            result.chosen = frugal
    return result


def most_frugal(ranked: list[Candidate]) -> Candidate | None:
    """The candidate that saves the most (checkpointing, the layer inputs offloaded, the tiled MLP and attention
    projections, the smallest micro-batch and loss chunk, no padding): if it does not fit, nothing does, and its peak
    is the least this run can need. Of the two offloads, which cannot be on together, checkpoint offload: the same layer inputs leave the
    device, and its host memory is planned and held to the host (activation offloading's is not)."""
    return min(ranked, default=None, key=lambda c: (
        not c.fields["gradient_checkpointing"],
        not (c.fields["activation_offloading"] or c.fields.get("checkpoint_offload_layers")),
        not c.fields.get("tiled_mlp"), not c.fields.get("tiled_attention_projections"),
        not c.fields.get("optimizer_in_backward"),
        c.fields["per_device_train_batch_size"], c.fields.get("loss_chunk_size") or 1 << 40,
        not (c.fields.get("packing") or c.fields.get("padding_free")), not c.fields.get("checkpoint_offload_layers")))


def _key(fields: dict) -> tuple:
    """What tells candidates apart: the fields the search varies (the tile is the plan's, not a candidate's)."""
    return tuple((name, fields.get(name)) for name in VARIED if name != "tiled_mlp_tile_size")


def _turned_off(fields: dict, technique: Technique, given: dict) -> dict:
    """`fields` with `technique` off again (as the run gives it), and any technique that needs it on off too."""
    def off(other: Technique):
        return given.get(other.field) if other.off is KEEP else other.off

    changed = {**fields, technique.field: off(technique)}
    for other in TECHNIQUES:
        if other.compatible is not None and changed.get(other.field) not in (other.off, None) and not (
                other.compatible(changed)):
            changed[other.field] = off(other)
    return changed


def _back_off_moves(state: dict, given: dict, tried: set) -> list[tuple[str, dict]]:
    """(what a move does, the fields after it) for each technique on in `state` that the search turned on (one the run
    turned on itself stays), and the micro-batch doubled for the same global batch; none already `tried`."""
    moves = [(f"{t.field} off again", _turned_off(state, t, given)) for t in TECHNIQUES
             if state.get(t.field) not in (None, False) and not (t.off is KEEP and state.get(t.field) == given.get(
                 t.field))]
    batch, accumulation = state["per_device_train_batch_size"], state["gradient_accumulation_steps"]
    doubled = {**state, "per_device_train_batch_size": batch * 2, "gradient_accumulation_steps": accumulation // 2}
    if state.get("steps_per_generation") is not None:
        doubled["steps_per_generation"] = state["steps_per_generation"] // 2
    if accumulation % 2 == 0:
        moves.append(("micro-batch doubled", doubled))
    return [(name, fields) for name, fields in moves if name not in tried]


def _backed_off(result: Recommendation, ranked: list[Candidate], frugal: Candidate, given: dict, plan_at, floor: int,
                grow_tile, limit: int) -> Recommendation:
    """The search from the frugal end (module docstring): `frugal` planned first, its tiled MLP at the launch `floor`;
    then, the costliest first, each technique on in the answer so far is turned off (and the micro-batch doubled)
    where the step still fits, a tiled MLP kept on keeping the answer's tile; the answer's tile is grown at the end
    (`grow_tile(fields, plan)` -> (tile, plan)). `plan_at(candidate)`: its plan. At most `limit` plans before the
    tile's."""
    key_of = {id(c): _key(c.fields) for c in ranked}  # before a plan records "auto" offload as its layers
    by_key = {key: c for c in ranked for key in [key_of[id(c)]]}
    plans = {}

    def fits(candidate: Candidate, tile: int | None) -> bool:
        if candidate.fields.get("tiled_mlp") and candidate.fields.get("tiled_mlp_tile_size") is None:
            candidate.fields["tiled_mlp_tile_size"] = tile
        try:
            plans[id(candidate)] = plan_at(candidate)
            _record(candidate, plans[id(candidate)])
        except ValueError as error:
            candidate.error = str(error).splitlines()[0][:120]
        result.considered.append(candidate)
        return candidate.total_bytes is not None and candidate.total_bytes <= result.budget

    if not fits(frugal, floor):
        return result
    answer, tried = frugal, set()
    while True:
        moves = [(name, by_key.get(tuple(fields.items()))) for name, fields in
                 _back_off_moves(dict(key_of[id(answer)]), given, tried)]
        moves = sorted(((name, c) for name, c in moves if c is not None and c.total_bytes is None),
                       key=lambda move: move[1].relative_time)
        if not moves:
            break
        if len(result.considered) >= limit:
            result.limit, result.unplanned = limit, len(moves)
            break
        name, candidate = moves[0]
        tried.add(name)
        tile = answer.fields.get("tiled_mlp_tile_size")
        went = fits(candidate, tile)
        result.steps.append(f"  {name}: {'fits' if went else 'over the budget, so kept'}")
        answer = candidate if went else answer
    if answer.fields.get("tiled_mlp"):  # "auto" offload again: a larger tile may need more layers offloaded
        as_searched = {name: value for name, value in key_of[id(answer)] if name in answer.fields}
        tile, planned = grow_tile({**answer.fields, **as_searched}, plans[id(answer)])
        answer.fields["tiled_mlp_tile_size"] = tile
        _record(answer, planned)
    result.chosen = answer
    return result


def _plan(candidate, model, train_dataset, trainer_class, peft_config, processing_class, plan_args, budget=None):
    """A candidate's plan. Its generation pieces are figured from the whole round's plan (generation_batch.py: the
    update steps are the same, the round's memory per sequence), not traced: tracing each piece's generate call
    costs a plan several times over, for the same numbers. A tiled MLP without a tile gets the largest that fits
    `budget` (planning/tile_size.py), set in the candidate's fields."""
    fields = {k: v for k, v in candidate.fields.items() if k != PIECES}
    device = plan_args.device or plan_args.memory_budget
    pieces = candidate.fields.get(PIECES)

    def planned(given: dict):
        made = plan_memory(model, train_dataset, trainer_class, peft_config=peft_config,
                           processing_class=processing_class, num_processes=plan_args.num_processes,
                           engine=plan_args.engine, device=device, measured_step=False,
                           host_memory=getattr(plan_args, "host_memory", None), **given)
        return made if pieces is None or made.generation is None else made.with_generation_batch(pieces)

    if not fields.get("tiled_mlp") or fields.get("tiled_mlp_tile_size") is not None or budget is None:
        return planned(fields)
    tile, found, _ = solve_tile(lambda size: planned({**fields, "tiled_mlp_tile_size": size}), budget,
                                launch_floor(device), token_bound(fields))
    candidate.fields["tiled_mlp_tile_size"] = tile
    return found


def _record(candidate: Candidate, planned) -> None:
    candidate.peak_bytes, candidate.total_bytes = planned.peak_bytes, planned.device_total_bytes
    if getattr(planned, "offload", None) is not None:  # "auto" recorded as the layers the plan chose
        candidate.fields["checkpoint_offload_layers"] = planned.offload.layers


__all__ = ["Candidate", "Recommendation", "candidates", "as_configured", "current_value", "micro_batch_group",
           "most_frugal", "recommend", "size_words", "MIB"]
