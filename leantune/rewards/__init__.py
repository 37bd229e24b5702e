"""Reward functions for the online trainers: callables and reward models scored together, checked and counted."""

from .builtin import BUILTIN_REWARDS, characters_in_place, correct_answer, resolve_reward_funcs
from .functions import RewardFunctionError, RewardFunctions, RewardScores

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunctionError",
    "RewardFunctions",
    "RewardScores",
    "characters_in_place",
    "correct_answer",
    "resolve_reward_funcs",
]
