"""`plan_memory`: the peak memory of a training step, per process, before any weight is loaded.

The step is the trainer's own: the method's trainer is built on the real data with a model whose parameters are fake
(planning/fake_step.py), and `Trainer.train` runs two optimizer steps while leantune's `MemoryBreakdownCallback`
measures the second (the first that holds optimizer states), exactly as it does in a real run. So every method,
technique and architecture the trainers support is planned by the code that will run, and the prediction is the
number the real run's memory breakdown reports.

The worst batch is found among the batches the trainer's own data loader yields in its first epoch (its sampler,
collator and batching): the batches with the most token slots and with the most loss targets are traced, and the
larger peak is the plan's, with the step it arrives at. Another seed or epoch orders the rows otherwise, so the rows
with the most tokens, and those with the most targets, are also traced together (planning/any_order.py): the bound
a budget must hold. Online methods (GRPO, RLOO, ...) generate every completion to `max_completion_length`,
the worst case for memory.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..metrics.devices import device_terms
from ..metrics.memory_breakdown import MIB, PARTS
from . import zero as zero_plan
from .any_order import longest_rows_batches
from .checkpoint_offload_plan import OffloadPlan, host_peak, plans_cuda_run, traced_fields, with_offload
from .engines import check_engine, per_rank_notes
from .fake_step import (
    WeightlessMode,
    fake_model_from_config,
)
from .frozen import fake_frozen_sources
from .generation_round import GenerationRound, generation_round, held_between_steps, round_shape_of
from .length_profile import dataset_from_lengths
from .planned_run import (
    TracedStep,
    dtype_of,
    filler_token,
    is_fake_tensor,
    method_classes,
    method_of,
    model_class_of,
    model_config_of,
    planning_session,
)
from .quantized import parameter_count, quantization_from_fields, quantize_fake_model
from .sharded import each_rank, traced_launch
from .tile_size import rule_tile

logger = logging.getLogger("leantune.plan")
GIB = 1024 * MIB


def _step_dict(step: TracedStep | None) -> dict | None:
    """A traced step in the plan's JSON (the backward moment used inside planning/zero.py stays internal)."""
    if step is None:
        return None
    found = dataclasses.asdict(step)
    found.pop("backward_beside_gradients", None)
    return found


