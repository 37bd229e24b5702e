"""The multi-turn loop: generate -> read tool calls -> run the tools -> append their results -> generate again, until
no rollout calls a tool, `max_tool_calling_iterations` is reached, or the completion budget is spent.

A rollout's completion is everything after its prompt: the policy's turns and, between them, the tokens of the tool
results (rendered by the chat template, never sampled). `policy_mask` marks the policy's own tokens (1) and the tool
tokens (0): only the former are trained. Budget rules (TRL's): the whole completion stays within
`max_completion_length` tokens and prompt + completion within the model's context; tool results that would overflow
it are not appended (counted as `over_budget`) and the rollout ends there; a turn generated after tool results is cut
to the room left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .tool_calls import call_tools


@dataclass
class Rollout:
    """One round's rollouts on this process, in row order."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None = None  # sampling log-probs per completion token (NaN on tool tokens)
    policy_mask: list[list[int]] | None = None  # per completion token: 1 sampled by the policy, 0 a tool result
    completions: list | None = None  # what reward functions get as `completions`; None: the trainer decodes
    extra_columns: dict = field(default_factory=dict)  # more keyword arguments for the reward functions
    environments: list | None = None  # the environment instance of each rollout (TRL's `trainer.environments`)
    tool_calls: int = 0
    tool_failures: int = 0
    malformed_tool_calls: int = 0
    over_budget: int = 0


def run_tool_loop(rollout: Rollout, generate, parser, suffix_of, toolboxes: list[dict], budget: int,
                  context_limit: int | None, max_iterations: int | None, step_together=None) -> Rollout:
    """Continues the rollouts whose first turn (in `rollout.completion_ids`) calls tools.

    generate(list of token ids, max_new_tokens) -> Completions; suffix_of(tool messages) -> their tokens;
    toolboxes[i]: {name: callable} of rollout i; step_together(local_wants_more) -> whether any process wants
    another turn (processes generate in step: a process with nothing left generates nothing but keeps the count)."""
    completion_ids = rollout.completion_ids
    logprobs = rollout.logprobs
    mask = [[1] * len(ids) for ids in completion_ids]
    messages, pending = [], []
    for i, ids in enumerate(completion_ids):
        turn = parser.parse(ids, rollout.prompt_ids[i])
        messages.append([turn.message])
        rollout.malformed_tool_calls += turn.malformed
        if turn.message.get("tool_calls"):
            pending.append(i)
    iteration = 0

    def more() -> bool:
        local = bool(pending) and (max_iterations is None or iteration < max_iterations)
        return step_together(local) if step_together is not None else local

    while more():
        room = {}
        for i in pending:
            results, failed = call_tools(messages[i][-1]["tool_calls"], toolboxes[i])
            rollout.tool_calls += len(results)
            rollout.tool_failures += failed
            suffix = suffix_of(results)
            length = len(completion_ids[i]) + len(suffix)
            left = budget - length
            if context_limit is not None:
                left = min(left, context_limit - 1 - len(rollout.prompt_ids[i]) - length)
            if left < 0:  # the results do not fit: the rollout ends with its tool call
                rollout.over_budget += 1
                continue
            messages[i].extend(results)
            completion_ids[i] = completion_ids[i] + suffix
            mask[i] += [0] * len(suffix)
            if logprobs is not None:
                logprobs[i] = logprobs[i] + [math.nan] * len(suffix)
            if left > 0:
                room[i] = left
        pending = list(room)
        inputs = [rollout.prompt_ids[i] + completion_ids[i] for i in pending]
        new = generate(inputs, max(room.values(), default=1))
        next_pending = []
        for k, i in enumerate(pending):
            ids = list(new[k])[: room[i]]
            before = rollout.prompt_ids[i] + completion_ids[i]
            completion_ids[i] = completion_ids[i] + ids
            mask[i] += [1] * len(ids)
            if logprobs is not None:
                logprobs[i] = logprobs[i] + list(new.logprobs[k])[: len(ids)]
            if not ids:
                continue
            turn = parser.parse(ids, before)
            messages[i].append(turn.message)
            rollout.malformed_tool_calls += turn.malformed
            if turn.message.get("tool_calls"):
                next_pending.append(i)
        pending = next_pending
        iteration += 1
    rollout.policy_mask = mask
    rollout.completions = messages
    return rollout
