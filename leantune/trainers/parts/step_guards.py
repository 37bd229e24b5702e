"""The step's failure guards, both caught at the step's boundary around Trainer's `training_step`: a NaN/inf
(`NonFiniteGuard`: stop or skip) and running out of memory (`OutOfMemoryRetry`: the micro-batch in halves). One
job, what goes wrong in a step and what the run does about it; base.py wraps the step in both.

NaN/inf in a training step: stop with where it happened, or skip the step and count it (`nonfinite_policy`).
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

Out of memory in a training step: retried at the step's boundary with half the micro-batch.
A micro-batch that runs out of memory while nothing of its optimizer step has been applied (no gradient of the step
accumulated yet: it is the step's first) is trained again as two halves, each collated from the same examples, so
the step keeps its examples and its global batch and trains as a run configured with half the micro-batch and twice
the accumulation does. From then on every micro-batch of the loader trains in those halves (halved again on a
further error); the config itself is never written. One warning names old -> new and why. Where a retry cannot give
the same step (gradients of the step already accumulated, several processes whose steps would diverge, batches not
collated from the loader's examples), or the micro-batch is one example already, the error is raised again with what
to set.

The online methods' update steps (GRPO, RLOO, Online DPO) are retried alike: a round's micro-batch keeps its
completions' examples, and its halves hold whole prompt groups, with their share of the round's inputs of the loss
(online/round_parts.py); the generation round itself is not repeated. Where a half would split a group, or the method's
loss averages over each micro-batch (GRPO's `bnpo`, its entropy options), the error is raised again with what to set.

On CUDA the allocator raises torch.OutOfMemoryError; on CPU, torch's DefaultCPUAllocator raises a RuntimeError
("can't allocate memory") when the system refuses the allocation (as under RLIMIT_AS).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
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
EXAMPLES = "oom_retry_examples"  # the batch's key holding its uncollated examples (taken out before the step)
CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"
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


# --- out of memory: the micro-batch retried in halves ----------------------------------------------------------
def is_out_of_memory(error: BaseException) -> bool:
    """Whether an error is an allocator's refusal (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (CPU_ALLOCATION_FAILED in text or "CUDA out of memory" in text)


@dataclasses.dataclass
class KeptExamples:
    """A micro-batch's examples as the collator got them; an object the loader's device transfer leaves as it is."""

    examples: list