@dataclass
class MemoryPlan:
    method: str
    model: str
    num_parameters: int
    trainable_parameters: int
    num_processes: int
    engine: str
    worst: TracedStep
    measured_step: TracedStep | None  # the step a real run's memory breakdown measures (its second step)
    any_order: TracedStep | None = None  # the longest rows together (or most targets): what any seed or epoch reaches
    terms: list = field(default_factory=list)  # DeviceTerm: what the trace cannot see, each named with its source
    notes: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # the fields set for this plan
    seconds: float = 0.0
    generation: GenerationRound | None = None  # an online method's round (planning/generation_round.py)
    offload: OffloadPlan | None = None  # checkpoint offload's layers and host bytes (checkpoint_offload_plan.py)
    activation_host_bytes: int = 0  # activation offloading's pinned host blocks at their peak (a CUDA run's)

    @property
    def peak_bytes(self) -> int:
        """What the run must fit: the worst of the first epoch, or of any order where that bound was traced, or an
        online method's generation round where it is larger (the two do not overlap)."""
        return max(self.worst.peak_bytes, self.any_order.peak_bytes if self.any_order else 0,
                   self.generation.peak_bytes if self.generation else 0)

    @property
    def device_total_bytes(self) -> int:
        return self.peak_bytes + sum(term.bytes for term in self.terms)

    def with_generation_batch(self, batch: int) -> MemoryPlan:
        """This plan with its round generated `batch` sequences per call (`max_completions_per_generate`): only the
        round changes, since the update steps read the round's completions, not how many each call made."""
        return dataclasses.replace(self, generation=self.generation.with_batch(batch),
                                   config={**self.config, "max_completions_per_generate": batch})

    def to_dict(self) -> dict:
        return {
            "method": self.method, "model": self.model, "num_parameters": self.num_parameters,
            "trainable_parameters": self.trainable_parameters, "num_processes": self.num_processes,
            "engine": self.engine, "peak_bytes": self.peak_bytes, "worst": _step_dict(self.worst),
            "measured_step": _step_dict(self.measured_step),
            "any_order": _step_dict(self.any_order),
            "terms": [dataclasses.asdict(term) for term in self.terms], "notes": self.notes,
            "device_total_bytes": self.device_total_bytes, "config": self.config, "seconds": self.seconds,
            "generation": dataclasses.asdict(self.generation) if self.generation else None,
            "offload": dataclasses.asdict(self.offload) if self.offload else None,
            "activation_host_bytes": self.activation_host_bytes,
        }

    def lines(self, timing: bool = True) -> list[str]:
        """The plan as printed; `timing=False` leaves out "planned in" (the command states its own whole time)."""
        per = "per process" if self.num_processes > 1 else "one process"
        out = [f"{self.method} on {self.model}: {self.num_parameters / 1e9:.3f}B parameters "
               f"({self.trainable_parameters / 1e9:.3f}B trained); {self.num_processes} process(es), {self.engine}, "
               f"{per}"]
        where = "" if self.worst.step is None else (
            f", arriving at optimizer step {self.worst.step}" +
            (f" (micro-batch {self.worst.micro_batch})" if self.worst.micro_batch else ""))
        out.append(f"predicted step peak (worst batch: {self.worst.batch}{where}): {_mib(self.worst.peak_bytes)}")
        out += [f"  {name.replace('_', ' '):<17} {_mib(self.worst.parts.get(name, 0))}" for name in PARTS
                if self.worst.parts.get(name)]
        if self.any_order is not None:
            out.append(f"in any order (another seed, a later epoch: {self.any_order.batch}): "
                       f"{_mib(self.any_order.peak_bytes)}; a budget must hold this")
        if self.measured_step is not None:
            out.append(f"predicted peak of step 2 (the step memory_breakdown measures; batch: "
                       f"{self.measured_step.batch}): {_mib(self.measured_step.peak_bytes)}")
        if self.generation is not None:
            out += self.generation.lines()
        if self.offload is not None:
            out += self.offload.lines()
        if self.activation_host_bytes:
            out.append(f"activation offloading: the saved activations it moves wait in pinned host memory, "
                       f"{_mib(self.activation_host_bytes)} at most (not on the device above)")
        if self.terms:
            out.append("on the device, beyond the traced tensors (docs/plan.md):")
            out += [f"  {term.name:<30} {_mib(term.bytes)}  ({term.source})" for term in self.terms]
            out.append(f"  {'device total':<30} {_mib(self.device_total_bytes)}")
        out += [f"note: {note}" for note in self.notes]
        if timing:
            out.append(f"planned in {self.seconds:.1f} s")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _mib(size: int) -> str:
    return f"{size / MIB:,.1f} MiB" if size < 10 * GIB else f"{size / GIB:,.2f} GiB"


# --- the traced run ----------------------------------------------------------------------------------------------------

PLANNING_FIELDS = dict(max_steps=2, save_strategy="no", report_to=[], disable_tqdm=True, memory_breakdown=True,
                       logging_steps=1, eval_strategy="no", push_to_hub=False, plan_check=False,
                       memory_budget=None, nonfinite_policy="stop")


def _planning_trainer_class(trainer_class, mode: WeightlessMode):
    class Planned(trainer_class):
        forced_batches: list | None = None
        traced_by_planner = True  # the plan holds the host to its own `host_memory` (checkpoint_offload_plan.py)

        def load_models(self, *args, **kwargs):  # the model, its adapters and references: all fake
            with mode.building(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="model_init_kwargs are ignored")  # applied when built
                return super().load_models(*args, **kwargs)

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            if self.forced_batches is not None:
                epoch_iterator = iter(self.forced_batches[:num_batches])
                if len(self.forced_batches) > num_batches:  # a rank's batches: each step takes its own
                    self.forced_batches = self.forced_batches[num_batches:]
            return super().get_batch_samples(epoch_iterator, num_batches, device)

        def save_model(self, *args, **kwargs):  # fake weights are never written
            pass

    Planned.__name__ = Planned.__qualname__ = trainer_class.__name__
    return Planned


