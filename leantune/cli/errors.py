"""How a mistake on the command line reaches the user: one line naming the flag, file, row or column, exit code 2.

Library code raises ValueError (and FileNotFoundError, ...) with field names in backticks; the command line turns
those into the flags the user typed. `--debug` (or LEANTUNE_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import os
import re
import sys

from ..utils.imports import MissingExtraError, NeedsGPUError

USAGE_EXIT_CODE = 2
DEBUG_ENV = "LEANTUNE_DEBUG"


class UsageError(ValueError):
    """A mistake in what the user asked for (a flag, a file, a column): reported in one line, exit code 2."""


# Exceptions that mean "the input is wrong" rather than "leantune is wrong". Anything else is a bug: traceback.
# A flag that needs a package which is not installed, or a GPU the machine lacks, is the user's to fix too.
USER_MISTAKES = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
                 UnicodeDecodeError, MissingExtraError, NeedsGPUError)


TRANSFORMERS_DEBUG_VALUES = ("underflow_overflow", "tpu_metrics_debug")


def take_debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """(argv without leantune's bare `--debug`, whether tracebacks were asked for).

    `--debug underflow_overflow` (a value) stays: it is transformers' TrainingArguments field of that name.
    """
    kept, debug = [], os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes")
    for i, arg in enumerate(argv):
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg == "--debug" and (following is None or following.split()[0] not in TRANSFORMERS_DEBUG_VALUES):
            debug = True
            continue
        kept.append(arg)
    return kept, debug


def as_flags(message: str, flags: set[str] | None = None) -> str:
    """`field` -> --field, for the fields the command takes as flags (all backticked names when flags is None)."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if flags is None or name in flags:
            return f"--{name}"
        return match.group(0)

    return re.sub(r"`([A-Za-z_][A-Za-z0-9_]*)`", replace, message)


def one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    if isinstance(error, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)) and \
            getattr(error, "filename", None) and error.strerror:
        text = f"{error.strerror}: {error.filename}"
    return " ".join(text.split())


def report(command: str, error: BaseException, flags: set[str] | None = None) -> int:
    print(f"leantune {command}: error: {as_flags(one_line(error), flags)} (--debug shows the traceback)",
          file=sys.stderr)
    return USAGE_EXIT_CODE
