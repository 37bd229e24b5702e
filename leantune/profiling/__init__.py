"""Sequence-length profiling: what max_length, padding and packing would cost on a dataset (`leantune profile`).

`profile_dataset` returns a `LengthProfile`; `write_length_figure` (matplotlib, imported only when called)
draws it; `length_summary_line` is the one line the trainers log.
"""

from ..data.lengths import length_summary_line
from .figure import write_length_figure
from .profiler import profile_dataset
from .report import LengthProfile

__all__ = ["LengthProfile", "length_summary_line", "profile_dataset", "write_length_figure"]
