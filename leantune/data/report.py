"""What data preparation changed or dropped, counted so that nothing is lost silently."""

from __future__ import annotations

import contextvars
import logging
from dataclasses import asdict, dataclass

logger = logging.getLogger("leantune.data")


# True while data/streaming.py prepares one buffer of a stream (the recipes' few buffer-only rules read it).
STREAM_BUFFER = contextvars.ContextVar("leantune_stream_buffer", default=False)


def in_stream_buffer() -> bool:
    return STREAM_BUFFER.get()


class NothingLeft(ValueError):
    """Preparation left no example. An error for a dataset; for one buffer of a stream (data/streaming.py) it only
    means that buffer yields no row, and `report` holds its counts."""

    def __init__(self, message: str, report):
        super().__init__(message)
        self.report = report


def report_blank_lines(path: str, line_numbers: list[int]) -> int:
    """Blank lines of a JSON-lines file hold no example and are skipped: counted and logged, never silently."""
    if line_numbers:
        shown = ", ".join(map(str, line_numbers[:10])) + (", ..." if len(line_numbers) > 10 else "")
        logger.warning("%s: skipped %d blank line(s) (line %s); each other line is one example.", path,
                       len(line_numbers), shown)
    return len(line_numbers)


@dataclass
class PreparationReport:
    split: str = "train"
    num_examples_in: int = 0
    num_empty_dropped: int = 0
    num_truncated: int = 0
    tokens_dropped: int = 0
    num_without_targets_dropped: int = 0
    num_examples_out: int = 0
    num_rows_out: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def log(self) -> None:
        if self.num_empty_dropped:
            logger.warning("%s: dropped %d empty example(s) of %d.", self.split, self.num_empty_dropped, self.num_examples_in)
        if self.num_truncated:
            logger.warning(
                "%s: truncated %d example(s) to max_length, dropping %d token(s).",
                self.split, self.num_truncated, self.tokens_dropped,
            )
        if self.num_without_targets_dropped:
            logger.warning(
                "%s: dropped %d example(s) left with no loss tokens (e.g. the prompt fills max_length).",
                self.split, self.num_without_targets_dropped,
            )
        logger.info("%s data: %s", self.split, self.as_dict())
