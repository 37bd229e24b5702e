"""`leantune <command>`: each command's flags are its config fields; `--config file.yaml` sets any of them.

A user's mistake ends in one line naming the flag, file, row or column, with exit code 2; `--debug` (or
LEANTUNE_DEBUG=1) shows the traceback instead. An error that is not a user's mistake keeps its traceback.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from ..methods import METHODS
from ..utils.faults import TrainingFault
from ..version import __version__
from .errors import USER_MISTAKES, one_line, report, take_debug_flag

# The commands that train nothing: (module with run(argv), help). Every method's command is its entry in
# leantune/methods.py, run by runner.py.
TOOLS = {
    "profile": ("leantune.cli.profile", "Token lengths of a dataset: which max_length, padding and packing to use."),
    "plan": ("leantune.cli.plan", "Peak memory of a training step before it runs; --memory_budget: the fastest fit."),
    "vllm-serve": ("leantune.cli.vllm_serve", "A vLLM generation server for GRPO/RLOO with vllm_mode=server."),
}
COMMANDS = {**{method.command: method.help for method in METHODS.values()},
            **{name: help_line for name, (_, help_line) in TOOLS.items()}}


def main(argv: list[str] | None = None) -> int:
    code = run_command(list(sys.argv[1:] if argv is None else argv))
    if argv is None and code != 0:
        leave_failed_process_now(code)
    return code


def leave_failed_process_now(code: int) -> None:
    """A process of a multi-process run that failed (its one line already printed) exits at once.

    Its gloo group's threads and store would otherwise be torn down by C++ destructors at interpreter exit while a
    peer is failing too, which can abort the process ("terminate called without an active exception", SIGABRT)
    and turn exit code 2 into -6. Only the `leantune` command does this: a caller of main() keeps its process."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_command(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        _print_usage()
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"leantune {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        _print_usage(sys.stderr)
        print(f"\nleantune: unknown command {command!r}.", file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        from .help_cache import cached_help, help_entry

        entry = help_entry(command, rest)
        text = cached_help(entry)  # from the user's cache, without importing torch and transformers
        if text is None:  # else rendered once and kept
            from .help_render import help_text

            try:
                text = help_text(entry)
            except KeyError:  # not a command line with help of its own (`plan --method nope`): the command says why
                text = None
        if text is not None:
            print(text, end="")
            return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rest, debug = take_debug_flag(rest)
    try:
        if command in TOOLS:
            return int(importlib.import_module(TOOLS[command][0]).run(rest) or 0)
        from .runner import run_method

        return int(run_method(command, rest) or 0)
    except USER_MISTAKES as error:
        if debug:
            raise
        return report(command, error)
    except TrainingFault as error:
        # the run failed (NaN/inf, a process that stopped answering), not the command line: exit 1, one line
        if debug:
            raise
        print(f"leantune {command}: training failed: {one_line(error)} (--debug shows the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"leantune {command}: interrupted.", file=sys.stderr)
        return 130


def _print_usage(stream=sys.stdout) -> None:
    lines = ["usage: leantune <command> [--config FILE.yaml] [--<field> VALUE ...] [--debug]", "", "commands:"]
    lines += [f"  {name:<10} {help_line}" for name, help_line in COMMANDS.items()]
    lines += ["", "`leantune <command> --help` lists every flag (they are the config fields).",
              "--debug (or LEANTUNE_DEBUG=1) shows the Python traceback of an error."]
    print("\n".join(lines), file=stream)


if __name__ == "__main__":
    sys.exit(main())
