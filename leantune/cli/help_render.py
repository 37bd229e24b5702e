"""A command's `--help`, rendered live from its argument classes (arguments.py and the method's config, whose import
imports transformers: about 5 s) and kept in the user's cache (help_cache.py) for every later `--help`. It imports
no command's own module (the runner, the planner, the profiler, the vLLM server)."""

from __future__ import annotations

from ..methods import BY_COMMAND
from .arguments import ProfileArguments, VLLMServeArguments, plan_argument_types
from .arguments import argument_types as method_types
from .help_cache import cached_help, store_help
from .parser import make_parser


def argument_types(command: str) -> tuple:
    if command in BY_COMMAND:
        return method_types(BY_COMMAND[command])
    if command == "plan" or command.startswith("plan --method "):
        return plan_argument_types(BY_COMMAND[command.removeprefix("plan").removeprefix(" --method ") or "sft"])
    if command == "profile":
        return (ProfileArguments,)
    if command == "vllm-serve":
        return (VLLMServeArguments,)
    raise KeyError(command)


def render_help(command: str) -> str:
    return make_parser(f"leantune {command.split(' --')[0]}", argument_types(command)).format_help()


def help_text(entry: str) -> str:
    """The help of one entry, from the cache or rendered live and kept for next time."""
    text = cached_help(entry)
    if text is None:
        text = render_help(entry)
        store_help(entry, text)
    return text
