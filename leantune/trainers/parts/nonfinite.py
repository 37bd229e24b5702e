"""NaN/inf in a training step: stop with where it happened, or skip the step and count it (`nonfinite_policy`).

transformers trains on: a NaN loss is hidden from the logs by `logging_nan_inf_filter` (the window's average, 0.0 at
its first step), the NaN gradient is applied, and the NaN weights are saved as checkpoints that a resume treats as
complete. Here every optimizer step is checked before the optimizer runs:

- the loss of each micro-batch (a flag kept on the device, no sync per micro-batch) and the gradient norm transformers
  computes before the optimizer step anyway (for clipping, or with max_grad_norm=0 as the logged `grad_norm`; it is
  the norm of the reduced gradients, the same on every process), one flag reduced over the processes so that a NaN on
  one process stops or skips the step on all of them;
- the weights before a checkpoint is written (a NaN can also come from a finite gradient, e.g. the optimizer's
  update overflowing), so that no checkpoint after a non-finite step is ever saved.

"stop" raises NonFiniteStepError naming the optimizer step, the rows of the (prepared) train dataset in the step
(those whose micro-batch had the non-finite loss, else all of the step's rows) and the last checkpoint saved (the
last good one). "skip" drops the step's gradients so the optimizer does not step (weights, moments and their step
counts stay as they were); the learning-rate schedule still advances with the global step, so the schedule stays a
function of the step and of the data read, as in an uninterrupted run, and a resume from any checkpoint (which holds
the optimizer, the scheduler and the step) is exact. Skipped steps are logged with their rows, counted
(`nonfinite_skipped_steps` in every later log and in the final metrics), and the logged `loss` of a logging window
holding a skipped step is NaN (never a normal-looking value).

Row ids: each row of a map-style train dataset carries its index to the collator (a column added when the train
data loader is built, taken out again before the trainer's own collator sees the row). The online trainers' rounds of
prompts do not carry it: their errors say the rows are not tracked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os

import datasets
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from ...utils.faults import TrainingFault

logger = logging.getLogger("leantune.trainer")

NONFINITE_POLICIES = ("stop", "skip")
ROW_INDEX = "leantune_row_index"
"""The column (and batch key) that carries a train row's index in the prepared train dataset."""


class NonFiniteStepError(TrainingFault):
    """A training step had a NaN or infinite loss, gradient or weights (with nonfinite_policy="stop")."""


def validate_nonfinite_policy(policy: str, deepspeed) -> None:
    """The policy is one of NONFINITE_POLICIES, and "skip" runs without DeepSpeed (`deepspeed`: the config's)."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"`nonfinite_policy` must be one of {', '.join(map(repr, NONFINITE_POLICIES))}, got "
                         f"{policy!r}.")
    if policy == "skip" and deepspeed:
        raise ValueError("`nonfinite_policy='skip'` does not work with DeepSpeed (its engine steps the optimizer "
                         "inside the backward pass, before the step can be checked); use `nonfinite_policy='stop'`.")


class RowIndexCollator:
    """Takes each row's index out of the rows, collates them with the trainer's collator, and puts the indices into
    the batch (a dict) as a 1-D tensor under ROW_INDEX."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        ids = []
        for feature in features:
            if isinstance(feature, dict) and ROW_INDEX in feature:
                feature = dict(feature)
                ids.append(int(feature.pop(ROW_INDEX)))
        stripped = [{k: v for k, v in f.items() if k != ROW_INDEX} if isinstance(f, dict) else f for f in features]
        batch = self.collator(stripped)
        if ids and isinstance(batch, dict):
            batch[ROW_INDEX] = torch.tensor(ids, dtype=torch.long)
        return batch


def _with_row_index(dataset):
    """The dataset with a ROW_INDEX column (datasets.Dataset only), or None when it cannot carry one."""
    if not isinstance(dataset, datasets.Dataset) or ROW_INDEX in dataset.column_names:
        return None
    return dataset.add_column(ROW_INDEX, list(range(len(dataset))))


