"""Per-rank memory under DeepSpeed ZeRO-2 and ZeRO-3: the one-process trace, plus what DeepSpeed holds, term by term.

DeepSpeed's engine is not traced (on fake weights its step stops at data-dependent checks, docs/plan.md). The plan
is the method's one-process step traced with the model in DeepSpeed's compute dtype (fake weights, no engine), whose
model states are then replaced by what a rank holds under DeepSpeed's own rules, read from the DeepSpeed config the
run would use. Each term is filed under the part leantune's measured breakdown files it (metrics/memory_breakdown.py
`_engine_tensors`; docs/plan.md, "Per process", lists the terms with their DeepSpeed config keys and sources):

- parameters: ZeRO-2 keeps every weight, flattened into one buffer padded to 2 x N elements; ZeRO-3 keeps
  ceil(numel / N) of each parameter (`ds_tensor`, DeepSpeed's per-parameter padding).
- optimizer states: an fp32 master copy of the trained partition plus the torch optimizer's states on it (fp32,
  as many per element as the traced optimizer keeps).
- gradients: ZeRO-3 holds its gradient partitions and the `reduce_bucket_size` bucket from start-up; ZeRO-2
  allocates the bucket for each backward and moves each gradient into it once accumulated (contiguous gradients).
- ZeRO-3 gathers a module's weights for its forward and backward (N > 1; at one process the partition is the
  weight): the head at the traced forward's peak, the input embedding at the end of backward.
- Reducing the gradients at the end of backward flattens the last bucket (ZeRO-3 on gloo, CPU: copied once more).

A step peaks at one of these moments: the traced one (the forward's or backward's activations, with the states above
instead of the one-process ones), ZeRO-2's backward moment (where the trace holds most beside the gradients it has
accumulated, which ZeRO-2 has moved into its bucket), or the end of backward, when the last bucket is reduced (no
activations left). The plan is the largest, with its parts.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import get_peft_model
from transformers.integrations import deepspeed as hf_deepspeed

from ..models.output_head import unwrap_model
from .fake_step import fake_model_from_config
from .planned_run import TracedStep, model_class_of, planning_session

STAGES = {"zero2": 2, "zero3": 3}
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000  # deepspeed/runtime/zero/config.py `reduce_bucket_size`
DEFAULT_PREFETCH_BUCKET_SIZE = 50_000_000  # `stage3_prefetch_bucket_size`
MASTER_BYTES = 4  # the fp32 master copy and the optimizer states on it


@dataclass(frozen=True)
class ZeroSettings:
    """What decides a rank's memory, from the DeepSpeed config the run would use."""

    stage: int
    num_processes: int
    reduce_bucket_size: int
    prefetch_bucket_size: int
    compute_dtype: torch.dtype
    contiguous_gradients: bool = True
    source: str = "DeepSpeed's defaults"
    offload_optimizer: bool = False  # ZeRO-Offload: `offload_optimizer.device` "cpu" (examples/accelerate/zero2_offload.yaml)

    @property
    def compute_bytes(self) -> int:
        return torch.empty((), dtype=self.compute_dtype).element_size()


@dataclass
class ParameterShapes:
    """The model's parameters, as DeepSpeed partitions them: each one's size, whether it trains, and the modules
    whose weights ZeRO-3 has gathered at the two peak moments (the head, the input embedding)."""

    sizes: list[int]
    trained: list[bool]
    head: int  # elements of the output head module, gathered at the traced forward's peak
    embedding: int  # elements of the input embedding module, gathered at the end of backward
    backward_order: list[int] = field(default_factory=list)  # sizes of the trained parameters as backward meets them


def deepspeed_config_of(fields: dict) -> tuple[dict, str]:
    """The `deepspeed` config field (a dict or a JSON file), or {} (accelerate's plugin: DeepSpeed's defaults)."""
    value = fields.get("deepspeed")
    if value in (None, ""):
        return {}, "DeepSpeed's defaults"
    if isinstance(value, dict):
        return value, "the `deepspeed` dict"
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"`deepspeed`: no DeepSpeed config file at {value}.")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as error:
        raise ValueError(f"`deepspeed`: {value} is not JSON ({error}).") from error


