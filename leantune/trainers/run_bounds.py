"""Where a resumed `train()` call starts and ends, through transformers' public callback events (no private state
read; a run that resumes nothing starts at step 0 and has no such callback):

- the global step at its start (`on_train_begin`, after a resumed checkpoint's state is loaded): a run resumed from a
  checkpoint already at `max_steps` trains nothing, which the run's end reports;
- such a run trains no step: transformers checks `max_steps` only after a step, so the trainer's `get_batch_samples`
  hands it no micro-batch while training (`start_step` set), and the end of that empty epoch saves, evaluates and
  logs nothing (the control restored from the checkpoint may still ask for its save);
- the trainer's own state in the resumed checkpoint (`load_extra_state`), read once transformers has loaded the
  model, optimizer and scheduler.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from ..data.streaming import log_stream_report

logger = logging.getLogger("leantune.trainer")


class RunBounds(TrainerCallback):
    def __init__(self, load_extra_state, checkpoint):
        self.load_extra_state = load_extra_state
        self.checkpoint = checkpoint  # the checkpoint this train() call resumes from
        self.start_step = None  # the global step when training began; None outside training
        self.trained_nothing = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step
        self.load_extra_state(str(self.checkpoint))

    def on_epoch_end(self, args, state, control, **kwargs):
        # a run found done at its start trained nothing: nothing to save, evaluate or log either
        if self.start_step == state.global_step >= state.max_steps:
            control.should_save = control.should_evaluate = control.should_log = False

    def on_train_end(self, args, state, control, **kwargs):
        # whether this train() resumed a checkpoint already at max_steps (or its epochs' end) and trained no step
        self.trained_nothing = state.global_step == self.start_step and state.global_step >= state.max_steps
        self.start_step = None


def report_run_end(trainer, output):
    """After the run: nothing trained by a resumed finished run, the stream's drops, the summary, the memory."""
    trainer.trained_nothing = trainer.run_bounds is not None and trainer.run_bounds.trained_nothing
    main = trainer.is_world_process_zero()
    if trainer.trained_nothing and main:
        logger.warning("Nothing to train: the checkpoint is at step %d of max_steps %d (the run is done); raise "
                       "max_steps (or num_train_epochs) to train further.", trainer.state.global_step,
                       trainer.state.max_steps)
    train_report = trainer.stream_reports.get(id(trainer.train_dataset))
    if train_report is not None and main:
        log_stream_report(train_report)
    summary = trainer.training_summary()
    output.metrics.update(summary)
    trainer.log_metrics("train", summary)
    if trainer.memory_breakdown is not None and main:
        logger.info(trainer.memory_breakdown.line())
    return output