def _batch_description(batch) -> tuple[tuple[int, int], str]:
    """((token slots, loss targets), words) of a collated batch or of a list of prompt rows."""
    if isinstance(batch, dict):
        tensors = {k: v for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2
                   and not v.dtype.is_floating_point and k.endswith("input_ids")}
        if not tensors:
            tensors = {k: v for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2}
        slots = sum(v.numel() for v in tensors.values())
        labels = batch.get("labels")
        targets = int((labels != -100).sum()) if torch.is_tensor(labels) else slots
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
        return (slots, targets), shapes or "no token tensors"
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], dict):
        lengths = [len(row.get("prompt_ids") or row.get("input_ids") or []) for row in batch]
        return (len(lengths) * max(lengths), sum(lengths)), f"{len(lengths)} prompts, longest {max(lengths)} tokens"
    return (0, 0), type(batch).__name__


def _first_epoch_batches(trainer, limit: int | None = None):
    for rank in each_rank():  # a traced launch (planning/sharded.py): every rank's own micro-batches
        loader = trainer.get_train_dataloader()
        if rank and type(loader).__name__ == "DataLoaderDispatcher":
            break  # batches dispatched from rank 0: rank 0's loader saw them all
        for index, batch in enumerate(loader):
            if limit is not None and index >= limit:
                break
            yield index, batch


