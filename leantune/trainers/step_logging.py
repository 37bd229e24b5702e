"""The training log lines a run prints, each starting with its optimizer step: `step 12/100 | loss 2.31 | ...`.

transformers prints a bare dict of the metrics, which says nothing of where in the run they were taken.
"""

from __future__ import annotations

from transformers.trainer_callback import PrinterCallback, ProgressCallback

HIDDEN = ("total_flos",)


def step_line(logs: dict, state) -> str:
    """`step N/M | name value | ...` (floats to 4 significant digits, as transformers prints them)."""
    total = f"/{state.max_steps}" if state.max_steps and state.max_steps > 0 else ""
    parts = [f"step {state.global_step}{total}"]
    for name, value in logs.items():
        if name in HIDDEN:
            continue
        parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
    return " | ".join(parts)


class StepProgressCallback(ProgressCallback):
    """The progress bar, with each log line written above it as a step line."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs is not None:
            self.training_bar.write(step_line(logs, state))


class StepPrinterCallback(PrinterCallback):
    """Without a progress bar (`disable_tqdm`): the log lines alone, as step lines."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs is not None:
            print(step_line(logs, state))


def use_step_log_lines(callback_handler) -> None:
    """Swap transformers' printing callbacks (exactly those classes; a user's subclass stays) for the step-line ones,
    in place, so that the callbacks' order is kept."""
    swaps = {ProgressCallback: StepProgressCallback, PrinterCallback: StepPrinterCallback}
    for index, callback in enumerate(callback_handler.callbacks):
        replacement = swaps.get(type(callback))
        if replacement is ProgressCallback or replacement is None:
            continue
        new = replacement()
        if hasattr(callback, "max_str_len"):
            new.max_str_len = callback.max_str_len
        callback_handler.callbacks[index] = new
