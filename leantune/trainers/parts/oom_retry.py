"""An out-of-memory error in a training step, retried at the step's boundary with half the micro-batch.

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

import dataclasses
import gc
import logging
import math

import torch

logger = logging.getLogger("leantune.trainer")

EXAMPLES = "oom_retry_examples"  # the batch's key holding its uncollated examples (taken out before the step)
CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"


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
