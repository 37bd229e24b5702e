"""The loss of an optimizer step: the mean over the real items (target tokens, pairs, examples) of that whole step.

Every micro-batch of gradient accumulation and, with `average_tokens_across_devices`, every process counts towards
the step's divisor, so micro-batch size, accumulation, padding and packing do not change the loss. A Mixture-of-Experts
model whose config asks for router logits gets its load-balancing loss added here (TRL's rule), once per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...models.output_head import unwrap_model


class StepLoss:
    """Counts the step's items and divides each micro-batch's summed loss by them. `items_in(batch)` is the method's
    count of one collated batch; `record` keeps a per-example metric (the logged `aux_loss`); `accumulation()`: the
    micro-batches the optimizer step's loss is spread over now."""

    def __init__(self, settings, accelerator, context_parallel, model, items_in: Callable[[dict], torch.Tensor],
                 record: Callable[..., None], accumulation: Callable[[], int] = lambda: 1):
        self.settings = settings  # StepLossSettings (trainers/settings.py)
        self.accelerator = accelerator
        self.context_parallel = context_parallel
        self.items_in = items_in
        self.record = record
        self.accumulation = accumulation
        # TRL's attributes (kept on the trainer too): whether the router loss is added, and its weight
        self.router_loss_enabled, self.router_loss_coef = router_loss_settings(model, settings.router_aux_loss_coef)
        self._router_loss = None

    def count(self, batch_samples: list, device) -> torch.Tensor:
        """The step's item count: its micro-batches', summed over the processes when they average together."""
        count = sum((self.items_in(b) for b in batch_samples if "labels" in b or "target_index" in b), torch.tensor(0))
        count = torch.as_tensor(count).to(device)
        if self.settings.average_tokens_across_devices and self.settings.world_size > 1:
            count = self.accelerator.gather(count).sum()
            # every process of a context-parallel group counted the same whole batch (before it is split)
            count = count // self.context_parallel.size
        return count

    def drop_router_loss(self) -> None:
        """A discarded attempt's router loss, noted by its forward and not added by its loss: none is pending
        between micro-batches (each loss adds the one its forward noted)."""
        self._router_loss = None

    def note_router_loss(self, model, outputs) -> None:
        """Keep the router loss of a forward pass of the trained policy (not the reference, not a no-grad pass)."""
        aux = getattr(outputs, "aux_loss", None)
        if self.router_loss_enabled and aux is not None and aux.requires_grad:
            self._router_loss = aux if self._router_loss is None else self._router_loss + aux

    def normalise(self, model, loss_sum: torch.Tensor, local_count, num_items_in_batch,
                  whole_sequences: bool = False) -> torch.Tensor:
        """Divide a summed loss by the optimizer step's item count (the batch's own count outside training), and add
        the router loss of this micro-batch's policy forwards (every trainer's loss ends here). Under context
        parallelism: `_normalised_in_ring` (`whole_sequences`: a loss over sequence sums made whole across the
        context-parallel group)."""
        if self.context_parallel.size > 1:
            loss = self._normalised_in_ring(model, loss_sum, local_count, num_items_in_batch, whole_sequences)
        elif num_items_in_batch is None or not model.training:
            loss = loss_sum / torch.as_tensor(local_count, device=loss_sum.device).clamp(min=1)
        else:
            loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
            if self.settings.average_tokens_across_devices and self.settings.world_size > 1:
                loss = loss * self.settings.world_size  # DDP averages gradients over processes
        if self._router_loss is None:  # no MoE router loss noted (always so for a dense model)
            return loss
        return self._plus_router_loss(model, loss)

    def _normalised_in_ring(self, model, loss_sum: torch.Tensor, local_count, num_items_in_batch,
                            whole_sequences: bool) -> torch.Tensor:
        """`normalise` under context parallelism, where this process holds part of the batch.

        `whole_sequences`: a loss formed from per-sequence sums made whole over the context-parallel group
        (ContextParallelism.total), so the same value on each of its processes, and `local_count` the whole batch's.
        The sums' all-reduce sums the gradients of those cp_size copies in its backward, so in training each copy is
        divided by cp_size (where the gradient all-reduce then averages over every process, data x context, as for
        any loss); in evaluation the processes' equal losses average to it."""
        cp = self.context_parallel.size
        evaluating = num_items_in_batch is None or not model.training
        if whole_sequences:
            if evaluating:
                return loss_sum / torch.as_tensor(local_count, device=loss_sum.device).clamp(min=1)
            loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
            if self.settings.average_tokens_across_devices:  # the count is the step's over every data-parallel group
                loss = loss * self.settings.world_size / cp
            return loss
        if evaluating:
            # this process holds part of the batch: its share of the batch's mean, so that the mean over the
            # context-parallel group (evaluation averages the processes' losses) is the batch's mean
            whole = torch.as_tensor(self.context_parallel.batch_targets, device=loss_sum.device).clamp(min=1)
            return loss_sum * cp / whole
        loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
        if self.settings.average_tokens_across_devices and self.settings.world_size > 1:
            loss = loss * self.settings.world_size  # DDP averages gradients over processes
        return loss

    def _plus_router_loss(self, model, loss: torch.Tensor) -> torch.Tensor:
        """router_aux_loss_coef x the noted router loss (divided by the accumulation steps in training, where each
        micro-batch's loss is its share of the step), logged as aux_loss."""
        aux, self._router_loss = self._router_loss, None
        steps = self.accumulation() if model.training else 1
        self.record(model, aux_loss=aux.detach().float().reshape(1))
        return loss + self.router_loss_coef * aux.to(loss.dtype) / steps


def router_loss_settings(model, coef: float | None) -> tuple[bool, float]:
    """(whether the MoE router loss is added, its weight): on when the model's config has output_router_logits=True
    (TRL's rule); the weight is `router_aux_loss_coef`, else the config's own."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        return False, 0.0
    enabled = bool(getattr(config, "output_router_logits", False))
    if coef is None:
        coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    return enabled, float(coef)
