"""What a round reports: TRL's reward, length and tool metrics over all processes, the decisions counted over the run
(missing or NaN rewards, masked completions, failed tool calls), and a few logged examples."""

from __future__ import annotations

import logging
from collections import defaultdict, deque

import torch

from ...data.prompt_preparation import PROMPT_IDS

logger = logging.getLogger("leantune.online")


class RoundMetrics:
    """Writes into the trainer's per-mode metric stores (`metric_values["train" | "eval"]`)."""

    def __init__(self, settings, accelerator, metric_values: dict, round_size: int):
        self.settings = settings  # RoundReportSettings (trainers/settings.py)
        self.accelerator, self.metric_values = accelerator, metric_values
        self.counts: dict[str, int] = defaultdict(int)  # counted decisions over the run (logged)
        # What reward functions hand to `log_extra`, per column, for the last round_size completions (TRL's `_logs`)
        self.extra = defaultdict(lambda: deque(maxlen=round_size))

    def store(self, training: bool) -> dict:
        return self.metric_values["train" if training else "eval"]

    def reward_logging(self, training: bool) -> dict:
        """The `log_extra` and `log_metric` callbacks reward functions receive (TRL's)."""
        def log_extra(column: str, values: list) -> None:
            self.extra[column].extend(values)

        def log_metric(name: str, value: float) -> None:
            self.store(training)[name].append(float(value))

        return {"log_extra": log_extra, "log_metric": log_metric}

    def count_reward_gaps(self, scores, rows: list[dict], texts: list[str]) -> None:
        for name, missing, nan in zip(scores.names, scores.missing, scores.nan):
            if missing:
                self.counts[f"no_reward/{name}"] += missing
            if nan:
                self.counts[f"nan_reward/{name}"] += nan
                logger.warning("Reward function %r returned NaN for %d completion(s): treated as no reward from it "
                               "(a completion no function scores gets advantage 0).", name, nan)
        unscored = scores.unscored()
        if unscored.any():
            self.counts["unscored_completions"] += int(unscored.sum())
            first = int(unscored.nonzero()[0])
            example = {name: value for name, value in rows[first].items() if name != PROMPT_IDS}
            logger.warning("All reward functions returned None for the following kwargs: %s (completion %r); %d "
                           "completion(s) of this round have no reward and get advantage 0.",
                           example, texts[first], int(unscored.sum()))

    def record_tools(self, rollout, count: int, training: bool) -> None:
        """TRL's `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed calls per call),
        over all processes; leantune adds `tools/malformed_frequency` (call blocks that did not parse, per
        completion: those completions were read as plain text) and counts both over the run."""
        totals = torch.tensor([rollout.tool_calls, rollout.tool_failures, rollout.malformed_tool_calls,
                               rollout.over_budget, count], device=self.accelerator.device, dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        calls, failures, malformed, over_budget, completions = totals.cpu().tolist()
        store = self.store(training)
        store["tools/call_frequency"].append(calls / completions)
        store["tools/failure_frequency"].append(failures / calls if calls else 0.0)
        store["tools/malformed_frequency"].append(malformed / completions)
        if rollout.malformed_tool_calls:
            self.counts["malformed_tool_calls"] += rollout.malformed_tool_calls
            logger.warning("%d tool call(s) of this round could not be parsed (bad JSON, no name, or never closed); "
                           "their completions were read as plain text.", rollout.malformed_tool_calls)
        if rollout.tool_failures:
            self.counts["failed_tool_calls"] += rollout.tool_failures
        if rollout.over_budget:
            self.counts["tool_results_over_budget"] += rollout.over_budget
            logger.info("%d rollout(s) ended at a tool call whose results would not fit in max_completion_length=%d "
                        "(or the model's context).", rollout.over_budget, self.settings.max_completion_length)

    def record_round(self, names, per_function, rewards, lengths, terminated, training: bool) -> None:
        store = self.store(training)
        # float64: a float32 std overflows above rewards of ~1.8e19 (losses/advantages.py computes its own in float64)
        per_function, rewards = per_function.double(), rewards.double()
        for i, name in enumerate(names):
            column = per_function[:, i]
            column = column[~torch.isnan(column)]
            if column.numel():
                store[f"rewards/{name}/mean"].append(column.mean().item())
                store[f"rewards/{name}/std"].append(column.std().item() if column.numel() > 1 else 0.0)
        valid = rewards[~torch.isnan(rewards)]
        if valid.numel():
            store["reward"].append(valid.mean().item())
            store["reward_std"].append(valid.std().item() if valid.numel() > 1 else 0.0)
        groups = rewards.view(-1, self.settings.num_generations if training else self.settings.eval_num_generations)
        scored = [g[~torch.isnan(g)] for g in groups]
        zero_std = [float(g.numel() < 2 or g.std().item() == 0) for g in scored]  # fewer than two: no spread
        store["frac_reward_zero_std"].append(sum(zero_std) / len(zero_std))
        lengths = lengths.float()
        store["completions/mean_length"].append(lengths.mean().item())
        store["completions/min_length"].append(lengths.min().item())
        store["completions/max_length"].append(lengths.max().item())
        store["completions/clipped_ratio"].append(1.0 - terminated.float().mean().item())
        if terminated.any():
            store["completions/mean_terminated_length"].append(lengths[terminated].mean().item())
        if training:
            store["num_tokens"].append(float(lengths.sum().item()))

    def log_examples(self, rows, texts, rewards) -> None:
        count = self.settings.num_completions_to_print or 4
        for row, text, reward in list(zip(rows, texts, rewards.tolist()))[:count]:
            logger.info("prompt %r -> completion %r, reward %.3f", row["prompt"], text, reward)
