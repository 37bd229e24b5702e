"""Reward functions for the online trainers: callables and reward models scored together, checked and counted."""

from .functions import RewardFunctionError, RewardFunctions, RewardScores

__all__ = ["RewardFunctionError", "RewardFunctions", "RewardScores"]