def plan_memory(model, train_dataset=None, method="sft", *, args=None, processing_class=None, peft_config=None,
                reward_funcs=None, num_processes: int = 1, engine: str = "ddp", device: str | None = None,
                measured_step: bool = True, max_batches: int | None = None, lengths=None, rank: int = 0,
                host_memory=None, **config_fields) -> MemoryPlan:
    """Predict the step peak of training `model` on `train_dataset` with `method`, per process.

    `model`: Hub id, local folder (config.json is read, no weights), a transformers config, or a model (its config).
    `train_dataset`: the data as the trainer reads it. `args`: a config of the method (or pass its fields as keyword
    arguments). `device`: a GPU name of `metrics.devices.GPUS` or a size ("24GiB"), to add the device's terms.
    `lengths`: instead of `train_dataset`, `leantune profile`'s JSON (path or dict): rows of the profiled lengths
    (planning/length_profile.py).
    `rank`: with `num_processes` > 1, the process whose own step 2 `measured_step` is (each rank sees its own
    batches: under DDP/FSDP2 a traced launch's loader, planning/sharded.py; under ZeRO every N-th batch).
    `host_memory`: the host memory `checkpoint_offload_layers` is held to (a size; None: this machine's available)."""
    started = time.perf_counter()
    spec = method_of(method)
    trainer_class, config_class = method_classes(method)
    check_engine(engine, num_processes)
    if not 0 <= rank < num_processes:
        raise ValueError(f"`rank`: {rank} is not a process of {num_processes} (0 to {num_processes - 1}).")
    if train_dataset is None and lengths is not None:
        train_dataset = dataset_from_lengths(lengths, spec, filler_token(model_config_of(model)))
    if train_dataset is None:
        raise ValueError("`train_dataset` is required (the data as the trainer reads it, or a length profile).")
    fields = dict(config_fields)
    if args is not None:
        fields = {**{k: v for k, v in args.to_dict().items() if k in _explicit_fields(args)}, **fields}

    quantization = quantization_from_fields(fields)  # 4/8-bit (QLoRA): planning/quantized.py
    quantized = {"quantization": quantization} if quantization is not None else {}
    config = model_config_of(model)
    dtype = dtype_of(fields, model)
    zero = None
    if engine in ("zero2", "zero3"):  # the one-process trace in DeepSpeed's dtype, a rank's states put in (zero.py)
        zero = zero_plan.zero_settings(engine, fields, num_processes, config, dtype)
        fields = zero_plan.traced_fields(fields, zero)
    # ZeRO is not traced as a launch: a rank's micro-batches are every N-th of the one-process loader
    shard = (num_processes, rank) if num_processes > 1 and zero is not None else None
    model_label = model if isinstance(model, str) else getattr(config, "_name_or_path", "") or config.model_type
    trainer_kwargs = {"processing_class": processing_class, "peft_config": peft_config}
    if reward_funcs is not None:
        trainer_kwargs["reward_funcs"] = reward_funcs
    elif spec.online:
        trainer_kwargs["reward_funcs"] = _no_reward
    logging_level = logging.getLogger("leantune").level
    notes = []
    if fields.get("tiled_mlp") and fields.get("tiled_mlp_tile_size") is None:  # the plan traces the tile it names
        tile, note = rule_tile(config, dtype, fields, device)
        fields = {**fields, "tiled_mlp_tile_size": tile}
        notes.append(note)
    elif fields.get("tiled_mlp"):
        notes.append(f"tiled MLP: {fields['tiled_mlp_tile_size']:,} tokens per tile")
    if fields.get("tiled_mlp") and fields.get("tiled_attention_projections"):
        notes.append("tiled attention projections: the layers' norms and q/k/v/o at the tiled MLP's tile")
    engine_context = contextlib.ExitStack()
    if zero is not None:
        engine_context.enter_context(zero_plan.deepspeed_init_off())
    launch = contextlib.ExitStack()  # a rank of a traced launch (planning/sharded.py), for the traces only
    cuda_host = plans_cuda_run(device)  # activation offloading moves activations to the host only from CUDA
    try:
        launch.enter_context(traced_launch(engine, num_processes, rank, device))
        layers = _layer_count(config)
        if layers is not None and layers > LAYERS_TRACED[-1]:
            runs = [_trace(_with_layers(config, count), trainer_class, config_class, train_dataset,
                           traced_fields(fields, True), trainer_kwargs, measured_step, max_batches, shard, dtype,
                           cuda_host=cuda_host, **quantized) for count in LAYERS_TRACED]
            regrouped, counts = [], LAYERS_TRACED
            extrapolated = _extrapolate(runs, layers, regrouped, beside_needed=zero is not None)
            if extrapolated is None and layers > LAYERS_RETRACED[-1]:
                counts = LAYERS_RETRACED
                regrouped.clear()
                runs = runs[1:] + [_trace(_with_layers(config, LAYERS_RETRACED[-1]), trainer_class, config_class,
                                          train_dataset, traced_fields(fields, True), trainer_kwargs, measured_step,
                                          max_batches, shard, dtype, cuda_host=cuda_host, **quantized)]
                extrapolated = _extrapolate(runs, layers, regrouped, beside_needed=zero is not None, counts=counts)
            offload_extrapolated = extrapolated is not None
            if extrapolated is None:
                notes.append(f"per-layer growth not exactly linear over {LAYERS_TRACED} or {LAYERS_RETRACED} layers: "
                             f"all {layers} traced")
                result = _trace(config, trainer_class, config_class, train_dataset, traced_fields(fields, False),
                                trainer_kwargs, measured_step, max_batches, shard, dtype, cuda_host=cuda_host, **quantized)
            else:
                result = extrapolated
                notes.append(f"traced with {', '.join(map(str, counts))} of the {layers} layers; every part "
                             "grew by the same bytes per layer (exact), extrapolated to all layers" if not regrouped
                             else f"traced with {', '.join(map(str, counts))} of the {layers} layers; the peak "
                             f"grew by the same bytes per layer (exact), extrapolated to all layers; its parts from "
                             f"{counts[-2]} layers on (a tensor of the same bytes changed part between "
                             f"{counts[0]} and {counts[1]}: {', '.join(sorted(set(regrouped)))})")
                if counts == LAYERS_RETRACED:
                    notes.append(f"the {LAYERS_TRACED[0]}-layer trace peaked elsewhere (a part that does not grow "
                                 f"with the layers, such as the final norm's backward, was its peak): "
                                 f"{', '.join(map(str, LAYERS_RETRACED))} layers used")
        else:
            offload_extrapolated = False
            result = _trace(config, trainer_class, config_class, train_dataset, traced_fields(fields, False),
                            trainer_kwargs, measured_step, max_batches, shard, dtype, cuda_host=cuda_host, **quantized)
    finally:
        launch.close()
        logging.getLogger("leantune").setLevel(logging_level)
        engine_context.close()
    num_parameters, trainable, second, traced, round_shape = result
    host = 0
    if zero is not None:
        second, traced, host = zero_plan.per_rank(config, trainer_class, peft_config, zero, trainable, second,
                                                  traced, rank, device)
        notes += zero_plan.notes(zero)
        if host:
            notes.append(f"host memory (ZeRO-Offload, per process): {host / GIB:,.2f} GiB pinned")
    # the trainer's own second step is a step of the run too: where it generates (GKD's on-policy steps, online
    # methods) its batch is not the loader's, and it may peak above the loader's worst
    bound = sorted((step for step in traced if step.any_order), key=lambda step: -step.peak_bytes)
    traced = [step for step in traced if not step.any_order]
    worst = max([*traced, *([second] if second is not None else [])], key=lambda step: step.peak_bytes)
    plan = MemoryPlan(spec.card_name, str(model_label), num_parameters, trainable, num_processes, engine, worst, second,
                      bound[0] if bound else None, device_terms(device, fields, num_processes, engine),
                      per_rank_notes(engine, num_processes) + notes,
                      {k: v for k, v in fields.items()}, 0.0)
    # checkpoint_offload_plan.py: the offload's layers, and the host held to it beside ZeRO-Offload's bytes
    with_offload(plan, fields, config, offload_extrapolated, device, host_memory, host)
    if round_shape is not None:  # an online method: its generation round beside the update step
        plan.generation = generation_round(config, round_shape, dtype, held_between_steps(worst.parts),
                                           num_parameters)
    plan.seconds = time.perf_counter() - started
    return plan