def zero_settings(engine: str, fields: dict, num_processes: int, model_config, model_dtype) -> ZeroSettings:
    """`auto` values resolve as transformers resolves them for the Trainer (integrations/deepspeed.py:
    reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 hidden^2)."""
    config, source = deepspeed_config_of(fields)
    zero = config.get("zero_optimization", {}) or {}
    stage = STAGES[engine]
    given = zero.get("stage")
    if given not in (None, "auto") and int(given) != stage:
        raise ValueError(f"`deepspeed`: {source} sets ZeRO stage {given}, but the engine is {engine}.")
    hidden = getattr(model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config,
                     "hidden_size", None)

    def size(key, default, auto):
        value = zero.get(key, default)
        if value == "auto":
            if hidden is None:
                raise ValueError(f"`deepspeed`: {key} is 'auto' and the model config has no hidden_size.")
            return int(auto * hidden * hidden)
        return int(float(value))

    # DeepSpeed casts the module to bf16/fp16 when its config enables them ("auto": the Trainer's --bf16/--fp16);
    # with no config file, accelerate writes them from the same flags
    dtype = model_dtype
    for key, wanted in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        enabled = (config.get(key) or {}).get("enabled", "auto")
        if enabled is True or (enabled == "auto" and fields.get(key)):
            dtype = wanted
    offload = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower() in ("cpu", "nvme")
    return ZeroSettings(stage, num_processes, size("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_SIZE, 1.0),
                        size("stage3_prefetch_bucket_size", DEFAULT_PREFETCH_BUCKET_SIZE, 0.9), dtype,
                        bool(zero.get("contiguous_gradients", True)), source, offload)


def traced_fields(fields: dict, settings: ZeroSettings) -> dict:
    """The one-process trace's fields: no DeepSpeed, the model in DeepSpeed's compute dtype, no autocast (DeepSpeed
    casts the module itself)."""
    traced = {k: v for k, v in fields.items() if k not in ("deepspeed", "bf16", "fp16")}
    kwargs = dict(traced.get("model_init_kwargs") or {})
    kwargs["dtype"] = settings.compute_dtype
    traced["model_init_kwargs"] = kwargs
    return traced


def parameter_shapes(model) -> ParameterShapes:
    """Sizes of a (fake) model's parameters, in the order DeepSpeed meets them."""
    params = list(model.parameters())
    base = unwrap_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None

    def numel(module):
        return sum(p.numel() for p in module.parameters()) if module is not None else 0

    trained = [p.numel() for p in params if p.requires_grad]
    return ParameterShapes([p.numel() for p in params], [p.requires_grad for p in params], numel(head),
                           numel(embedding), list(reversed(trained)))


@dataclass
class RankTerms:
    """What one rank holds beyond the traced activations, by the breakdown's part."""

    parameters: int
    master_and_states: int
    persistent_gradients: int  # ZeRO-3's partitions and bucket; 0 under ZeRO-2
    bucket: int


def rank_terms(shapes: ParameterShapes, settings: ZeroSettings, states_per_element: float) -> RankTerms:
    n, size = settings.num_processes, settings.compute_bytes
    trained = [s for s, t in zip(shapes.sizes, shapes.trained) if t]
    if settings.stage == 3:
        parameters = sum(math.ceil(s / n) for s in shapes.sizes) * size
        partition = sum(math.ceil(s / n) for s in trained)
        bucket = settings.reduce_bucket_size * size if settings.contiguous_gradients else 0
        persistent = partition * size + bucket
    else:
        flat = _aligned(sum(trained), 2 * n)  # stage_1_and_2.py: one flat buffer, padded to nccl alignment x N
        frozen = sum(s for s, t in zip(shapes.sizes, shapes.trained) if not t)
        parameters = (flat + frozen) * size
        partition = flat // n
        bucket = settings.reduce_bucket_size * size if settings.contiguous_gradients else 0
        persistent = 0
    master_and_states = round(partition * MASTER_BYTES * (1 + states_per_element))
    if settings.offload_optimizer:  # ZeRO-Offload: the fp32 master and its states live in host memory
        master_and_states = 0
    return RankTerms(parameters, master_and_states, persistent, bucket)


def host_bytes(shapes: ParameterShapes, settings: ZeroSettings, states_per_element: float) -> int:
    """What ZeRO-Offload keeps in host memory per rank: the fp32 master partition and its optimizer states, and the
    fp32 gradient partition the CPU optimizer reads (pinned buffers; 0 without offload)."""
    if not settings.offload_optimizer:
        return 0
    n = settings.num_processes
    trained = [s for s, t in zip(shapes.sizes, shapes.trained) if t]
    partition = sum(math.ceil(s / n) for s in trained) if settings.stage == 3 else _aligned(sum(trained), 2 * n) // n
    return round(partition * MASTER_BYTES * (2 + states_per_element))


ADAM_STATES = 2.0  # ZeRO-Offload steps with DeepSpeed's CPU Adam (its default): exp_avg and exp_avg_sq


def run_host_bytes(trainer_class, model_config, fields: dict, peft_config, num_processes: int, model_dtype) -> int:
    """What a run's ZeRO-Offload (`offload_optimizer.device: cpu` in its `deepspeed` config) keeps in host memory
    per process, from the model's config before any weight loads (`host_bytes`, DeepSpeed's CPU Adam); 0 without."""
    config, _ = deepspeed_config_of(fields)
    zero = config.get("zero_optimization", {}) or {}
    if str((zero.get("offload_optimizer") or {}).get("device", "none")).lower() != "cpu":
        return 0
    engine = "zero3" if str(zero.get("stage")) == "3" else "zero2"
    settings = zero_settings(engine, fields, num_processes, model_config, model_dtype)
    return host_bytes(model_shapes(model_config, trainer_class, peft_config, settings.compute_dtype), settings,
                      ADAM_STATES)


def _aligned(count: int, alignment: int) -> int:
    return -(-count // alignment) * alignment


def states_per_element(traced_parts: dict, trainable: int, traced_dtype) -> float:
    """How many optimizer-state values the traced optimizer keeps per trained element (AdamW 2, SGD+momentum 1)."""
    size = torch.empty((), dtype=traced_dtype).element_size()
    return traced_parts.get("optimizer_states", 0) / max(trainable * size, 1)


def traced_moment(parts: dict, terms: RankTerms, shapes: ParameterShapes, settings: ZeroSettings) -> dict:
    """The traced moment with a rank's model states: the forward's (or backward's) activations and temporaries are
    the trace's; ZeRO-3 adds the head's gathered weights (the traced peak of a causal LM is at its head)."""
    moment = dict(parts)
    moment["parameters"] = terms.parameters
    moment["optimizer_states"] = terms.master_and_states
    grads = parts.get("gradients", 0)
    # frozen models (a reference copy, reward models): the trace holds them whole; ZeRO-2 gives them a plain replica
    # (trainers/parts/frozen_models.py), ZeRO-3 partitions them in an inference engine of their own
    frozen = frozen_held(parts, shapes, settings)
    if frozen:
        moment["frozen_models"] = frozen
    in_backward = bool(grads or parts.get("temporaries", 0))
    if settings.stage == 3:
        in_flight = min(grads, shapes.head * settings.compute_bytes)  # a module's gradient before it is bucketed
        moment["gradients"] = terms.persistent_gradients + in_flight
        if settings.num_processes > 1:  # the head's weights gathered for its forward, or again for its backward
            part = "temporaries" if in_backward else "activations"
            moment[part] = moment.get(part, 0) + _gathered(shapes.head, settings)
        return moment
    if grads:
        moment.update(_zero2_backward_gradients(grads, terms, shapes, settings, moment.get("temporaries", 0)))
    return moment


def _zero2_backward_gradients(grads: int, terms: RankTerms, shapes: ParameterShapes, settings: ZeroSettings,
                              temporaries: int) -> dict:
    """What ZeRO-2 holds in backward for the gradients the trace holds at its moment (`grads` bytes, those of the
    first trained parameters in backward order, each accumulated whole).

    With `contiguous_gradients` (the default), each gradient is copied into the bucket by the hook that runs once it
    is accumulated, and its own storage freed (stage_1_and_2.py `reduce_independent_p_g_buckets_and_remove_grads`:
    `grad.data` becomes a view of the bucket): the rank holds the bucket, not the gradients beside it. A gradient
    larger than the bucket keeps its own storage until the next one reduces it; once a full bucket has been reduced,
    the rank's slice of it is kept in a gradient partition (`copy_grads_in_partition`; the fp32 one the update reads
    with bf16/fp16). A gradient being formed (not yet accumulated) is a temporary in the trace, as in the run.
    Without contiguous gradients every gradient stays its own tensor until its bucket is reduced: the trace's."""
    if not settings.contiguous_gradients:
        return {"gradients": grads}
    flushed, pending = _backward_prefix(shapes.backward_order, grads // settings.compute_bytes,
                                        settings.reduce_bucket_size)
    held = {"gradients": terms.bucket + pending * settings.compute_bytes}
    if flushed:
        n = settings.num_processes
        held["temporaries"] = temporaries + _aligned(sum(shapes.backward_order), 2 * n) // n * MASTER_BYTES
    return held


def _backward_prefix(backward_order: list[int], accumulated: int, bucket_elements: int) -> tuple[bool, int]:
    """For the first `accumulated` elements of gradients in backward order: whether a bucket was reduced, and the
    elements of a gradient larger than the bucket still waiting to be (0 if none)."""
    filled, done, flushed, pending = 0, 0, False, 0
    for size in backward_order:
        if done + size > accumulated:
            break
        done += size
        if filled and filled + size > bucket_elements:
            flushed, filled = True, 0
        pending = size if size > bucket_elements else 0
        filled += size
    return flushed, pending


def frozen_held(parts: dict, shapes: ParameterShapes, settings: ZeroSettings) -> int:
    """Bytes of frozen models' weights a rank holds (the breakdown's `frozen_models`): the trace's whole weights, or
    under ZeRO-3 with N processes their partitions (ceil(numel / N) per parameter: a reference copy has the policy's
    shapes; another model is divided as a whole)."""
    whole = parts.get("frozen_models", 0)
    n, size = settings.num_processes, settings.compute_bytes
    if settings.stage != 3 or n == 1 or not whole:
        return whole
    if whole == sum(shapes.sizes) * size:
        return sum(math.ceil(s / n) for s in shapes.sizes) * size
    return math.ceil(whole / size / n) * size


def _gathered(module_elements: int, settings: ZeroSettings) -> int:
    return module_elements * settings.compute_bytes


def reduce_moment(terms: RankTerms, shapes: ParameterShapes, settings: ZeroSettings, rank: int,
                  on_gloo: bool, frozen: int = 0) -> dict:
    """The end of backward: the last gradient bucket reduced, no activations left."""
    n, size, bucket_elements = settings.num_processes, settings.compute_bytes, settings.reduce_bucket_size
    last, alone = _last_bucket(shapes.backward_order, bucket_elements, settings.contiguous_gradients)
    copies = 1 if on_gloo else 0  # gloo's reduce-scatter works on a copy of its input (measured; NCCL does not)
    moment = {"parameters": terms.parameters, "optimizer_states": terms.master_and_states, "frozen_models": frozen}
    if settings.stage == 3:
        gradients = terms.persistent_gradients
        # reduce_scatter_coalesced (deepspeed/runtime/comm/coalesced_collectives.py) cats the bucket's gradients
        # into one flat buffer, except a single tensor that divides evenly
        flattened = 0 if (alone and last % n == 0) else last
        if alone:
            gradients += last * size  # a gradient larger than the bucket stays its own tensor
        moment["gradients"] = gradients
        moment["activations"] = (flattened + copies * last) * size
        if n > 1:
            moment["temporaries"] = _gathered(shapes.embedding, settings)
        return moment
    # ZeRO-2 (stage_1_and_2.py): the bucket holds the gradients; reducing flattens them
    trained = sum(shapes.backward_order)
    # `average_tensor` reduces the bucket one owner's slice after another (`allreduce_bucket`: flatten, reduce to the
    # owner): a rank that is not the last owner holds its reduced slice while the later ones are flattened
    held_slice = _aligned(trained, 2 * n) // n * size if rank < n - 1 else 0
    if not alone and last == trained:  # every gradient in the one bucket
        moment["gradients"] = terms.bucket
        moment["activations"] = last * size + held_slice
    else:  # the fp32 gradient partition the update reads (on the host under ZeRO-Offload), beside the last gradient:
        moment["temporaries"] = 0 if settings.offload_optimizer else _aligned(trained, 2 * n) // n * MASTER_BYTES
        if alone:  # larger than the bucket: it and its flattened copy
            moment["activations"] = 2 * last * size
        else:  # the bucket, and the last gradient beside it (measured)
            moment["gradients"] = terms.bucket + backward_last(shapes) * size
            moment["temporaries"] += held_slice
    return moment


def backward_last(shapes: ParameterShapes) -> int:
    return shapes.backward_order[-1] if shapes.backward_order else 0


def _last_bucket(backward_order: list[int], bucket_elements: int, contiguous: bool) -> tuple[int, bool]:
    """Elements of the last bucket reduced in backward, and whether it is one gradient larger than the bucket."""
    filled, alone = 0, False
    for size in backward_order:
        if filled and filled + size > bucket_elements:
            filled = 0
        filled += size
        alone = size > bucket_elements
    return filled, alone and contiguous


def plan_parts(parts: dict, shapes: ParameterShapes, settings: ZeroSettings, trainable: int, traced_dtype,
               rank: int = 0, on_gloo: bool = True, backward_beside_gradients: dict | None = None
               ) -> tuple[int, dict, str]:
    """(peak, parts, moment) of a rank: the largest of the traced moment, ZeRO-2's backward moment (where all but the
    accumulated gradients peaks in the trace, as they sit in the bucket; the traced peak may be elsewhere because
    one process holds them) and the end of backward."""
    terms = rank_terms(shapes, settings, states_per_element(parts, trainable, traced_dtype))
    moments = {"traced": traced_moment(parts, terms, shapes, settings),
               "end of backward": reduce_moment(terms, shapes, settings, rank, on_gloo,
                                                frozen_held(parts, shapes, settings))}
    if settings.stage == 2 and backward_beside_gradients:
        moments["backward"] = traced_moment(backward_beside_gradients, terms, shapes, settings)
    name = max(moments, key=lambda key: sum(moments[key].values()))
    chosen = {k: int(v) for k, v in moments[name].items() if v}
    return sum(chosen.values()), chosen, name


def notes(settings: ZeroSettings) -> list[str]:
    n = settings.num_processes
    found = [f"ZeRO-{settings.stage}, {n} process(es), from {settings.source}: reduce_bucket_size "
             f"{settings.reduce_bucket_size:,} elements in {str(settings.compute_dtype).replace('torch.', '')}; "
             f"the one-process step traced with DeepSpeed's model states per rank in its place (docs/plan.md)."]
    if settings.offload_optimizer:
        found.append("ZeRO-Offload (offload_optimizer): the fp32 master weights, their optimizer states and the fp32 "
                     "gradient partition are in host memory, not in the device figures")
    if settings.stage == 3 and n > 1 and settings.prefetch_bucket_size:
        found.append(f"stage3_prefetch_bucket_size {settings.prefetch_bucket_size:,}: weights DeepSpeed gathers "
                     "ahead of use are not in the plan (up to that many elements beside the module at work; "
                     "measured with it at 0)")
    return found


@contextlib.contextmanager
def deepspeed_init_off():
    """A config object holding a `deepspeed` field (the command line's) registers itself with transformers, which
    then builds every model under `deepspeed.zero.Init`; the plan builds its fake models without it."""
    registered = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


def model_shapes(config, trainer_class, peft_config, dtype) -> ParameterShapes:
    """The whole model's parameter shapes (every layer, the adapter's if any), from fake weights."""
    with deepspeed_init_off(), planning_session() as mode:
        model = fake_model_from_config(config, mode, model_class_of(trainer_class), dtype)
        if peft_config is not None:
            with mode.building():
                model = get_peft_model(model, peft_config)
        return parameter_shapes(model)


def per_rank(config, trainer_class, peft_config, settings: ZeroSettings, trainable: int, second, traced: list,
             rank: int, device) -> tuple:
    """(the traced steps with a rank's DeepSpeed model states in place of the one-process ones, the host bytes of
    ZeRO-Offload: `host_bytes`)."""
    shapes = model_shapes(config, trainer_class, peft_config, settings.compute_dtype)
    on_gloo = device is None or str(device).lower() == "cpu"

    def of(step):
        if step is None:
            return None
        peak, parts, moment = plan_parts(step.parts, shapes, settings, trainable, settings.compute_dtype, rank,
                                         on_gloo, step.backward_beside_gradients)
        # the traced peak may hold less than the sum of its parts' peaks only if the parts were read at other
        # moments; MemTracker reads them at the peak, so their sum is the peak
        return TracedStep(peak, parts, f"{step.batch}; peak at {moment}", step.step, step.micro_batch, step.any_order,
                          host_bytes=step.host_bytes)  # checkpoint offload's inputs: the trace's, as any engine's

    first = second or traced[0]
    host = host_bytes(shapes, settings, states_per_element(first.parts, trainable, settings.compute_dtype))
    return of(second), [of(step) for step in traced], host
