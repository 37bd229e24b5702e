"""What data preparation changed or dropped, counted so that nothing is lost silently."""

from __future__ import annotations

import contextvars
import logging
from dataclasses import asdict, dataclass
from typing import ClassVar

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
    """The counts every recipe keeps (SFT, preference, KTO, prompt preparation), under one set of names; a recipe's
    report adds its own. Streams sum any report's counts field by field (data/streaming.py)."""

    split: str = "train"
    num_examples_in: int = 0  # rows read: examples, pairs or prompts
    num_empty_dropped: int = 0
    tokens_dropped: int = 0  # tokens truncation removed
    num_examples_out: int = 0  # examples (pairs, prompts) left for training

    UNIT: ClassVar[str] = "example"  # what one row read is, in messages: "of 12 pair(s), dropped ..."
    HEADING: ClassVar[str] = "data"  # the summary line: "train data: {...}"
    # Where a recipe's logged dict names a shared count in its own words ({"num_examples_in": "num_pairs_in"}): those
    # words stay in its log lines and dicts, and read the shared count as read-only attributes.
    OWN_NAMES: ClassVar[dict[str, str]] = {}
    REASONS: ClassVar[dict[str, str]] = {}  # drop counts -> why, for `dropped`

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for shared, own in cls.OWN_NAMES.items():
            setattr(cls, own, property(lambda self, shared=shared: getattr(self, shared)))

    def as_dict(self) -> dict:
        return {self.OWN_NAMES.get(name, name): value for name, value in asdict(self).items()}

    def __getitem__(self, name: str):
        """A count by its logged name (`report["num_prompts_out"]`), as the online trainers' reports are read."""
        return self.as_dict()[name]

    def dropped(self) -> str:
        """What was dropped and why, in one line (for the error when nothing is left)."""
        parts = [f"{getattr(self, name)} {reason}" for name, reason in self.REASONS.items() if getattr(self, name)]
        return f"of {self.num_examples_in} {self.UNIT}(s), dropped " + ("; ".join(parts) or "none")

    def log_summary(self) -> None:
        logger.info("%s %s: %s", self.split, self.HEADING, self.as_dict())


@dataclass
class SFTReport(PreparationReport):
    num_truncated: int = 0
    num_without_targets_dropped: int = 0
    num_rows_out: int = 0  # rows after packing

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
        self.log_summary()
