"""The non-finite check of each optimizer step (nonfinite.py) at transformers' public `on_pre_optimizer_step` event:
after the gradients are clipped, before the optimizer steps, with the gradient norm transformers computed for them.

transformers computes that norm through accelerate's public `Accelerator.clip_grad_norm_` (for clipping, or with
`max_grad_norm=0` for the logged `grad_norm`), so the accelerator's method is wrapped once to keep what it returned;
where it was not called (a path of transformers' that computes the norm itself) the norm is computed here, so a step
is never left unchecked.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback


class GradientCheck(TrainerCallback):
    def __init__(self, accelerator, check_step):
        self.check_step = check_step  # NonFiniteGuard.check_step(model, grad_norm)
        self.norm = None
        clip = accelerator.clip_grad_norm_

        def clip_and_keep(*args, **kwargs):
            self.norm = clip(*args, **kwargs)
            return self.norm

        accelerator.clip_grad_norm_ = clip_and_keep

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        norm, self.norm = self.norm, None
        self.check_step(model, norm if norm is not None else gradient_norm(model))


def gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(gradients) if gradients else torch.tensor(0.0)
