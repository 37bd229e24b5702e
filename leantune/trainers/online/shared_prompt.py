"""Shared-prompt scoring (`shared_prompt=True`): each group's prompt passes through a forward once, not G times.

A micro-batch of prompt + completion examples becomes one row laid out as [prompt, completion_1, ..., completion_G]
per group (consecutive examples with the same prompt tokens form a group; a group split between micro-batches or
processes shares within each part). Each completion ("branch") restarts its positions at len(prompt), so its rotary
positions are those of the unshared row, and segment attention (models/segment_attention.py, `shared_prompt_of`)
lets its queries see the prompt's keys and its own causal prefix: every hidden state of a completion token equals
the unshared one. The completion's first token is predicted from the prompt's last position, one hidden state that
all G branches gather (its gradient summed over them, as the prompt's K/V gradients are).

So the targets cannot be read from `labels` (one position predicts G tokens): the batch carries them as flat
`target_index` (the position whose hidden state predicts the token), `target_tokens` and `target_sequence` (the
example each target belongs to), in the unshared flat order (example after example, token after token), so
per-token log-probs, sampling log-probs and the losses line up with the unshared path one to one.

Why this mechanism: the one-row layout reuses the padding-free machinery (segment offsets, restarting positions,
the chunked head's flat target index) and needs nothing that only runs on some devices; the prompt's K/V are
computed once with their gradients, so the memory of the prompt's activations is paid once per group, and the
attention work per branch is L_b x (L_p + L_b) as in the unshared row.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ...data.collators import round_up
from ...losses.token_logprobs import Targets
from ...models.segment_attention import SEGMENT_SDPA
from ..parts.batches import count_labelled_targets, labelled_sequences, labelled_targets

SHARED_PROMPT_OF = "shared_prompt_of"  # the model input segment attention reads (per segment: its prompt, or -1)
TARGET_KEYS = ("target_index", "target_tokens", "target_sequence")
# Set on a config whose `shared_prompt` was left at its default and resolved on: a model that cannot score shared
# rows then turns it off (logged) instead of being refused
BY_DEFAULT = "shared_prompt_by_default"
logger = logging.getLogger("leantune.trainer")


def shared_prompt_batch(examples: list[dict], prompt_lengths: list[int], pad_token_id: int,
                        pad_to_multiple_of: int | None = None) -> dict:
    """One row of shared-prompt groups from prompt + completion examples (`input_ids`, `completion_mask`); padding
    (`pad_to_multiple_of`) is a segment of its own."""
    ids, positions, segments, prompt_of = [], [], [], []
    target_index, target_tokens, target_sequence = [], [], []
    last_prompt, prompt_segment, prompt_end = None, -1, 0
    for n, (example, length) in enumerate(zip(examples, prompt_lengths)):
        tokens = list(example["input_ids"])
        prompt, completion = tokens[:length], tokens[length:]
        mask = list(example["completion_mask"])[length:]
        if prompt != last_prompt:  # a new group: its prompt is a segment of its own
            last_prompt, prompt_segment = prompt, len(segments)
            segments.append(len(prompt))
            prompt_of.append(-1)
            ids += prompt
            positions += range(len(prompt))
            prompt_end = len(ids)
        if not completion:
            continue  # nothing to score; the example still counts as a sequence
        start = len(ids)
        segments.append(len(completion))
        prompt_of.append(prompt_segment)
        ids += completion
        positions += range(length, length + len(completion))
        for j, (token, kept) in enumerate(zip(completion, mask)):
            if kept:
                target_index.append(prompt_end - 1 if j == 0 else start + j - 1)
                target_tokens.append(token)
                target_sequence.append(n)
    real = len(ids)
    padding = round_up(real, pad_to_multiple_of) - real
    if padding:
        segments.append(padding)
        prompt_of.append(-1)
        ids += [pad_token_id] * padding
        positions += range(padding)
    cu_seq_lens = torch.from_numpy(np.concatenate(([0], np.cumsum(segments))).astype(np.int32))
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max(segments),
        "max_length_k": max(segments),
        SHARED_PROMPT_OF: torch.tensor(prompt_of, dtype=torch.long),
        "target_index": torch.tensor(target_index, dtype=torch.long),
        "target_tokens": torch.tensor(target_tokens, dtype=torch.long),
        "target_sequence": torch.tensor(target_sequence, dtype=torch.long),
        "num_real_tokens": torch.tensor(real),
    }


def is_shared(batch: dict) -> bool:
    return "target_index" in batch


def batch_targets(batch: dict) -> Targets:
    """A scored micro-batch's targets: a shared row's own, else its `shift_labels` (laid out for the ring) or `labels`."""
    if "shift_labels" in batch or not is_shared(batch):
        return labelled_targets(batch)
    return Targets(batch["target_index"], batch["target_tokens"], batch["input_ids"].shape)


def batch_target_sequences(batch: dict, targets: Targets) -> torch.Tensor:
    """Which example of the micro-batch each target belongs to."""
    if is_shared(batch):
        return batch["target_sequence"].to(targets.index.device)
    return labelled_sequences(batch, targets)


def count_batch_targets(batch: dict) -> int:
    return int(batch["target_index"].numel()) if is_shared(batch) else count_labelled_targets(batch)


def shared_prompt_problem(model) -> str | None:
    """Why this model cannot score shared-prompt rows (only leantune's segment attention reads their layout)."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == SEGMENT_SDPA:
        return None
    return (f"`shared_prompt=True` needs attn_implementation='sdpa' (leantune's segment attention runs each "
            f"completion against its group's prompt), but the model uses {implementation!r}; load it with "
            f"attn_implementation='sdpa' or set `shared_prompt=False`.")


def resolve_shared_prompt(args) -> None:
    """`shared_prompt`'s default (None), resolved once when the config is built: on where a micro-batch holds several
    completions of one prompt, else off with one log line. An explicit False or True is kept; an explicit True
    without groups (PPO: one completion per prompt) is refused."""
    requested = args.shared_prompt
    if requested is not None:
        if requested and getattr(args, "min_num_generations", 2) < 2:
            raise ValueError("`shared_prompt=True` is for methods that sample groups of completions per prompt "
                             "(GRPO, RLOO, Online DPO); set `shared_prompt=False`.")
        setattr(args, BY_DEFAULT, False)
        return
    reason = nothing_to_share(args)
    args.shared_prompt = reason is None
    setattr(args, BY_DEFAULT, args.shared_prompt)
    if reason is not None:
        logger.info("shared_prompt: off for this run (%s).", reason)


def nothing_to_share(args) -> str | None:
    """Why a run's micro-batches hold no prompt to share (a shared row there is a prompt and one completion, whose
    blocks cost more attention than the unshared row: bench/shared_prompt.py --attention, docs/benchmarks.md)."""
    if getattr(args, "min_num_generations", 2) < 2:
        return "one completion per prompt: nothing to share"
    completions, steps = args.generation_plan(1)  # Online DPO's micro-batch rows are prompts of 2 completions
    if completions // steps < 2:
        return "a micro-batch holds one completion (per_device_train_batch_size=1): nothing to share"
    return None


def shared_prompt_for(model, args) -> bool:
    """Whether `model` scores shared-prompt rows in this run: needs leantune's segment attention; where the default
    turned them on, a model without it turns them off for the run (logged), where the user asked, it is refused."""
    if not getattr(args, "shared_prompt", False):
        return False
    problem = shared_prompt_problem(model)
    if problem is None:
        return True
    if not getattr(args, BY_DEFAULT, False):
        raise ValueError(problem)
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    args.shared_prompt = False
    logger.info("shared_prompt: off for this run (the model's attention is %r; shared rows need 'sdpa').",
                implementation)
    return False