class ExampleKeepingCollator:
    """The trainer's collator, whose dict batches also carry their examples (under EXAMPLES), so that a micro-batch
    can be collated again in parts."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples):
        batch = self.collator(examples)
        if isinstance(batch, dict):
            batch[EXAMPLES] = KeptExamples(list(examples))
        return batch


class OutOfMemoryRetry:
    """The trainer's part that retries a micro-batch that ran out of memory (see the module's docstring).

    `step_state()` returns a callable that puts the other parts' per-step records (metrics, non-finite flags, the
    router loss) back as they were, so a discarded attempt leaves nothing behind; `attempt_state()` one for what an
    attempt that fails leaves (its metrics and token counts: it flags nothing non-finite and its router loss is
    dropped with the step's), taken before each attempt that may be retried. `rounds` (online/round_parts.py, online
    methods): splits a round's micro-batch into parts of whole prompt groups."""

    def __init__(self, settings, accelerator, is_main_process, step_state, attempt_state, rounds=None):
        self.settings = settings  # BatchSettings (trainers/settings.py)
        self.accelerator, self.is_main_process = accelerator, is_main_process
        self.step_state, self.attempt_state = step_state, attempt_state
        self.rounds = rounds
        self.online = rounds is not None
        self.micro_batch = settings.per_device_train_batch_size  # the micro-batch each loader batch trains in
        self.retries: list[tuple[int, int, str]] = []  # (old, new, why) of each halving
        self.parts = 1  # the parts the loader's batch in training now is trained in (the router loss divides by it)
        self.collate = None  # the collator that made the loader's batches, to collate their parts again
        self.group, self.per_row = settings.group, settings.per_row  # rows; examples per row

    @property
    def accumulation(self) -> int:
        """The gradient accumulation the run now trains with (the loader's batches in parts)."""
        parts = math.ceil(self.settings.per_device_train_batch_size / self.micro_batch)
        return self.settings.gradient_accumulation_steps * parts

    def train_loader(self, trainer, build):
        """`build()` (the train loader) with a collator whose batches keep their examples (the offline trainers';
        the online trainers' micro-batches keep theirs from their rounds). Only where a step can be retried: one
        process (accelerate's dispatcher broadcasts a batch's tensors to the others and refuses any other object)."""
        if self.online or self.settings.world_size > 1:
            return build()
        collator = self.collate = trainer.data_collator
        trainer.data_collator = ExampleKeepingCollator(collator)
        try:
            return build()
        finally:
            trainer.data_collator = collator

    def training_step(self, step, model, inputs, num_items_in_batch):
        """`step` (the trainer's training step) on the micro-batch, in parts of the micro-batch now (`_retried`)."""
        kept = inputs.pop(EXAMPLES, None) if isinstance(inputs, dict) else None
        first_of_step = kept is not None and not any(p.grad is not None for p in model.parameters())
        undo = self.attempt_state() if first_of_step else None
        try:
            if kept is None or self.micro_batch * self.per_row >= len(kept.examples):
                return step(model, inputs, num_items_in_batch)
            return self._in_parts(step, model, inputs, kept.examples, num_items_in_batch)
        except Exception as error:  # noqa: BLE001 -- only the allocator's refusal is retried; others as they are
            cause = self._retry_cause(error, None if kept is None else kept.examples, first_of_step)
        return self._retried(step, model, inputs, kept.examples, num_items_in_batch, undo, cause)

    def _retry_cause(self, error: BaseException, examples, first_of_step: bool) -> str:
        """The allocator's refusal, said in a line, where it can be retried; else `error` raised again (explained
        when it is the allocator's)."""
        if not is_out_of_memory(error):
            raise error
        why_not = self._why_not_retried(examples, first_of_step)
        if why_not is not None:
            raise type(error)(f"{_first_line(error)}\n{why_not}") from error
        return _first_line(error)

    def _retried(self, step, model, inputs, examples, num_items_in_batch, undo, cause: str):
        """An out-of-memory error before any gradient of the optimizer step: out of the failed attempt's except
        block (its frames and tensors released), the attempt undone, the micro-batch trained in smaller parts,
        smaller again on a further error."""
        undo()
        restore = self.step_state()  # the step's records before it (and the failed attempt's router loss dropped)
        while True:
            model.zero_grad(set_to_none=True)  # the failed attempt's partial gradients (the step had none before)
            restore()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._halve(cause)
            try:
                return self._in_parts(step, model, inputs, examples, num_items_in_batch)
            except Exception as error:  # noqa: BLE001 -- only the allocator's refusal is retried; others re-raised
                cause = self._retry_cause(error, examples, True)

    def _in_parts(self, step, model, inputs, examples, num_items_in_batch):
        size = self.micro_batch * self.per_row
        starts = range(0, len(examples), size)
        self.parts = len(starts)
        try:
            losses = [step(model, self._part(inputs, examples, i, min(i + size, len(examples))), num_items_in_batch)
                      for i in starts]
        finally:
            self.parts = 1
        return torch.stack(losses).sum()  # each part's loss is its share of the step's: they add up to the batch's

    def _part(self, inputs, examples, start: int, stop: int) -> dict:
        if self.online:
            return self.rounds.part(inputs, examples, start, stop)
        return self.collate(examples[start:stop])

    def _smaller(self) -> int:
        """The next micro-batch: half, in whole prompt groups (online methods)."""
        if not self.online:
            return math.ceil(self.micro_batch / 2)
        return self.micro_batch // 2 // self.group * self.group

    def _start_so(self) -> str:
        """The settings a run starts with to train as this one now does."""
        start, accumulation = self.settings, self.accumulation
        settings = f"per_device_train_batch_size={self.micro_batch} and gradient_accumulation_steps={accumulation}"
        if self.online and start.steps_per_generation is not None:  # the same generation round
            rounds = start.steps_per_generation * accumulation // start.gradient_accumulation_steps
            settings += f" and steps_per_generation={rounds}"
        return settings

    def _why_not_retried(self, examples, first_of_step: bool) -> str | None:
        """Why this error cannot be retried with a smaller micro-batch (what to set instead), or None."""
        batch, accumulation = self.micro_batch, self.accumulation
        settings = (f"set per_device_train_batch_size={max(batch // 2, 1)} and gradient_accumulation_steps="
                    f"{accumulation * 2} (the same global batch), or let `memory_budget` size the run")
        engine = str(getattr(self.accelerator, "distributed_type", "")).rsplit(".", 1)[-1]
        if engine in ("DEEPSPEED", "FSDP"):
            return (f"Out of memory under {engine}: its gradients and sharded state live in the engine, where a step "
                    f"cannot be undone here; {settings}.")
        if self.settings.world_size > 1:
            return (f"Out of memory on one of {self.settings.world_size} processes: a retry on one process alone would "
                    f"make the processes' steps diverge; {settings} for every process.")
        if examples is None:
            return f"Out of memory in a micro-batch not collated from the loader's examples; {settings}."
        if not first_of_step:
            return (f"Out of memory in a later micro-batch of an optimizer step: the step's gradients so far cannot "
                    f"be undone; {settings}.")
        if self.online:
            problem = self.rounds.problem()
            if problem is not None:
                return f"Out of memory in an online update step, not retried: {problem}; {settings}."
            if self._smaller() < self.group:
                return (f"Out of memory in an online update step whose micro-batch ({batch}) cannot be split into "
                        f"whole prompt groups of {self.group}: lower max_completion_length (`leantune plan "
                        f"--memory_budget SIZE --solve max_completion_length` finds the longest that fits) or the "
                        f"prompts' length.")
            return None
        if min(self.micro_batch, len(examples)) <= 1:
            return ("Out of memory with a micro-batch of one example: nothing left to halve. Lower max_length, turn "
                    "on gradient_checkpointing or activation offloading, or train a smaller model (`leantune plan "
                    "--memory_budget SIZE` shows what fits).")
        return None

    def _halve(self, cause: str) -> None:
        old, old_accumulation = self.micro_batch, self.accumulation
        self.micro_batch = self._smaller()
        self.retries.append((old, self.micro_batch, cause))
        if self.is_main_process():
            groups = f", whole prompt groups of {self.group}" if self.online else ""
            logger.warning(
                "Out of memory in a training step (%s); nothing of the step was applied, so it is retried with "
                "micro-batch %d -> %d and gradient accumulation %d -> %d (the same examples and global batch%s; the "
                "run continues so). To start so, set %s.", cause, old, self.micro_batch, old_accumulation,
                self.accumulation, groups, self._start_so())



def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
