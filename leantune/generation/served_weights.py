"""A weight update to `leantune vllm-serve`, checked tensor by tensor and applied whole or not at all.

Every tensor of every chunk is checked before it is kept: a name of the model's checkpoint, its exact shape, a
dtype that casts to the model's without loss (the same, or a wider float), and only finite values. Checked tensors
are staged (at most one per name, so the stage is bounded by the model's own size) and go to the engine together at
`POST /update_weights/done`. A refused chunk discards the update: later chunks of it are refused too, and its
`done` applies nothing and ends it, so the next chunk starts a new update.
"""

from __future__ import annotations

import threading

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# float dtype -> the float dtypes it casts to exactly (every value representable)
EXACT_FLOAT_CASTS = {
    torch.float16: {torch.float16, torch.float32, torch.float64},
    torch.bfloat16: {torch.bfloat16, torch.float32, torch.float64},
    torch.float32: {torch.float32, torch.float64},
    torch.float64: {torch.float64},
}


class WeightUpdateError(ValueError):
    """A chunk or a `done` the server refuses; nothing of the update is applied."""


def expected_weights(state_dict: dict[str, torch.Tensor], float_dtype: torch.dtype | None = None) -> dict:
    """name -> (shape, dtype) of a model's checkpoint tensors; floats as `float_dtype` when given (the engine's)."""
    table = {}
    for name, tensor in state_dict.items():
        dtype = float_dtype if float_dtype is not None and tensor.is_floating_point() else tensor.dtype
        table[name] = (tuple(tensor.shape), dtype)
    return table


def checkpoint_weights_on_meta(model_path: str, float_dtype: torch.dtype, trust_remote_code: bool = False) -> dict:
    """The expected table of a checkpoint without loading it: its transformers model built on the meta device."""
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return expected_weights(model.state_dict(), float_dtype)


def table_bytes(expected: dict) -> int:
    """The model's size in bytes as the table has it (the most one whole update can carry)."""
    total = 0
    for shape, dtype in expected.values():
        numel = 1
        for size in shape:
            numel *= size
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def checked_tensor(name: str, tensor: torch.Tensor, expected: dict) -> torch.Tensor:
    """The tensor cast to the model's dtype, or WeightUpdateError naming it and what is wrong."""
    if name not in expected:
        raise WeightUpdateError(f"tensor {name}: not the model's")
    shape, dtype = expected[name]
    if tuple(tensor.shape) != shape:
        raise WeightUpdateError(f"tensor {name}: shape {list(tensor.shape)}, the model's is {list(shape)}")
    exact = dtype in EXACT_FLOAT_CASTS.get(tensor.dtype, set()) if tensor.is_floating_point() else tensor.dtype == dtype
    if not exact:
        raise WeightUpdateError(f"tensor {name}: dtype {str(tensor.dtype).removeprefix('torch.')} does not cast "
                                f"to the model's {str(dtype).removeprefix('torch.')} without loss")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise WeightUpdateError(f"tensor {name}: has NaN or infinite values")
    return tensor.to(dtype)


class StagedUpdate:
    """The checked tensors of the update in progress (thread-safe: chunks may arrive on several HTTP threads)."""

    def __init__(self, expected: dict):
        self.expected = expected
        self._lock = threading.Lock()
        self._tensors: dict[str, torch.Tensor] = {}
        self._refused: str | None = None

    def add(self, tensors: dict[str, torch.Tensor]) -> int:
        """Check a whole chunk, then stage it; a bad tensor refuses the chunk and discards the update."""
        with self._lock:
            if self._refused is not None:
                raise WeightUpdateError(f"this update was already refused ({self._refused}); POST "
                                        "/update_weights/done to end it, then send the update again")
            try:
                checked = {name: checked_tensor(name, tensor, self.expected) for name, tensor in tensors.items()}
            except WeightUpdateError as error:
                self._tensors, self._refused = {}, str(error)
                raise WeightUpdateError(f"{error}; the update is discarded, nothing of it was applied") from None
            self._tensors.update(checked)
            return len(checked)

    def take(self) -> dict[str, torch.Tensor]:
        """End the update: its tensors to apply, or WeightUpdateError if it was refused (nothing to apply)."""
        with self._lock:
            tensors, refused = self._tensors, self._refused
            self._tensors, self._refused = {}, None
        if refused is not None:
            raise WeightUpdateError(f"the update was refused ({refused}); nothing of it was applied")
        return tensors
