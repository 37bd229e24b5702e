"""The errors of a run that failed while training (not a mistake in what was asked): the command line reports them in
one line with exit code 1 (a usage mistake is exit code 2), the library raises them to the caller. No torch import."""

from __future__ import annotations


class TrainingFault(RuntimeError):
    """Training stopped on a fault of the run itself: NaN/inf in a step, a process that stopped answering."""
