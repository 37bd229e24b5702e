"""A weight update to `leantune vllm-serve` as a transaction: begun, filled chunk by chunk, then applied whole or not
at all.

`begin` opens an update under the client's id (replacing one left open). Every tensor of every chunk tagged with
that id is checked before it is kept: a name of the model's checkpoint not yet sent in this update, its exact shape,
a dtype that casts to the model's without loss (the same, or a wider float), and only finite values. `commit`
declares the names sent and their count: the update goes to the engine only if exactly those arrived and every layer
it touches is whole (vLLM reprocesses a layer only once all its tensors arrive, so a part of one would be dropped or
half-applied). Anything else discards it: a refused tensor, a bad body, a body over the limit or cut short, an error
while staging (the server calls `abort` for those), a client's `abort`, a new `begin`, or no chunk for
`expiry_seconds` (a dead client's stage never lingers, nor merges into the next update). The stage holds at most one
tensor per name, so it is bounded by the model's own size.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

logger = logging.getLogger("leantune.generation")

# float dtype -> the float dtypes it casts to exactly (every value representable)
EXACT_FLOAT_CASTS = {
    torch.float16: {torch.float16, torch.float32, torch.float64},
    torch.bfloat16: {torch.bfloat16, torch.float32, torch.float64},
    torch.float32: {torch.float32, torch.float64},
    torch.float64: {torch.float64},
}


class WeightUpdateError(ValueError):
    """A chunk or a commit the server refuses (HTTP 400); the update is discarded, nothing of it applied."""


class UnknownUpdateError(ValueError):
    """A chunk, commit or abort for an update that is not the one in progress (HTTP 409): never begun, already
    ended, discarded, replaced by a newer `begin`, or expired."""


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


def layer_of(name: str) -> str:
    """The part of the model an engine reloads at once: a decoder block (`...layers.<i>`), else the tensor's module."""
    block = re.match(r"^(.*?\.layers\.\d+)\.", name)
    return block.group(1) if block else name.rpartition(".")[0]


class WeightUpdates:
    """The update in progress, if any (thread-safe: chunks are checked on worker threads)."""

    def __init__(self, expected: dict, expiry_seconds: float, clock=time.monotonic):
        self.expected = expected
        self.expiry_seconds = expiry_seconds
        self.clock = clock
        self.layers: dict[str, set[str]] = {}
        for name in expected:
            self.layers.setdefault(layer_of(name), set()).add(name)
        self._lock = threading.Lock()
        self._id: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._last_activity = 0.0

    def begin(self, update_id: str) -> None:
        with self._lock:
            if self._id is not None:
                logger.warning("vllm-serve: weight update %s discarded: update %s began", self._id, update_id)
            self._id, self._tensors, self._last_activity = update_id, {}, self.clock()

    def add(self, update_id: str, tensors: dict[str, torch.Tensor]) -> int:
        """Check a whole chunk (outside the lock: an abort need not wait for it), then stage it; anything wrong
        discards the update."""
        with self._lock:
            self._require(update_id)
        try:
            checked = {name: checked_tensor(name, tensor, self.expected) for name, tensor in tensors.items()}
        except WeightUpdateError as error:
            self.abort(update_id, reason=str(error))
            raise WeightUpdateError(f"{error}; the update is discarded, nothing of it was applied") from None
        except Exception as error:  # a fault while checking (an answer 500) ends the update too
            self.abort(update_id, reason=f"{type(error).__name__} while staging")
            raise
        with self._lock:
            self._require(update_id)  # aborted, replaced or expired meanwhile: nothing is staged
            twice = sorted(set(checked) & set(self._tensors))
            if twice:
                self._discard()
                raise WeightUpdateError(f"tensor {twice[0]}: sent twice in one update; the update is discarded, "
                                        "nothing of it was applied")
            self._tensors.update(checked)
            self._last_activity = self.clock()
            return len(checked)

    def commit(self, update_id: str, names: list[str], count: int) -> dict[str, torch.Tensor]:
        """End the update: its tensors to apply if exactly the declared ones arrived and every touched layer is
        whole; else WeightUpdateError (nothing applied). Either way the update is over."""
        with self._lock:
            self._require(update_id)
            tensors = self._tensors
            self._discard()
        problem = self._declaration_problem(tensors, names, count)
        if problem:
            raise WeightUpdateError(f"{problem}; the update is discarded, nothing of it was applied")
        return tensors

    def abort(self, update_id: str | None = None, reason: str = "aborted") -> bool:
        """Discard the update (only `update_id`'s, when given); whether there was one."""
        with self._lock:
            if self._id is None or (update_id is not None and update_id != self._id):
                return False
            logger.warning("vllm-serve: weight update %s discarded: %s", self._id, reason)
            self._discard()
            return True

    def expire(self) -> bool:
        """Discard an update that had no chunk for `expiry_seconds` (its client died or hung)."""
        with self._lock:
            stale = self._id is not None and self.clock() - self._last_activity > self.expiry_seconds
        return stale and self.abort(reason=f"no chunk for {self.expiry_seconds:g} s (the client died?)")

    @property
    def in_progress(self) -> str | None:
        return self._id

    def _require(self, update_id: str) -> None:
        if update_id != self._id:
            raise UnknownUpdateError(f"weight update {update_id!r} is not in progress (never begun, ended, "
                                     "discarded, replaced or expired); begin a new one")

    def _discard(self) -> None:
        self._id, self._tensors = None, {}

    def _declaration_problem(self, tensors: dict, names, count) -> str | None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            return "commit: 'names' must be a list of distinct tensor names"
        if isinstance(count, bool) or not isinstance(count, int) or count != len(names):
            return f"commit: 'count' must be the number of names ({len(names)}), got {count!r}"
        missing, unexpected = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        if missing or unexpected:
            return (f"declared tensors that never arrived: {_few(missing)}; arrived but not declared: "
                    f"{_few(unexpected)}")
        for layer in sorted({layer_of(name) for name in tensors}):
            partial = sorted(self.layers[layer] - set(tensors))
            if partial:
                return (f"layer {layer} is incomplete (missing {_few(partial)}): an engine reloads a layer only "
                        "with all its tensors")
        return None


def _few(names: list[str], shown: int = 5) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
