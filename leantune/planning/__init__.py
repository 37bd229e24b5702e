"""`leantune plan`: a training step's peak memory before it runs, and the fastest configuration within a budget."""

from .planner import MemoryPlan, TracedStep, plan_memory

__all__ = ["MemoryPlan", "TracedStep", "plan_memory"]
