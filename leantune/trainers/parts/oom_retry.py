"""An out-of-memory error in a training step, retried at the step's boundary with half the micro-batch.

A micro-batch that runs out of memory while nothing of its optimizer step has been applied (no gradient of the step
accumulated yet: it is the step's first) is trained again as two halves, each collated from the same examples, so
the step keeps its examples and its global batch and trains as a run configured with half the micro-batch and twice
the accumulation does. From then on every micro-batch of the loader trains in those halves (halved again on a
further error); the config itself is never written. One warning names old -> new and why. Where a retry cannot give
the same step (gradients of the step already accumulated, several processes whose steps would diverge, batches not
collated from the loader's examples), or the micro-batch is one example already, the error is raised again with what
to set.

On CUDA the allocator raises torch.OutOfMemoryError; on CPU, torch's DefaultCPUAllocator raises a RuntimeError
("can't allocate memory") when the system refuses the allocation (as under RLIMIT_AS).
"""

from __future__ import annotations

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


class KeptExamples:
    """A micro-batch's examples as the collator got them; an object the loader's device transfer leaves as it is."""

    def __init__(self, examples: list):
        self.examples = examples


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
    router loss) back as they were, so a discarded attempt leaves nothing behind."""

    def __init__(self, args, accelerator, is_main_process, step_state, online: bool):
        self.args, self.accelerator, self.is_main_process = args, accelerator, is_main_process
        self.step_state = step_state
        self.online = online
        self.micro_batch = args.per_device_train_batch_size  # the micro-batch each loader batch trains in
        self.retries: list[tuple[int, int, str]] = []  # (old, new, why) of each halving
        self.parts = 1  # the parts the loader's batch in training now is trained in (the router loss divides by it)
        self.collate = None  # the collator that made the loader's batches, to collate their parts again

    @property
    def accumulation(self) -> int:
        """The gradient accumulation the run now trains with (the loader's batches in parts)."""
        parts = math.ceil(self.args.per_device_train_batch_size / self.micro_batch)
        return self.args.gradient_accumulation_steps * parts

    def train_loader(self, trainer, build):
        """`build()` (the train loader) with a collator whose batches keep their examples (the offline trainers';
        the online trainers' micro-batches come from their rounds). Only where a step can be retried: one process
        (accelerate's dispatcher broadcasts a batch's tensors to the others and refuses any other object)."""
        if self.online or self.args.world_size > 1:
            return build()
        collator = self.collate = trainer.data_collator
        trainer.data_collator = ExampleKeepingCollator(collator)
        try:
            return build()
        finally:
            trainer.data_collator = collator

    def training_step(self, step, model, inputs, num_items_in_batch):
        """`step` (the trainer's training step) on the micro-batch, in parts of the current micro-batch; an
        out-of-memory error before any gradient of the optimizer step retried with half of it."""
        kept = inputs.pop(EXAMPLES, None) if isinstance(inputs, dict) else None
        if kept is None:  # nothing to collate again (online rounds, several processes): an error is only explained
            try:
                return step(model, inputs, num_items_in_batch)
            except Exception as error:  # noqa: BLE001 -- only the allocator's refusal is explained; others as they are
                if not is_out_of_memory(error):
                    raise
                raise type(error)(f"{_first_line(error)}\n{self._why_not_retried(None, False)}") from error
        return self._retried_step(step, model, inputs, kept.examples, num_items_in_batch)

    def _retried_step(self, step, model, inputs, examples, num_items_in_batch):
        first_of_step = not any(p.grad is not None for p in model.parameters())
        restore = self.step_state()
        while True:
            try:
                return self._train(step, model, inputs, examples, num_items_in_batch)
            except Exception as error:  # noqa: BLE001 -- only the allocator's refusal is handled; others re-raised
                if not is_out_of_memory(error):
                    raise
                why_not = self._why_not_retried(examples, first_of_step)
                if why_not is not None:
                    raise type(error)(f"{_first_line(error)}\n{why_not}") from error
                cause = _first_line(error)
            # out of the except block: the failed attempt's frames and tensors are released
            inputs = None
            model.zero_grad(set_to_none=True)  # the failed attempt's partial gradients (the step had none before)
            restore()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._halve(cause)

    def _train(self, step, model, inputs, examples, num_items_in_batch):
        if examples is None or (inputs is not None and self.micro_batch >= len(examples)):
            return step(model, inputs, num_items_in_batch)
        starts = range(0, len(examples), self.micro_batch)
        self.parts = len(starts)
        try:
            losses = [step(model, self.collate(examples[i:i + self.micro_batch]), num_items_in_batch) for i in starts]
        finally:
            self.parts = 1
        return torch.stack(losses).sum()  # each part's loss is its share of the step's: they add up to the batch's

    def _why_not_retried(self, examples, first_of_step: bool) -> str | None:
        """Why this error cannot be retried with a smaller micro-batch (what to set instead), or None."""
        batch, accumulation = self.micro_batch, self.accumulation
        settings = (f"set per_device_train_batch_size={max(batch // 2, 1)} and gradient_accumulation_steps="
                    f"{accumulation * 2} (the same global batch), or let `memory_budget` size the run")
        if self.online:
            from ...planning.recommend import micro_batch_group

            group = micro_batch_group(self.args)
            if batch // 2 < group or (batch // 2) % group:
                return (f"Out of memory in an online update step whose micro-batch ({batch}) cannot halve into whole "
                        f"prompt groups of {group}: lower max_completion_length (`leantune plan --memory_budget SIZE "
                        f"--solve max_completion_length` finds the longest that fits) or the prompts' length.")
            return (f"Out of memory in an online update step: its micro-batches come from the generation round and "
                    f"are not retried; {settings} (whole prompt groups of {group}).")
        engine = str(getattr(self.accelerator, "distributed_type", "")).rsplit(".", 1)[-1]
        if engine in ("DEEPSPEED", "FSDP"):
            return (f"Out of memory under {engine}: its gradients and sharded state live in the engine, where a step "
                    f"cannot be undone here; {settings}.")
        if self.args.world_size > 1:
            return (f"Out of memory on one of {self.args.world_size} processes: a retry on one process alone would "
                    f"make the processes' steps diverge; {settings} for every process.")
        if examples is None:
            return f"Out of memory in a micro-batch not collated from the loader's examples; {settings}."
        if not first_of_step:
            return (f"Out of memory in a later micro-batch of an optimizer step: the step's gradients so far cannot "
                    f"be undone; {settings}.")
        if min(self.micro_batch, len(examples)) <= 1:
            return ("Out of memory with a micro-batch of one example: nothing left to halve. Lower max_length, turn "
                    "on gradient_checkpointing or activation offloading, or train a smaller model (`leantune plan "
                    "--memory_budget SIZE` shows what fits).")
        return None

    def _halve(self, cause: str) -> None:
        old, old_accumulation = self.micro_batch, self.accumulation
        self.micro_batch = math.ceil(old / 2)
        self.retries.append((old, self.micro_batch, cause))
        if self.is_main_process():
            logger.warning(
                "Out of memory in a training step (%s); nothing of the step was applied, so it is retried with "
                "micro-batch %d -> %d and gradient accumulation %d -> %d (the same examples and global batch; the "
                "run continues so). To start so, set per_device_train_batch_size=%d and "
                "gradient_accumulation_steps=%d.", cause, old, self.micro_batch, old_accumulation, self.accumulation,
                self.micro_batch, self.accumulation)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
