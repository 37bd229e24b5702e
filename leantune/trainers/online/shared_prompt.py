"""Whether a run scores shared-prompt rows (`shared_prompt`, on by default where a micro-batch holds several
completions of one prompt): resolved once when the config is built (online_config.py's `resolve_shared_prompt`, from
`nothing_to_share`), and checked against the model when it is loaded (`shared_prompt_for`).
The row's layout: data/collators.py's `SharedPromptCollator`; its attention: models/segment_attention.py.
"""

from __future__ import annotations

import logging

from ...models.segment_attention import SEGMENT_SDPA

# Set on a config whose `shared_prompt` was left at its default and resolved on: a model that cannot score shared
# rows then turns it off (logged) instead of being refused
BY_DEFAULT = "shared_prompt_by_default"
logger = logging.getLogger("leantune.trainer")


def shared_prompt_problem(model) -> str | None:
    """Why this model cannot score shared-prompt rows (only leantune's segment attention reads their layout)."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == SEGMENT_SDPA:
        return None
    return (f"`shared_prompt=True` needs attn_implementation='sdpa' (leantune's segment attention runs each "
            f"completion against its group's prompt), but the model uses {implementation!r}; load it with "
            f"attn_implementation='sdpa' or set `shared_prompt=False`.")


def nothing_to_share(args) -> str | None:
    """Why a run's micro-batches hold no prompt to share (a shared row there is a prompt and one completion, whose
    blocks cost more attention than the unshared row: bench/shared_prompt.py --attention, docs/benchmarks.md)."""
    if getattr(args, "min_num_generations", 2) < 2:
        return "one completion per prompt: nothing to share"
    completions, steps = args.generation_plan(1)  # Online DPO's micro-batch rows are prompts of 2 completions
    if completions // steps < 2:
        return "a micro-batch holds one completion (per_device_train_batch_size=1): nothing to share"
    return None


def shared_prompt_for(model, args, wanted: bool) -> bool:
    """Whether `model` scores shared-prompt rows in this run (`wanted`: the layout's, trainers/settings.py): needs
    leantune's segment attention; where the default turned them on, a model without it turns them off for the run
    (logged, and written back to the trainer's copy of the config), where the user asked, it is refused."""
    if not wanted:
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
