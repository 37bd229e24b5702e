"""The ops a training step launches around its loss, counted on CPU (the proxy for a GPU's kernel launches).

Counted as torch dispatches them (below autograd, so the backward's ops too, and a composite op as the ops it runs),
views and metadata-only ops left out (they launch no kernel). The region is everything of one `training_step` but
the model's body (its decoder: forward, and backward with checkpointing's recomputation): the head and the loss,
their backward, the metrics, the step loss's normalisation and the Trainer's own few ops. The body is paused by
hooks: its forward between a pre-hook and a hook, its backward from the moment its output's gradient is complete
(every op of the loss region's backward runs before: the body's backward needs that gradient).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate or describe tensors and launch no kernel
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "set_", "resize_",
             "_local_scalar_dense", "is_nonzero", "lift_fresh", "_to_copy_noop", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}


class LossRegionOps(TorchDispatchMode):
    """Counts the ops dispatched while not paused; `by_name`: how many of each."""

    def __init__(self):
        super().__init__()
        self.paused = 0
        self.by_name = collections.Counter()
        self.syncs = 0  # `.item()` / `bool()` / `int()` of a tensor: a host sync on a GPU

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        if not self.paused:
            if name in ("_local_scalar_dense", "is_nonzero"):
                self.syncs += 1
            elif not func.is_view and name not in NO_KERNEL:
                self.by_name[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return sum(self.by_name.values())


def body_of(model):
    """The model's decoder (everything before the output head)."""
    from leantune.models.output_head import unwrap_model

    base = unwrap_model(model)
    return base.get_decoder() if hasattr(base, "get_decoder") else base.model


@contextlib.contextmanager
def body_paused(counter: LossRegionOps, *models):
    """Within it, `counter` skips the bodies of `models` (forward, and backward from their output's gradient on)."""
    handles = []

    def before(module, args, kwargs):
        counter.paused += 1

    def after(module, args, kwargs, output):
        counter.paused -= 1
        hidden = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", output)
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: setattr(counter, "paused", counter.paused + 1))

    for model in models:
        if model is not None:
            body = body_of(model)
            handles.append(body.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(body.register_forward_hook(after, with_kwargs=True))
    try:
        yield counter
    finally:
        for handle in handles:
            handle.remove()


def loss_region_ops(trainer, batch) -> LossRegionOps:
    """The ops of one `training_step` on `batch` outside the policy's and the reference's bodies (gradients are
    zeroed after: no optimizer step)."""
    model = trainer.model
    reference = getattr(getattr(trainer, "reference", None), "model", None)
    trainer.model.train()
    counter = LossRegionOps()
    items = torch.tensor(int((batch["labels"] != -100).sum())) if "labels" in batch else None
    with body_paused(counter, model, reference), counter:
        trainer.training_step(model, batch, items)
    model.zero_grad(set_to_none=True)
    return counter
