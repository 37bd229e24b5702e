"""Checkpoint folders that appear whole or not at all, and a full disk said in one line.

A checkpoint is written into `tmp-checkpoint-N/checkpoint-N`, every file and folder fsynced, then renamed to
`checkpoint-N` (one rename on one file system): a process killed at any point leaves the last complete checkpoint
and at most a staging folder, which resuming ignores and the next save of that step replaces.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil

logger = logging.getLogger("leantune.trainer")

STAGING_PREFIX = "tmp-checkpoint"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STAGING = re.compile(rf"^{STAGING_PREFIX}-(\d+)$")  # a save not yet renamed
# A write that fails for want of room: ENOSPC (disk full), EDQUOT (quota), EFBIG (a file-size limit).
NO_ROOM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
NO_ROOM_WORDS = ("no space left", "disk quota", "file too large", "file write failed", "unexpected pos",
                 "iostream error")
# A failed write that left less than this free where it wrote is taken as a full disk, whatever its message said.
NEARLY_FULL = 1024 * 1024


class NoRoomError(OSError):
    """A checkpoint or model could not be written for want of disk space; the message says where, how much and what
    to do. The last complete checkpoint is left as it was."""


def complete_checkpoints(output_dir: str) -> list[str]:
    """Checkpoint folders of output_dir whose trainer state was written (a killed save leaves none), oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path) and readable_state(path):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def any_checkpoints(output_dir: str) -> list[str]:
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir) if CHECKPOINT.match(n))


def incomplete_checkpoints(output_dir: str) -> list[str]:
    """Entries that look like checkpoints but are not complete ones: staging folders of a save cut short
    (tmp-checkpoint-N), checkpoint-N without a readable trainer_state.json, a file named checkpoint-N."""
    if not os.path.isdir(output_dir):
        return []
    complete = {os.path.basename(path) for path in complete_checkpoints(output_dir)}
    return sorted(n for n in os.listdir(output_dir)
                  if (CHECKPOINT.match(n) and n not in complete) or STAGING.match(n))


def readable_state(path: str) -> bool:
    try:
        with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as handle:
            json.load(handle)
        return True
    except (OSError, ValueError):
        return False


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint of output_dir (None: none), the incomplete entries it passed over named."""
    ignored = incomplete_checkpoints(output_dir)
    if ignored:
        logger.warning("Resuming: ignored %s in %s (incomplete: a save cut short, or no readable trainer_state.json).",
                       ", ".join(ignored), output_dir)
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def staging_folder(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"{STAGING_PREFIX}-{step}")


def remove_tree(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


def fsync_tree(folder: str) -> None:
    """Every file under `folder`, then every folder bottom-up, to disk: the rename that follows publishes data
    that is already durable."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            descriptor = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        fsync_dir(root)


def fsync_dir(folder: str) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(staged: str, final: str) -> None:
    """Rename the fsynced `staged` folder to `final` (an old `final` of the same step, from a run that went past
    this step before a resume from an earlier one, is moved aside first and removed after)."""
    fsync_tree(staged)
    old = None
    if os.path.lexists(final):
        old = f"{final}.replaced"
        remove_tree(old)
        os.replace(final, old)
    os.replace(staged, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    if old is not None:
        remove_tree(old)


def is_no_room(error: BaseException, folder: str | None = None) -> bool:
    """Whether `error` (or what caused it) is a write that failed for want of space. torch.save and safetensors
    report ENOSPC as RuntimeError / their own error with various texts (measured on a full tmpfs: "unexpected pos
    ... vs ...", "basic_ios::clear: iostream error"), so a failed write that left `folder`'s disk nearly full counts
    too."""
    if folder is not None and isinstance(error, (OSError, RuntimeError)) and os.path.isdir(folder):
        if shutil.disk_usage(folder).free < NEARLY_FULL:
            return True
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_ROOM_ERRNOS:
            return True
        if any(word in str(error).lower() for word in NO_ROOM_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def folder_bytes(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def no_room_error(folder: str, needed: int, what: str = "the checkpoint") -> NoRoomError:
    free = shutil.disk_usage(folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))).free
    return NoRoomError(
        f"no room to write {what} in {folder}: it needs about {_mib(needed)} and {_mib(free)} is free; free space "
        f"there, choose another --output_dir, or keep fewer checkpoints with --save_total_limit (the last complete "
        f"checkpoint is intact).")


def _mib(count: int) -> str:
    return f"{count / (1024 * 1024):.1f} MiB"
