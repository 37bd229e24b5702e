"""Rollouts beyond one sampled turn, for GRPO's agentic keywords: `tools` and `environment_factory` (the multi-turn
tool-calling loop, multi_turn.py; tool-call parsing and execution, tool_calls.py; environments, environments.py) and
`rollout_func` (agent.py, which composes them for the online trainer)."""

from .agent import AgentRollouts
from .multi_turn import Rollout

__all__ = ["AgentRollouts", "Rollout"]
