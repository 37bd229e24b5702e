"""Cheap checks before anything is loaded: the output folder, the checkpoint to resume from, the model's source.

A mistake found here costs the user a second, not a model load and a tokenisation pass.
"""

from __future__ import annotations

import logging
import os
import shutil

from huggingface_hub import model_info, try_to_load_from_cache

from ..trainers.parts.checkpoint_files import (
    any_checkpoints,
    complete_checkpoints,
    incomplete_checkpoints,
    latest_complete_checkpoint,
    readable_state,
)
from .errors import UsageError

logger = logging.getLogger("leantune.cli")

TRUE_WORDS = ("true", "yes", "1", "latest")
FALSE_WORDS = ("false", "no", "0", "none", "")


def check_output_dir(output_dir: str | None) -> None:
    if not output_dir:
        raise UsageError("--output_dir is required: the folder the model and checkpoints are written to.")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"--output_dir {output_dir}: is a file, not a folder; choose another --output_dir.")
    parent = os.path.dirname(os.path.abspath(output_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UsageError(f"--output_dir {output_dir}: cannot be created under {parent} (not a writable folder).")


def resolve_resume(value, output_dir: str, overwrite: bool) -> str | None:
    """The checkpoint folder to resume from (None: a fresh run), or an error before anything runs.

    `--resume_from_checkpoint PATH` resumes from PATH; `true` from the latest complete checkpoint in --output_dir.
    A fresh run refuses an --output_dir that holds an earlier run's checkpoints unless --overwrite_output_dir,
    which deletes them once the new run has loaded (clear_checkpoints): checkpoints of two runs in one folder would
    be mixed up by resuming and rotation.
    """
    if value is not None and not isinstance(value, bool):
        value = str(value).strip()
        if value.lower() in TRUE_WORDS:
            value = True
        elif value.lower() in FALSE_WORDS:
            value = None
    if value is True:
        latest = latest_complete_checkpoint(output_dir)
        if latest is None and os.environ.get("RANK", "0") != "0":
            return None  # process 0 chooses; the trainer makes every process resume from its choice or stop
        if latest is None and os.environ.get("TORCHELASTIC_RESTART_COUNT") is not None:
            # under torchrun (--max-restarts): the first attempt, or a restart of one that died before any checkpoint
            logger.info("--resume_from_checkpoint true: no complete checkpoint in %s yet; a fresh run (attempt %s of "
                        "this torchrun launch).", output_dir, int(os.environ["TORCHELASTIC_RESTART_COUNT"]) + 1)
            return None
        if latest is None:
            raise UsageError(f"--resume_from_checkpoint true: no checkpoint (checkpoint-N with trainer_state.json) "
                             f"in --output_dir {output_dir}; give the checkpoint's path, or start without it.")
        logger.info("Resuming from the latest checkpoint: %s", latest)
        return latest
    if value:
        if not os.path.isdir(value):
            raise UsageError(f"--resume_from_checkpoint {value}: no such folder.")
        if not readable_state(value):
            raise UsageError(f"--resume_from_checkpoint {value}: not a checkpoint (no readable trainer_state.json "
                             "in it); give a checkpoint-N folder written by a run.")
        return value
    earlier = any_checkpoints(output_dir)
    if earlier and not overwrite:
        raise UsageError(
            f"--output_dir {output_dir} holds checkpoints of an earlier run ({', '.join(earlier[-3:])}); "
            "continue it with --resume_from_checkpoint true, start over with --overwrite_output_dir true "
            "(deletes them), or choose another --output_dir."
        )
    return None


def clear_checkpoints(output_dir: str) -> list[str]:
    """--overwrite_output_dir, once the new run has loaded its model and data: the earlier run's complete checkpoints
    (checkpoint-N folders with a readable trainer_state.json) go, so that the new run's are the only ones. Anything
    else named like a checkpoint (a file, a folder without a state, a staging folder) is left and named in one line.
    Returns the names deleted."""
    deleted = []
    for path in complete_checkpoints(output_dir):
        shutil.rmtree(path)
        deleted.append(os.path.basename(path))
    if deleted:
        logger.warning("--overwrite_output_dir: deleted the earlier run's %s", ", ".join(deleted))
    left = incomplete_checkpoints(output_dir)
    if left:
        logger.warning("--overwrite_output_dir: left %s in %s (not a complete checkpoint: not deleted; remove them "
                       "yourself if they are not needed).", ", ".join(left), output_dir)
    return deleted


def looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~", ".\\")) or name in (".", "..") or name.endswith(("/", "\\"))
            or "\\" in name or name.count("/") > 1)


def check_model_source(name: str, flag: str = "--model_name_or_path") -> None:
    """A local model folder must hold a model; anything else must be a Hub id that can be found."""
    if os.path.isdir(name):
        markers = ("config.json", "adapter_config.json")
        if not any(os.path.isfile(os.path.join(name, m)) for m in markers):
            raise UsageError(f"{flag} {name}: the folder holds no config.json (not a saved model); give the folder "
                             "save_pretrained wrote, or a Hub id.")
        return
    if os.path.exists(name):
        raise UsageError(f"{flag} {name}: is a file; give a model folder (save_pretrained's) or a Hub id.")
    if looks_like_path(name):
        raise UsageError(f"{flag} {name}: no such folder.")
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # an id the cache cannot even look up is judged below
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise UsageError(f"{flag} {name}: no such local folder, and not in the Hub cache (HF_HUB_OFFLINE is set).")
    try:
        model_info(name, timeout=10)
    except Exception as error:  # not found, gated, or no network: all end the run the same way
        kind = type(error).__name__
        reason = "not found on the Hub" if "NotFound" in kind else f"the Hub could not be asked ({kind})"
        raise UsageError(f"{flag} {name}: no such local folder, and {reason}; check the name or path.") from error
