"""TRL's `environment_factory`: environments whose public methods are the policy's tools, one instance per rollout.

A factory is a callable returning an environment (a class, usually); a dict of them names several, and each example's
`environment` column picks its own (only that environment's tools are shown in its prompt). Each environment:

- must define `reset(**row)`: called before each rollout with the example's other columns (not `environment`);
  returning a string (or content blocks) appends it to the last prompt message; None leaves the prompt as it is;
- exposes its public methods (not `reset` / `get_reward`, nothing starting with `_`) as tools, bound to the instance;
- may define `get_reward()`: the environment then owns a reward, an extra reward function named after its class
  (weight 1, after `reward_funcs`) that scores only rollouts of that very class (None, i.e. not applicable, for
  others), so `reward_funcs` becomes optional.

Instances are made once and reused ("construct once, reset often"): one probe per environment when the trainer is
built (to find its tools and reward), more only when a round needs more concurrent instances of it.
"""

from __future__ import annotations

import inspect

from .tool_calls import tool_schemas

NOT_TOOLS = ("reset", "get_reward")


def environment_methods(environment) -> list:
    """The public methods of an environment, bound to it: its tools (found on the class, so properties are not run)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


class Environments:
    """The factories of a trainer, their pools of instances, their tools and their rewards."""

    def __init__(self, environment_factory, standalone_tools: list):
        self.multiple = isinstance(environment_factory, dict)
        factories = environment_factory if self.multiple else {None: environment_factory}
        if self.multiple and not factories:
            raise ValueError("`environment_factory` is an empty dict: map at least one environment name to a factory.")
        for name, factory in factories.items():
            if not callable(factory):
                raise ValueError(f"`environment_factory`{'' if name is None else f'[{name!r}]'} is "
                                 f"{type(factory).__name__}, not a callable that returns an environment.")
        self.factories = factories
        self.pool: dict = {}  # name -> instances (reused across rounds)
        self.tools: dict = {}  # name -> the tools a rollout of that environment sees (standalone ones first)
        self.schemas: dict = {}  # name -> their JSON schemas (what its prompts show)
        self.reward_types: list[type] = []  # classes that own a reward (one reward column each)
        for name, factory in factories.items():
            instance = factory()
            label = "`environment_factory`" + ("" if name is None else f"[{name!r}]")
            if not callable(getattr(type(instance), "reset", None)):
                raise ValueError(f"{label} returned a {type(instance).__name__}, which has no `reset` method; every "
                                 "environment needs a callable `reset(**kwargs)` (called before each rollout).")
            methods = environment_methods(instance)
            self.pool[name] = [instance]
            self.tools[name] = list(standalone_tools) + methods
            self.schemas[name] = tool_schemas(self.tools[name], "environment_factory")
            if callable(getattr(type(instance), "get_reward", None)) and type(instance) not in self.reward_types:
                self.reward_types.append(type(instance))

    def all_tools(self, standalone_tools: list) -> list:
        """Every tool of every environment, once (TRL's `trainer.tools`)."""
        tools = list(standalone_tools)
        for name in self.factories:
            tools += [tool for tool in self.tools[name][len(standalone_tools):] if tool not in tools]
        return tools

    def reward_functions(self) -> list:
        """One reward function per class that owns its reward, named after it."""
        return [_reward_of(kind) for kind in self.reward_types]

    def name_of(self, row: dict):
        if not self.multiple:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(f"Example has `environment={name!r}`, which is not among the environments passed to "
                             f"`environment_factory`. Expected one of: {list(self.factories)}.")
        return name

    def draw(self, names: list) -> list:
        """One instance per rollout, reused from the pools; new ones only when a round needs more than exist."""
        handed: dict = {}
        instances = []
        for name in names:
            pool, index = self.pool[name], handed.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed[name] = index + 1
            instances.append(pool[index])
        return instances

    def reset(self, environment, row: dict, drop: tuple[str, ...]):
        """The environment's observation for this example (None, text or content blocks)."""
        kwargs = {key: value for key, value in row.items() if key not in drop}
        return environment.reset(**kwargs)


def _reward_of(kind: type):
    if inspect.iscoroutinefunction(kind.get_reward):
        async def reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is kind else None for e in environments]
    else:
        def reward(environments, **kwargs):
            return [e.get_reward() if type(e) is kind else None for e in environments]
    reward.__name__ = reward.__qualname__ = kind.__name__
    return reward


def with_observation(prompt: list[dict], observation) -> list[dict]:
    """The prompt with the environment's observation appended to its last message (the row itself is left alone)."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]
