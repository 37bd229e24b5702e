"""The trainer's config, resolved once before transformers' Trainer is set up; never changed afterwards.

The trainer works on its own copy (the config object the user passed is never changed). Every choice that depends
on the machine or on the data is made here, once: the config is checked against the launch, the log-prob path is
chosen, Liger's model patches are kept to CUDA, loader pinning is turned off where there is nothing to pin for, and
streamed data is read by each process on its own. The fields themselves were validated by the config's own
__post_init__ (config_utils.validate_shared_options).
"""

from __future__ import annotations

import copy
import logging

from ...data.streaming import is_stream, require_max_steps, use_own_stream_reads
from .cpu_loader import no_pinning_without_accelerator
from .distributed import check_world_size
from .logprob_engine import LIGER_FLAGS, LogProbPath, choose_logprob_path
from .step_guards import validate_nonfinite_policy

logger = logging.getLogger("leantune.trainer")


def resolve_config(trainer_name: str, args, train_dataset, eval_dataset, vocabulary_head: bool = True):
    """(the trainer's resolved copy of `args`, its log-prob path). `vocabulary_head`: whether the trained model
    scores a vocabulary (a reward model does not: its Liger flag chooses nothing)."""
    if train_dataset is None:  # TRL's trainers refuse to be built without one (no eval-only use); so do leantune's
        raise ValueError(f"`train_dataset` is required by {trainer_name} (as by TRL's): pass the dataset to train on, "
                         "and `eval_dataset` for evaluation.")
    args = copy.copy(args)
    check_world_size(args)  # several launched processes never train as duplicates (trainers/parts/distributed.py)
    validate_nonfinite_policy(getattr(args, "nonfinite_policy", "stop"), getattr(args, "deepspeed", None))
    path = path_of_config(args, vocabulary_head)
    if getattr(args, "use_liger_kernel", False) and (path is not LogProbPath.LIGER or args.device.type != "cuda"):
        # transformers would patch the model with liger's kernels (RMSNorm, RoPE, SwiGLU, ...): on CUDA only,
        # where they are compiled; under Triton's CPU interpreter they save no memory and cost time (docs/liger.md)
        args.use_liger_kernel = False
        if path is LogProbPath.LIGER:
            logger.info("use_liger_kernel=True on %s: Liger's fused linear cross-entropy computes the loss; its "
                        "model patches (RMSNorm, RoPE, SwiGLU) are applied on CUDA only.", args.device.type)
    no_pinning_without_accelerator(args)  # trainers/parts/cpu_loader.py: pinning on CPU only warns
    resolve_streams(args, train_dataset, eval_dataset)
    return args, path


def resolve_streams(args, train_dataset, eval_dataset) -> None:
    """A stream (datasets.IterableDataset) among the splits: each process reads it on its own; a streamed train
    split needs `max_steps` (it has no length)."""
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    streamed = any(map(is_stream, [train_dataset, *evals]))
    if streamed:
        use_own_stream_reads(args)
    if is_stream(train_dataset):
        require_max_steps(args)
    if streamed and getattr(args, "precompute_ref_log_probs", False):
        raise ValueError("`precompute_ref_log_probs` is not supported with IterableDataset (a stream): it reads "
                         "the whole dataset before training; turn it off, or pass a datasets.Dataset.")


def liger_flags(args) -> list[str]:
    """The config fields that ask for Liger (the one place they are read)."""
    return [name for name in LIGER_FLAGS if getattr(args, name, False)]


def path_of_config(args, vocabulary_head: bool = True) -> LogProbPath:
    """The path a config asks for on its device. A model without a vocabulary head (a reward model) has nothing to
    chunk or fuse: its Liger flag chooses nothing."""
    flags = liger_flags(args)
    if flags and not vocabulary_head:
        logger.info("%s: a reward model has no vocabulary-sized logits, so there is nothing to chunk or fuse; the flag "
                    "changes nothing here.", flags[0])
        flags = []
    return choose_logprob_path(bool(flags), args.device.type, " / ".join(flags) or "-",
                               chunked=getattr(args, "chunked_loss", True))
