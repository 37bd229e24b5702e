"""What GRPO's agentic keywords ask of a generation round, composed by the online trainer: `tools`,
`environment_factory` and `rollout_func` (TRL 1.16's meanings).

- `tools` / `environment_factory`: the round's prompts (environments: reset first, their observation appended, each
  rendered with its environment's tools) are generated, then continued by the multi-turn loop (multi_turn.py);
- `rollout_func(prompts, trainer)`: the user's function produces the round: a dict with `prompt_ids`,
  `completion_ids` and `logprobs` (one list per prompt it was given), optionally `env_mask` (1 for tokens the policy
  sampled, 0 for tokens it did not, which are not trained); any other key is a list (one entry per completion)
  passed to the reward functions under its name.
"""

from __future__ import annotations

import logging

from datasets import Dataset

from ..data.prompt_preparation import PROMPT_IDS, prompt_text
from .environments import Environments, environment_methods, with_observation
from .multi_turn import Rollout, run_tool_loop
from .tool_calls import ToolCallParser, check_tool_template, tool_name, tool_schemas, tool_suffix_ids

logger = logging.getLogger("leantune.online")

PLACEHOLDER_PROMPT = [{"role": "user", "content": ""}]
REQUIRED_ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class AgentRollouts:
    """The round's rollouts when GRPO is given tools, environments or a rollout function."""

    def __init__(self, tools=None, environment_factory=None, rollout_func=None):
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise ValueError(f"`tools` must be a list of callables, got {type(tools).__name__}.")
        if rollout_func is not None:
            if not callable(rollout_func):
                raise ValueError(f"`rollout_func` must be callable, got {type(rollout_func).__name__}.")
            if tools or environment_factory is not None:
                raise ValueError("`rollout_func` produces the whole rollout, so leantune does not run `tools` or "
                                 "`environment_factory` after it: call your tools inside `rollout_func`, or drop "
                                 "`rollout_func` to let the trainer run them.")
        self.rollout_func = rollout_func
        self.standalone_tools = list(tools or [])
        self.standalone_schemas = tool_schemas(self.standalone_tools, "tools")
        self.environments = Environments(environment_factory, self.standalone_tools) \
            if environment_factory is not None else None
        self.tools = self.environments.all_tools(self.standalone_tools) if self.environments else self.standalone_tools
        names = [tool_name(tool) for tool in self.standalone_tools]
        if len(set(names)) != len(names):
            raise ValueError(f"`tools` has two tools with one name ({names}); the policy calls tools by name.")
        self.keyword = "environment_factory" if self.environments else "tools" if self.tools else "rollout_func"
        self.parser = None
        self.tokenizer = None

    @property
    def multiple_environments(self) -> bool:
        return self.environments is not None and self.environments.multiple

    # --- construction -------------------------------------------------------------------------------------------

    def reward_functions(self) -> list:
        return self.environments.reward_functions() if self.environments else []

    def placeholder_dataset(self, args):
        """The data of environments that own it (no `train_dataset`): rows of an empty user message, one round's
        worth, cycled for `max_steps` steps; each rollout's `reset()` supplies its prompt."""
        if self.environments is None:
            raise ValueError("`train_dataset` is required unless an `environment_factory` is provided.")
        if self.environments.multiple:
            raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                             "`environment` column to route each example to its environment. Provide a dataset, or "
                             "pass a single environment factory.")
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError("When training without a `train_dataset` (the environment owns the data and returns the "
                             "prompt from `reset()`), `max_steps` must be set to a positive value to define the "
                             "training length. Set it via `GRPOConfig(max_steps=...)`.")
        round_size, _ = args.generation_plan(max(1, args.world_size))
        return Dataset.from_dict({"prompt": [PLACEHOLDER_PROMPT] * max(1, round_size // args.num_generations)})

    def with_prompt_column(self, dataset):
        """Environment data may be only an `environment` column: its rollouts start from an empty user message."""
        if self.environments is None or dataset is None:
            return dataset
        columns = dataset.column_names  # None for some streams: then row by row
        if columns is not None and "prompt" in columns:
            return dataset
        if self.environments.multiple and columns is not None and "environment" not in columns:
            raise ValueError(f"A `dict` `environment_factory` routes each example by its `environment` column; the "
                             f"dataset has neither it nor a `prompt` column ({columns}).")
        return dataset.map(lambda row: {"prompt": row["prompt"] if "prompt" in row else PLACEHOLDER_PROMPT})

    def check_dataset(self, dataset, conversational: bool) -> None:
        if (self.tools or self.environments) and not conversational:
            raise ValueError(f"`{self.keyword}` needs conversational prompts (a `prompt` column of chat messages): "
                             "tool calls and results are messages of the conversation.")
        if self.multiple_environments and dataset.column_names is not None and "environment" not in dataset.column_names:
            raise ValueError("A `dict` `environment_factory` routes each example by its `environment` column; the "
                             f"dataset has none ({dataset.column_names}).")

    def prompt_template_kwargs(self) -> dict:
        """What the prompts are rendered with when they are prepared: the standalone tools (an environment's own are
        added per rollout)."""
        return {"tools": self.standalone_schemas} if self.standalone_schemas and not self.environments else {}

    def bind(self, tokenizer, args, end_ids: tuple[int, ...], context_limit: int | None) -> None:
        """Checks the chat template against tool calling once the tokenizer is known; `context_limit` is the
        generation engine's (GenerationSession.context_limit)."""
        self.tokenizer, self.args, self.end_ids, self.context_limit = tokenizer, args, end_ids, context_limit
        self.template_kwargs = dict(args.chat_template_kwargs or {})
        if self.tools:
            self.parser = ToolCallParser(tokenizer, end_ids, self.keyword)
            check_tool_template(tokenizer, end_ids, self.template_kwargs, self.keyword)

    # --- a round --------------------------------------------------------------------------------------------------

    def rollout(self, rows: list[dict], generate, trainer, step_together=None) -> Rollout:
        """This process's rollouts of the round's rows (prompts already repeated per generation)."""
        if self.rollout_func is not None:
            return self._custom_rollout(rows, trainer)
        environments, toolboxes = None, [self._toolbox(None)] * len(rows)
        prompt_ids = [list(row[PROMPT_IDS]) for row in rows]
        if self.environments is not None:
            names = [self.environments.name_of(row) for row in rows]
            environments = self.environments.draw(names)
            toolboxes = [self._toolbox(environment) for environment in environments]
            prompt_ids = [self._environment_prompt(row, name, environment)
                          for row, name, environment in zip(rows, names, environments)]
        first = generate(prompt_ids, self.args.max_completion_length)
        rollout = Rollout(prompt_ids, [list(ids) for ids in first],
                          None if first.logprobs is None else [list(lp) for lp in first.logprobs],
                          environments=environments)
        if not self.tools:
            return rollout
        return run_tool_loop(rollout, generate, self.parser, self._suffix, toolboxes, self.args.max_completion_length,
                             self.context_limit, self.args.max_tool_calling_iterations, step_together)

    def _toolbox(self, environment) -> dict:
        tools = self.standalone_tools + (environment_methods(environment) if environment is not None else [])
        return {tool_name(tool): tool for tool in tools}

    def _suffix(self, tool_messages: list[dict]) -> list[int]:
        return tool_suffix_ids(self.tokenizer, tool_messages, self.end_ids, self.template_kwargs, self.keyword)

    def _environment_prompt(self, row: dict, name, environment) -> list[int]:
        """Reset the rollout's environment, append its observation, render with that environment's tools."""
        drop = {PROMPT_IDS}
        if self.environments.multiple:
            drop.add("environment")  # a control field, not the environment's business
        if row.get("prompt") == PLACEHOLDER_PROMPT:
            drop.add("prompt")
        observation = self.environments.reset(environment, row, tuple(drop))
        prompt = with_observation(row["prompt"], observation)
        kwargs = dict(self.template_kwargs)
        schemas = self.environments.schemas[name]
        if schemas:
            kwargs["tools"] = schemas
        ids = self.tokenizer(prompt_text(prompt, self.tokenizer, True, kwargs), add_special_tokens=False)["input_ids"]
        if self.args.max_prompt_length is not None and len(ids) > self.args.max_prompt_length:
            ids = ids[len(ids) - self.args.max_prompt_length:]  # keep the end, as prompt preparation does
        if self.context_limit is not None and len(ids) >= self.context_limit - 1:
            raise ValueError(f"The prompt of environment {name!r} after `reset()` is {len(ids)} tokens, which leaves no "
                             f"room to generate in the model's context of {self.context_limit}; set "
                             "`max_prompt_length` to cut it.")
        return list(ids)

    def _custom_rollout(self, rows: list[dict], trainer) -> Rollout:
        n = len(rows)
        output = self.rollout_func([row["prompt"] for row in rows], trainer)
        if not isinstance(output, dict):
            raise ValueError(f"rollout_func must return a dict with keys {list(REQUIRED_ROLLOUT_KEYS)}, got "
                             f"{type(output).__name__}.")
        missing = sorted(set(REQUIRED_ROLLOUT_KEYS) - output.keys())
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
        for key, values in output.items():
            per_completion = key in REQUIRED_ROLLOUT_KEYS or key == "env_mask" or isinstance(values, (list, tuple))
            if not per_completion or (values is None and key in ("logprobs", "env_mask")):
                continue  # a value that is not a list goes to every completion's reward, as in TRL
            if not isinstance(values, (list, tuple)) or len(values) != n:
                raise ValueError(f"rollout_func returned `{key}` with {len(values) if hasattr(values, '__len__') else '?'} "
                                 f"entries for the {n} prompts it was given (num_generations copies of each); return "
                                 "one entry per prompt.")
        completion_ids = [[int(t) for t in ids] for ids in output["completion_ids"]]
        lengths = [len(ids) for ids in completion_ids]
        logprobs = output["logprobs"]
        if logprobs is not None:
            logprobs = [[float("nan") if v is None else float(v) for v in lp] for lp in logprobs]
            if [len(lp) for lp in logprobs] != lengths:
                raise ValueError("rollout_func returned `logprobs` whose lengths differ from `completion_ids`' "
                                 "(one log-prob per completion token).")
        mask = output.get("env_mask")
        if mask is not None:
            mask = [[int(bool(v)) for v in m] for m in mask]
            if [len(m) for m in mask] != lengths:
                raise ValueError("rollout_func returned `env_mask` whose lengths differ from `completion_ids`' (one "
                                 "0/1 per completion token: 1 for tokens the policy sampled).")
        extra = {key: list(values) if isinstance(values, (list, tuple)) else [values] * n
                 for key, values in output.items() if key not in REQUIRED_ROLLOUT_KEYS and key != "env_mask"}
        return Rollout([[int(t) for t in ids] for ids in output["prompt_ids"]], completion_ids, logprobs, mask,
                       extra_columns=extra)
