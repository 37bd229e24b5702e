"""The optimizer step inside the backward (`optimizer_in_backward`): each trainable parameter has an optimizer of its
own, stepped by a post-accumulate-grad hook as soon as that parameter's gradient is complete, and its gradient freed
at once, so a step holds one parameter's gradient at a time instead of all of them (torchtune's `optimizer_in_bwd`).

Exact: each parameter gets the same update as from the ordinary optimizer (its own state, its group's options,
Trainer's own optimizer class and arguments: AdamW, bitsandbytes' 8-bit and paged AdamW, ...). It steps on the last
micro-batch of an optimizer step only (`accelerator.sync_gradients`): before that the hook leaves the gradient to
accumulate, as the ordinary step does. Clipping needs the whole gradient's norm before any update, so the config
refuses `max_grad_norm` > 0 (memory_options.py). Trainer's loop still calls `optimizer.step()` (a no-op here: the
work is done), the learning-rate scheduler still steps (the per-parameter optimizers' groups are the ones it sets),
and the `grad_norm` it logs is the norm of the step's gradient, summed in the hooks from each complete gradient
before its update. Checkpoints hold every parameter's optimizer state, in the model's parameter order.

A NaN gradient is applied before the step's norm is seen (step_guards.py then stops the run, naming the last good
checkpoint; "skip" is refused), and an out-of-memory error is not retried in parts (the retry could not undo the
parameters already stepped, and each part's backward would step them again).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch


class PerParameterStates(Mapping):
    """{parameter: its state}, read through from the per-parameter optimizers (MemTracker counts the optimizer's
    states through `optimizer.state` when a step's measure starts, before any of them steps)."""

    def __init__(self, per_parameter: dict):
        self.per_parameter = per_parameter

    def __getitem__(self, parameter):
        return self.per_parameter[parameter].state[parameter]

    def __iter__(self):
        return (p for p, optimizer in self.per_parameter.items() if p in optimizer.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class StepsInBackward(torch.optim.Optimizer):
    """What Trainer holds as its optimizer: the per-parameter optimizers, their groups (the scheduler's), their states
    (checkpoints'). `step()` does nothing: each parameter was stepped in the backward."""

    def __init__(self, per_parameter: dict[torch.nn.Parameter, torch.optim.Optimizer], end_step):
        self.per_parameter = per_parameter
        self.end_step = end_step  # the part's record of the step closed
        first = next(iter(per_parameter.values()))
        super().__init__(list(per_parameter), dict(first.defaults))
        self.param_groups = self.inner_groups()
        self.state = PerParameterStates(per_parameter)  # what a memory tracker finds of the optimizer's states

    def inner_groups(self) -> list[dict]:
        """The per-parameter optimizers' own group dicts, so what a scheduler sets (`lr`) is what they step with."""
        return [group for optimizer in self.per_parameter.values() for group in optimizer.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        self.end_step()
        return closure() if closure is not None else None

    def state_dict(self) -> dict:
        return {"per_parameter": [optimizer.state_dict() for optimizer in self.per_parameter.values()]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("per_parameter")
        if saved is None or len(saved) != len(self.per_parameter):
            found = "an ordinary optimizer's" if saved is None else f"{len(saved)} parameters'"
            raise ValueError(f"The checkpoint holds {found} optimizer state, and this run steps "
                             f"{len(self.per_parameter)} parameters inside the backward (`optimizer_in_backward`): "
                             f"resume with the setting the checkpoint was saved with.")
        for optimizer, state in zip(self.per_parameter.values(), saved):
            optimizer.load_state_dict(state)
        self.param_groups = self.inner_groups()  # load_state_dict made new group dicts

    def __repr__(self) -> str:
        first = next(iter(self.per_parameter.values()))
        return f"StepsInBackward({len(self.per_parameter)} x {type(first).__name__})"


class OptimizerInBackward:
    """The part: installed in place of Trainer's optimizer (`install`), it registers the hooks; `gradient_norm` stands
    in for accelerate's `clip_grad_norm_` (which Trainer calls for the logged norm, with no gradients left)."""

    def __init__(self, settings, accelerator):
        """`settings`: trainers/settings.py's OptimizerInBackwardSettings."""
        self.settings = settings
        self.accelerator = accelerator
        self.optimizer: StepsInBackward | None = None
        self.squared_norm = None  # the step's gradient norm squared, summed in the hooks (on the device, no sync)
        self.stepped: set[int] = set()  # ids of the parameters stepped in this optimizer step
        self.handles = []
        if settings.enabled:
            clip = accelerator.clip_grad_norm_

            def norm_or_clip(parameters, max_norm, *args, **kwargs):
                if self.optimizer is None:
                    return clip(parameters, max_norm, *args, **kwargs)
                return self.step_norm()

            accelerator.clip_grad_norm_ = norm_or_clip

    def install(self, optimizer: torch.optim.Optimizer, optimizer_cls, optimizer_kwargs: dict) -> torch.optim.Optimizer:
        """Trainer's optimizer (built from `optimizer_cls(groups, **optimizer_kwargs)`) as it is, or, when on, one
        optimizer of that class per parameter, each with its group's options, stepped by the hooks."""
        if not self.settings.enabled:
            return optimizer
        if self.accelerator.num_processes > 1:
            raise ValueError(f"`optimizer_in_backward=True` runs on one process (each process would step its "
                             f"parameters before the gradients are reduced); this run has "
                             f"{self.accelerator.num_processes}. Set `optimizer_in_backward=False`.")
        if self.optimizer is not None and getattr(optimizer, "optimizer", optimizer) is self.optimizer:
            return optimizer  # a later train() of the same trainer: installed already
        if type(optimizer) is not optimizer_cls or not issubclass(optimizer_cls, torch.optim.Optimizer):
            raise ValueError(f"`optimizer_in_backward=True` builds one optimizer per parameter from `optim`, and this "
                             f"trainer's optimizer ({type(optimizer).__name__}) was given or built otherwise; pass no "
                             f"`optimizers` to the trainer, or set `optimizer_in_backward=False`.")
        per_parameter = {}
        for group in optimizer.param_groups:
            options = {key: value for key, value in group.items() if key not in ("params", "initial_lr")}
            for parameter in group["params"]:
                one = optimizer_cls([{**options, "params": [parameter]}], **optimizer_kwargs)
                per_parameter[parameter] = with_own_override_index(one)
        for handle in self.handles:
            handle.remove()
        self.handles = [parameter.register_post_accumulate_grad_hook(self.step_parameter)
                        for parameter in per_parameter]
        self.optimizer = StepsInBackward(per_parameter, self.end_step)
        return self.optimizer

    @torch.no_grad()
    def step_parameter(self, parameter: torch.nn.Parameter) -> None:
        """The hook: on the step's last micro-batch, the gradient's norm counted, the parameter stepped by its own
        optimizer, the gradient freed. Earlier micro-batches leave it to accumulate."""
        if not self.accelerator.sync_gradients:
            return
        if id(parameter) in self.stepped:
            raise RuntimeError("`optimizer_in_backward`: a parameter received its gradient twice in one optimizer "
                               "step (reentrant gradient checkpointing, or a second backward on the last micro-batch), "
                               "so it cannot be stepped once with its whole gradient; use non-reentrant checkpointing "
                               "(`gradient_checkpointing_kwargs={'use_reentrant': False}`) or "
                               "`optimizer_in_backward=False`.")
        self.stepped.add(id(parameter))
        square = torch.linalg.vector_norm(parameter.grad, dtype=torch.float32).square()
        self.squared_norm = square if self.squared_norm is None else self.squared_norm + square
        self.optimizer.per_parameter[parameter].step()
        parameter.grad = None

    def step_norm(self) -> torch.Tensor:
        """The norm of the optimizer step's gradient (what Trainer logs as `grad_norm`)."""
        if self.squared_norm is None:
            return torch.tensor(0.0)
        return self.squared_norm.sqrt()

    def end_step(self) -> None:
        self.squared_norm = None
        self.stepped = set()

    def mark(self):
        """For the out-of-memory retry (step_guards.py): a callable that refuses the retry when this part is on."""
        if not self.settings.enabled:
            return lambda: None
        stepped = len(self.stepped)

        def refuse():
            raise torch.OutOfMemoryError(
                f"Out of memory in a training step with `optimizer_in_backward=True` ({stepped} of "
                f"{len(self.optimizer.per_parameter) if self.optimizer else 0} parameters already stepped): the step "
                f"cannot be undone or trained in parts; lower per_device_train_batch_size and raise "
                f"gradient_accumulation_steps (the same global batch), or let `memory_budget` size the run.")

        return refuse


def with_own_override_index(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """bitsandbytes files its per-parameter overrides (Trainer's 32-bit states for embeddings) in one process-wide
    manager, indexed by (group, position) in the optimizer: with one optimizer per parameter every index is (0, 0),
    and one embedding's override would reach every parameter. Each optimizer gets its own index (the overrides
    themselves, by parameter and module, stay shared)."""
    manager = getattr(optimizer, "mng", None)
    if manager is not None and hasattr(manager, "index2config"):
        own = copy.copy(manager)
        own.index2config = {}
        optimizer.mng = own
    return optimizer
