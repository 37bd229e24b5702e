"""`leantune plan`: a training step's peak memory before it runs, and the fastest configuration within a budget."""

from .planned_run import TracedStep
from .planner import MemoryPlan, plan_memory

__all__ = ["MemoryPlan", "TracedStep", "plan_memory"]