class NonFiniteGuard:
    """The checks of every leantune trainer (see the module's docstring), as a part the trainer holds: its Trainer
    hooks (training_step, _save_checkpoint, get_train_dataloader, train, log) and the `on_pre_optimizer_step` callback
    (GradientCheck, below) call it in one line.
    `checks_steps = False` (the planner's fake step): a step's flags decide nothing and no collective runs."""

    def __init__(self, settings, accelerator, is_main_process, global_step):
        self.settings, self.accelerator = settings, accelerator  # NonFiniteSettings (trainers/settings.py)
        self.is_main_process, self.global_step = is_main_process, global_step  # the trainer's, read when needed
        self.checks_steps = True
        self.loss_bad = None  # the step's micro-batches so far: a non-finite loss on this process (kept on device)
        self.step_rows: list = []  # (row indices, loss flag) of each micro-batch of the step
        self.tracked = False  # whether the train loader carries row indices
        self.training = False  # only training's own loader carries row indices (not a plan's, say)
        self.skipped: list = []  # (optimizer step, rows) of each skipped step
        self.skipped_since_log = 0

    # --- rows: which rows of the train dataset a step read -------------------------------------------------------

    @contextlib.contextmanager
    def training_run(self):
        self.training = True
        try:
            yield
        finally:
            self.training = False

    def train_loader(self, trainer, build):
        """`build()` (Trainer's train loader) over the train dataset with each row's index, the collator taking it
        out again (map-style data, during training); else `build()` as it is."""
        indexed = _with_row_index(trainer.train_dataset) if self.training else None
        self.tracked = indexed is not None
        if indexed is None:
            return build()
        dataset, collator = trainer.train_dataset, trainer.data_collator
        trainer.train_dataset, trainer.data_collator = indexed, RowIndexCollator(collator)
        try:
            return build()
        finally:
            trainer.train_dataset, trainer.data_collator = dataset, collator

    # --- the checks ----------------------------------------------------------------------------------------------

    def training_step(self, step, model, inputs, num_items_in_batch):
        """`step` (Trainer's training_step) on the micro-batch without its row indices; its loss flagged."""
        rows = inputs.pop(ROW_INDEX, None) if isinstance(inputs, dict) else None
        rows = [] if rows is None else rows.tolist()
        loss = step(model, inputs, num_items_in_batch)
        bad = ~torch.isfinite(_plain(loss.detach())).all()
        self.loss_bad = bad if self.loss_bad is None else self.loss_bad | bad
        self.step_rows.append((rows, bad))
        return loss

    def mark(self):
        """A callable that puts the step's flags back as they are now (a discarded attempt)."""
        loss_bad, rows = self.loss_bad, len(self.step_rows)

        def restore() -> None:
            self.loss_bad = loss_bad
            del self.step_rows[rows:]
        return restore

    def check_step(self, model, grad_norm):
        """Before the optimizer step: [processes with a non-finite loss, with a non-finite gradient norm], reduced
        over the processes so that all of them take the same decision. Returns the gradient norm."""
        step_rows, loss_bad = self.step_rows, self.loss_bad
        self.loss_bad, self.step_rows = None, []
        if not self.checks_steps:
            # fake values decide nothing, and a collective of them under the fake process group has no meaning (the
            # check's two-element flag is freed before the optimizer step: no moment of the plan holds it)
            return grad_norm
        device = self.settings.device
        loss_bad = loss_bad if loss_bad is not None else torch.tensor(False)
        norm = torch.as_tensor(_plain(grad_norm) if grad_norm is not None else 0.0, dtype=torch.float32, device=device)
        flags = torch.stack([loss_bad.to(device).float(), (~torch.isfinite(norm)).float()])
        if self.settings.world_size > 1:
            flags = self.accelerator.reduce(flags, reduction="sum")
        losses_bad, gradient_bad = (float(v) for v in flags.cpu())
        if losses_bad == 0 and gradient_bad == 0:
            return grad_norm
        return self._bad_step(model, grad_norm, step_rows, losses_bad)

    def _bad_step(self, model, grad_norm, step_rows: list, losses_bad: float):
        """A step with a non-finite loss or gradient norm on some process: skipped (counted) or stopped, its rows
        named."""
        step = self.global_step() + 1
        what = "loss" if losses_bad else "gradient"
        # a non-finite loss: the rows of the micro-batches that had it (on any process); else all the step's rows
        parts = [rows for rows, bad in step_rows if bool(bad) or not losses_bad]
        rows = self._gathered_rows(sorted({r for part in parts for r in part}))
        where = self._rows_text(rows, what)
        if self.settings.policy == "skip":
            model.zero_grad(set_to_none=True)  # a parameter without a gradient is not touched by the optimizer
            self.skipped.append((step, rows))
            self.skipped_since_log += 1
            if self.is_main_process():
                logger.warning("Optimizer step %d: non-finite %s (grad_norm %s); %s; step skipped (the optimizer did "
                               "not step), %d skipped so far.", step, what, _number(grad_norm), where,
                               len(self.skipped))
            return grad_norm
        raise NonFiniteStepError(
            f"Optimizer step {step}: non-finite {what} (NaN or inf; grad_norm {_number(grad_norm)}); {where}. "
            f"Training stopped before the optimizer step; {self._last_checkpoint_text()}. Look at those rows, lower "
            "the learning rate or turn on gradient clipping (max_grad_norm), or set nonfinite_policy='skip' to skip "
            "and count such steps.")

    def _gathered_rows(self, rows: list[int]) -> list[int]:
        if self.settings.world_size <= 1 or not torch.distributed.is_initialized():
            return rows
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, rows)
        return sorted({r for part in everyone for r in part})

    def _rows_text(self, rows: list[int], what: str) -> str:
        if not self.tracked:
            return "the rows of the step are not tracked for this trainer's data"
        shown = ", ".join(map(str, rows[:32])) + (f", ... ({len(rows)} rows)" if len(rows) > 32 else "")
        whose = "whose micro-batch had it" if what == "loss" else "of the step"
        return f"train dataset rows {whose} (indices of trainer.train_dataset): [{shown}]"

    def _last_checkpoint_text(self) -> str:
        folder = self.settings.output_dir
        last = get_last_checkpoint(folder) if folder and os.path.isdir(folder) else None
        if last is None:
            return "no checkpoint was saved before it"
        return f"the last good checkpoint is {last} (resume with resume_from_checkpoint)"

    def finite_weights_saved(self, save_checkpoint):
        """`save_checkpoint(model, trial)` (Trainer's), run only if the weights are finite: non-finite weights stop
        the run (whatever the policy: nothing to skip)."""

        def save(model, trial):
            step = self.global_step()
            parameters = self.accelerator.unwrap_model(model).parameters()
            # each process checks what it holds (an FSDP2 DTensor's local shard); the flag is reduced below
            finite = all(bool(torch.isfinite(_local(p).detach()).all()) for p in parameters)
            bad = torch.tensor([0.0 if finite else 1.0], device=self.settings.device)
            if self.settings.world_size > 1:
                bad = self.accelerator.reduce(bad, reduction="sum")
            if float(bad.sum()):
                raise NonFiniteStepError(
                    f"After optimizer step {step} the weights hold NaN or inf values; the checkpoint of this step was "
                    f"not saved and training stopped; {self._last_checkpoint_text()}. Lower the learning rate or turn "
                    "on gradient clipping (max_grad_norm).")
            save_checkpoint(model, trial)

        return save

    # --- reporting -----------------------------------------------------------------------------------------------

    def mark_skipped_in_log(self, logs: dict) -> None:
        """A training log of a window with a skipped step: its loss is NaN, and the count so far is given."""
        if "loss" in logs and self.skipped_since_log:
            logs["loss"] = math.nan
            self.skipped_since_log = 0
        if self.skipped and ("loss" in logs or "train_loss" in logs):
            logs["nonfinite_skipped_steps"] = len(self.skipped)

    def summary(self) -> dict:
        if self.settings.policy != "skip":
            return {}
        if self.skipped and self.is_main_process():
            logger.warning("%d optimizer step(s) were skipped for a non-finite loss or gradient: steps %s.",
                           len(self.skipped), [step for step, _ in self.skipped])
        return {"nonfinite_skipped_steps": len(self.skipped)}


class GradientCheck(TrainerCallback):
    """The non-finite check of each optimizer step at transformers' public `on_pre_optimizer_step` event: after the
    gradients are clipped, before the optimizer steps, with the gradient norm transformers computed for them.

    transformers computes that norm through accelerate's public `Accelerator.clip_grad_norm_` (for clipping, or with
    `max_grad_norm=0` for the logged `grad_norm`), so the accelerator's method is wrapped once to keep what it
    returned; where it was not called (a path of transformers' that computes the norm itself) the norm is computed
    here, so a step is never left unchecked."""

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


def _plain(value):
    """A DTensor (FSDP2's gradient norm, a loss under context parallelism) as the plain tensor it stands for: the
    flags built from it are reduced with a plain collective, which a DTensor has no sharding rule for."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value


def _local(value):
    """What this process holds of a tensor (a DTensor's local shard)."""
    return value.to_local() if hasattr(value, "to_local") else value


def _number(value) -> str:
    if value is None:
        return "not computed"
    value = float(value)
    return str(value) if not math.isfinite(value) else f"{value:.4g}"