LAYERS_TRACED = (2, 3, 4)  # a 1-layer model peaks elsewhere in the step (measured); from 2 layers on it is linear
# where the 2-layer trace peaks at a moment the layers do not grow (the final norm's backward of a 500,000-token row
# with the MLP and the attention block tiled), the step is linear from 3 layers on: one more trace, not all layers
LAYERS_RETRACED = (3, 4, 5)


def _trace(config, trainer_class, config_class, train_dataset, fields, trainer_kwargs, measured_step, max_batches,
           shard=None, dtype=torch.float32, quantization=None, cuda_host=False):
    """(parameters, trainable parameters, the trainer's own second step or None, [traced worst candidates], an online
    method's round shape or None). `cuda_host`: a CUDA run's plan (its activation offloading moves to the host)."""
    # PEFT resolves "all-linear" in the config it is given to this model's module names: each trace gets a copy
    trainer_kwargs = {**trainer_kwargs, "peft_config": copy.deepcopy(trainer_kwargs.get("peft_config"))}
    with planning_session(cuda_host) as mode:
        fake = fake_model_from_config(config, mode, model_class_of(trainer_class), dtype)
        if quantization is not None:
            fake = quantize_fake_model(fake, quantization, mode)
        fields, trainer_kwargs = fake_frozen_sources(trainer_class, fields, trainer_kwargs, mode,
                                                     trainer_kwargs.get("processing_class"))
        run_args = config_class(**{"output_dir": "/tmp/leantune-plan", "use_cpu": True, **fields,
                                   **PLANNING_FIELDS})
        accumulation = run_args.gradient_accumulation_steps
        trainer = _planning_trainer_class(trainer_class, mode)(model=fake, args=run_args,
                                                               train_dataset=train_dataset, **trainer_kwargs)
        trainer.nonfinite.checks_steps = False  # fake values decide nothing (trainers/parts/step_guards.py)
        _quiet(trainer)
        _real_reward_weights(trainer)

        num_parameters = sum(parameter_count(p) for p in trainer.model.parameters())
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        second = None
        if measured_step:
            if shard is not None:  # (processes, rank): the rank's micro-batches, every processes-th of one loader
                processes, rank = shard
                wanted = 2 * accumulation * processes
                batches = [batch for _, batch in _first_epoch_batches(trainer, wanted)]
                trainer.forced_batches = batches[rank::processes] if len(batches) == wanted else None
            _train_quietly(trainer)
            trainer.forced_batches = None
            second = TracedStep.of(trainer.memory_breakdown, "the trainer's own second step" + (
                f" on rank {shard[1]}" if shard is not None else ""), 2, host_bytes=host_peak(trainer))
        traced, seen = [], []  # seen: (batch, its trace) for a batch met again (one long row is every candidate)
        for index, batch, words in _worst_candidates(trainer, max_batches):
            again = next((step for other, step in seen if _same_batch(batch, other)), None)
            if again is None:
                _reset_for_trace(trainer)
                trainer.forced_batches = [batch] * (2 * accumulation)
                _train_quietly(trainer)
                seen.append((batch, TracedStep.of(trainer.memory_breakdown, words, host_bytes=host_peak(trainer))))
            step = again or seen[-1][1]
            if index is None:  # the longest rows together: a bound, at no step
                traced.append(dataclasses.replace(step, batch=words, any_order=True))
                continue
            processes = shard[0] if shard is not None else 1  # each step of N processes takes N loader batches
            traced.append(dataclasses.replace(step, batch=words, step=index // (accumulation * processes) + 1,
                                              micro_batch=index // processes % accumulation))
        round_shape = round_shape_of(trainer) if trainer.generates_rounds else None
    return num_parameters, trainable, second, traced, round_shape


def _layer_count(config):
    """Layers of a plain decoder (a multimodal model's nested text config is traced whole)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "num_hidden_layers", None) if text is config else None


def _with_layers(config, count: int):
    smaller = copy.deepcopy(config)
    smaller.num_hidden_layers = count
    for name in ("layer_types", "mlp_only_layers"):
        value = getattr(smaller, name, None)
        if isinstance(value, list) and len(value) > count:
            setattr(smaller, name, value[:count])
    return smaller


def _extrapolate(runs, layers: int, regrouped: list | None = None, beside_needed: bool = True,
                 counts: tuple[int, int, int] = LAYERS_TRACED):
    """The traces of `counts` layers to `layers`, if every number grew by the same amount per layer; else None.
    `beside_needed`: the breakdown beside the gradients (read by ZeRO-2's plan only, zero.py) must grow so too;
    without ZeRO one that does not is left out (None) rather than costing a trace of every layer (seen: the 8B QLoRA
    row at 500,000 tokens with the attention block tiled, whose 2-layer trace holds its gradients at another moment).

    One exception, named in `regrouped`: a step whose peak grew linearly while some of its parts did not, because a
    tensor of the same bytes is counted in another part with the fewest layers (an activation there, a temporary
    from the next count on: checkpoint offload at long rows), takes its parts from the last two traces, where they
    grew linearly and still add up to its peak."""
    def line(values):
        first, second, third = values
        if second - first != third - second:
            return None
        return first + (layers - counts[0]) * (second - first)

    def from_last_two(values):
        second, third = values[1:]
        return third + (layers - counts[-1]) * (third - second)

    parameters = [line([run[0] for run in runs]), line([run[1] for run in runs])]
    steps = []
    pairs = [[run[2] for run in runs]] if runs[0][2] is not None else []
    pairs += [[run[3][i] for run in runs] for i in range(len(runs[0][3]))]
    if any(len(run[3]) != len(runs[0][3]) for run in runs):
        return None
    for group in pairs:
        peak = line([step.peak_bytes for step in group])
        names = set().union(*(step.parts for step in group))
        parts = {name: line([step.parts.get(name, 0) for step in group]) for name in names}
        if peak is not None and regrouped is not None and any(value is None for value in parts.values()):
            moved = [name for name, value in parts.items() if value is None]
            parts = {name: from_last_two([step.parts.get(name, 0) for step in group]) for name in names}
            if sum(group[-1].parts.values()) != group[-1].peak_bytes or sum(parts.values()) != peak:
                return None
            regrouped += moved
        if peak is None or any(value is None for value in parts.values()):
            return None
        first = group[0]
        beside = None
        if all(step.backward_beside_gradients is not None for step in group):
            names = set().union(*(step.backward_beside_gradients for step in group))
            beside = {name: line([step.backward_beside_gradients.get(name, 0) for step in group]) for name in names}
            if any(value is None for value in beside.values()):
                if beside_needed:
                    return None
                beside = None
        steps.append(TracedStep(peak, parts, first.batch, first.step, first.micro_batch, first.any_order, beside,
                                line([step.host_bytes for step in group])))
    if None in parameters:
        return None
    second = steps.pop(0) if runs[0][2] is not None else None
    return parameters[0], parameters[1], second, steps, runs[0][4]


def _explicit_fields(args) -> set[str]:
    defaults = type(args)(output_dir=args.output_dir)
    return {f.name for f in dataclasses.fields(args) if f.init and getattr(args, f.name, None) != getattr(
        defaults, f.name, None)} - {"output_dir"}


def _no_reward(completions, **kwargs):
    """The plan's reward: rewards cost no memory on the device (a reward model is a separate term)."""
    return [float(i % 2) for i in range(len(completions))]


def _worst_candidates(trainer, max_batches):
    """The first epoch's batches with the most token slots and with the most targets: (index, batch, words)."""
    best_slots = best_targets = None
    for index, batch in _first_epoch_batches(trainer, max_batches):
        (slots, targets), words = _batch_description(batch)
        if best_slots is None or slots > best_slots[0][0]:
            best_slots = ((slots, targets), index, batch, words)
        if best_targets is None or targets > best_targets[0][1]:
            best_targets = ((slots, targets), index, batch, words)
    if best_slots is None:
        raise ValueError("`train_dataset`: the trainer's data loader yields no batch.")
    found = [best_slots[1:]]
    if best_targets[1] != best_slots[1] and best_targets[0] != best_slots[0]:
        found.append(best_targets[1:])
    if max_batches is None and isinstance(best_slots[2], dict):  # the whole epoch of collated rows was read: add
        # the batches no order can beat (planning/any_order.py); online methods' batches are prompts, generated anew

        found += [(None, batch, words) for batch, words in longest_rows_batches(trainer)]
    return found


def _same_batch(batch, other) -> bool:
    """Whether two collated batches are the same (keys, shapes, values): a batch traced once is not traced again, the
    same trainer on the same batch arriving at the same bytes."""
    if not (isinstance(batch, dict) and isinstance(other, dict)) or batch.keys() != other.keys():
        return False
    for key, value in batch.items():
        given = other[key]
        if torch.is_tensor(value) != torch.is_tensor(given):
            return False
        if torch.is_tensor(value):
            same = value.shape == given.shape and value.dtype == given.dtype and torch.equal(value, given)
        else:  # a number or a word; anything else is taken as different (traced again: never wrong, only slower)
            same = isinstance(value, (int, float, str, bool, type(None))) and type(value) is type(given) and \
                value == given
        if not same:
            return False
    return True


def _real_reward_weights(trainer) -> None:
    """Reward weights made while the models were built are fake; rewards are computed on the host from real text, and
    their weights must be real for the round's bookkeeping (masks of NaN rewards)."""
    rewards = getattr(trainer, "rewards", None)
    for name, value in list(vars(rewards).items()) if rewards is not None else []:
        if is_fake_tensor(value):
            given = getattr(trainer.args, "reward_weights", None)
            real = torch.tensor(given, dtype=value.dtype) if given else torch.ones(tuple(value.shape), dtype=value.dtype)
            setattr(rewards, name, real)


def _reset_for_trace(trainer) -> None:
    if hasattr(trainer, "_buffer"):
        trainer._buffer = []
    trainer.run_metrics.memory_breakdown = None  # the traced run starts without one
    host_peak(trainer)  # the offload's ledger too
    restart = getattr(trainer.model_wrapped, "restart_trace", None)  # a traced launch's DDP (planning/sharded.py)
    if restart is not None:
        restart()


def _quiet(trainer) -> None:
    """Logging of a fake run prints zeros; keep only the trainer's warnings."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    logging.getLogger("leantune").setLevel(logging.WARNING)


def _train_quietly(trainer) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
