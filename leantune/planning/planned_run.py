"""What every plan's run is built from, shared by the planner (planner.py) and its helpers for frozen models
(frozen.py) and ZeRO (zero.py): the method's classes, the model's config, dtype and Auto class, one traced step's
record, and the session in which weights are fake and generation runs to its length limit."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from transformers import AutoConfig, AutoModelForSequenceClassification, PretrainedConfig
from transformers.generation.utils import GenerationMixin

from .. import methods
from ..generation import transformers_backend
from ..losses.token_logprobs import repeated_chunks_skipped
from ..memory import offloading
from ..memory.checkpoint_offload import HostLedger
from ..metrics.memory_breakdown import MemoryBreakdown
from ..models.loading import parse_kwargs
from .fake_step import (
    WeightlessMode,
    fake_parameters_convertible,
    fake_tensors_copyable,
    triton_launches_skipped_on_fake,
)


@dataclass
class TracedStep:
    """One traced optimizer step: its peak, the peak's parts, and the batch it ran."""

    peak_bytes: int
    parts: dict[str, int]
    batch: str  # the batch's shape, in words
    step: int | None = None  # the optimizer step (1-based) at which this batch arrives in the first epoch
    micro_batch: int | None = None  # its micro-batch within that step (0-based), with gradient accumulation
    any_order: bool = False  # the longest rows together (planning/any_order.py): no step, a bound of every order
    backward_beside_gradients: dict[str, int] | None = None  # MemoryBreakdown's: ZeRO-2's backward (zero.py)
    host_bytes: int = 0  # the offload's host ledger at its peak: checkpoint offload's or activation offloading's

    @classmethod
    def of(cls, breakdown: MemoryBreakdown, batch: str, step=None, micro_batch=None, host_bytes: int = 0) -> TracedStep:
        beside = breakdown.backward_beside_gradients
        return cls(breakdown.peak_bytes, dict(breakdown.parts), batch, step, micro_batch,
                   backward_beside_gradients=dict(beside) if beside is not None else None, host_bytes=host_bytes)


# --- methods: a trainer class and its config, from the method's entry in leantune/methods.py --------------------------

def method_of(method):
    """The entry of leantune/methods.py a plan is for: given as itself, a name ("sft", "online-dpo", ...) or a trainer
    class (a subclass of a leantune trainer plans as its parent's method)."""
    if isinstance(method, methods.Method):
        return method
    return methods.of(method) if isinstance(method, type) else methods.find(method)


def method_classes(method):
    """(trainer class, config class) of a method (as `method_of` takes it); a trainer class is kept as given."""
    spec = method_of(method)
    return (method if isinstance(method, type) else spec.trainer_class), spec.config_class


# --- the model, from its configuration only ----------------------------------------------------------------------------

def model_config_of(model):
    """A transformers config from a Hub id or local folder (config.json only: no weights are read), a config, or a
    model (its config)."""
    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, torch.nn.Module):
        return model.config
    if isinstance(model, str):
        try:
            return AutoConfig.from_pretrained(model)
        except (OSError, ValueError) as error:
            raise ValueError(f"`model`: no model configuration found for {model!r} ({str(error).splitlines()[0]})") \
                from error
    raise TypeError(f"`model`: expected a Hub id, a local folder, a transformers config or a model, got "
                    f"{type(model).__name__}.")


def dtype_of(fields: dict, model=None):
    """The dtype the weights train in, as the trainers get them: an instantiated model's own; a name loads in float32
    unless model_init_kwargs gives a dtype ("auto": the checkpoint's, from its config)."""
    if isinstance(model, torch.nn.Module):
        return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    kwargs = parse_kwargs(fields.get("model_init_kwargs"))
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype == "auto" and model is not None:
        dtype = getattr(model_config_of(model), "dtype", None)
    if dtype in (None, "auto"):
        return torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


# A chunked loss runs the chunks whose memory can differ, not every repeat of them (losses/token_logprobs.py): the
# trace's time does not grow with the number of targets, its peak is the same to the byte (tests/planning/test_plan_length.py)
SKIP_REPEATED_CHUNKS = True


@contextlib.contextmanager
def planning_session(cuda_host: bool = False):
    """The dispatch mode of fake weights, the module conversion it needs, generation that runs to its length limit
    with nothing to decode from fake tokens, and chunked losses without their repeated chunks. `cuda_host`: the plan
    is of a CUDA run, whose activation offloading moves fake activations to a host ledger (memory/offloading.py's
    `planned_host`), as the run moves its activations to pinned host memory."""
    mode = WeightlessMode()
    storage_ptr = offloading._storage_ptr
    offloading.planned_host = HostLedger() if cuda_host else None
    # a fake storage has no address (reading one is undefined behaviour): offloading keeps such tensors as it does
    # any subclass without a plain storage
    offloading._storage_ptr = lambda tensor: None if is_fake_tensor(tensor) else storage_ptr(tensor)
    try:
        with (mode, fake_parameters_convertible(), fake_tensors_copyable(), triton_launches_skipped_on_fake(),
              _generation_to_length_limit(mode), repeated_chunks_skipped(SKIP_REPEATED_CHUNKS)):
            yield mode
    finally:
        offloading._storage_ptr = storage_ptr
        offloading.planned_host = None


@contextlib.contextmanager
def _generation_to_length_limit(mode: WeightlessMode):
    original_generate = GenerationMixin.generate
    original_logprobs = transformers_backend.sampled_logprobs

    def generate(self, *args, **kwargs):
        kwargs["eos_token_id"] = None  # no sequence ends early: the worst case for memory
        output = original_generate(self, *args, **kwargs)
        sequences = output.sequences if hasattr(output, "sequences") else output
        prompt = kwargs.get("input_ids", args[0] if args else None)
        filler = filler_token(self.config)
        real = torch.full(tuple(sequences.shape), filler, dtype=torch.long)
        if prompt is not None and not is_fake_tensor(prompt):
            real[:, :prompt.shape[1]] = prompt
        if hasattr(output, "sequences"):
            output.sequences = real
            return output
        return real

    def sampled_logprobs(scores, tokens):
        return torch.zeros(tuple(tokens.shape), dtype=torch.float32)

    GenerationMixin.generate = generate
    transformers_backend.sampled_logprobs = sampled_logprobs
    try:
        yield
    finally:
        GenerationMixin.generate = original_generate
        transformers_backend.sampled_logprobs = original_logprobs


def is_fake_tensor(value) -> bool:
    return isinstance(value, FakeTensor)


def filler_token(config) -> int:
    """A token id that no special token uses, for completions generated by a fake model."""
    special = set()
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])
    token = 100
    while token in special:
        token += 1
    return min(token, getattr(config, "vocab_size", token + 1) - 1)


def model_class_of(trainer_class):
    """The Auto class the fake model is built with (None: a causal LM)."""
    return _sequence_classifier() if method_of(trainer_class).sequence_classifier else None


def _sequence_classifier():
    return _WithOneLabel(AutoModelForSequenceClassification)


class _WithOneLabel:
    """The reward trainer's model: a sequence classifier with one output."""

    def __init__(self, auto):
        self.auto = auto

    def from_config(self, config, **kwargs):
        config = copy.deepcopy(config)
        config.num_labels = 1
        return self.auto.from_config(config, **kwargs)
