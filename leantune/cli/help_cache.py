"""`leantune <command> --help` in well under a second.

The flags come from config classes that subclass transformers' TrainingArguments, and importing that takes about
5 s on a small CPU. The rendered help of every command is therefore kept in help_cache.json, tagged with the
versions it was rendered under; it is used only when they match (otherwise the help is rendered live). A test
checks that it equals the live rendering. Regenerate it with `python -m leantune.cli.help_cache`.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

CACHE_FILE = Path(__file__).with_name("help_cache.json")


def cache_key() -> dict:
    from leantune import __version__

    try:
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = None
    return {"leantune": __version__, "transformers": transformers_version,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def cached_help(command: str) -> str | None:
    try:
        cache = json.loads(CACHE_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if cache.get("key") != cache_key():
        return None
    return cache.get("help", {}).get(command)


def method_flag(argv: list[str]) -> str:
    """The value of `--method` in a command line (`leantune plan`), "sft" when absent."""
    for index, arg in enumerate(argv):
        if arg == "--method" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--method="):
            return arg.split("=", 1)[1]
    return "sft"


def help_entry(command: str, argv: list[str]) -> str:
    """The cache entry of a command line's help: `plan` lists the fields of the method it plans, one entry each."""
    method = method_flag(argv).lower().replace("_", "-")
    return command if command != "plan" or method == "sft" else f"plan --method {method}"


def argument_types(command: str) -> tuple:
    from .runner import METHODS, _load
    from .runner import argument_types as method_types

    if command in METHODS:
        return method_types(METHODS[command])
    if command.startswith("plan --method "):
        from .arguments import ModelConfig, ScriptArguments
        from .plan import PlanArguments

        method = METHODS[command.split()[-1]]
        if method.online:
            from .online_runs import RewardArguments

            return (PlanArguments, ScriptArguments, RewardArguments, ModelConfig, _load(method.config))
        return (PlanArguments, ScriptArguments, ModelConfig, _load(method.config))
    if command == "profile":
        from .profile import ProfileArguments

        return (ProfileArguments,)
    if command == "plan":
        from ..trainers.sft_config import SFTConfig
        from .arguments import ModelConfig, ScriptArguments
        from .plan import PlanArguments

        return (PlanArguments, ScriptArguments, ModelConfig, SFTConfig)
    if command == "vllm-serve":
        from .vllm_serve import VLLMServeArguments

        return (VLLMServeArguments,)
    raise KeyError(command)


def render_help(command: str) -> str:
    from .parser import make_parser

    return make_parser(f"leantune {command.split(' --')[0]}", argument_types(command)).format_help()


def write_cache() -> Path:
    from .main import COMMANDS
    from .runner import METHODS

    commands = [*COMMANDS, *(f"plan --method {method}" for method in METHODS if method != "sft")]
    cache = {"key": cache_key(), "help": {command: render_help(command) for command in commands}}
    CACHE_FILE.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return CACHE_FILE


if __name__ == "__main__":
    print(f"written: {write_cache()}")
