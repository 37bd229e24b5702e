"""`leantune <command>`: each command's flags are its config fields; `--config file.yaml` sets any of them."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "sft": ("leantune.cli.sft", "Supervised fine-tuning (no arguments: a built-in demo run on bundled data)."),
    "dpo": ("leantune.cli.dpo", "Direct Preference Optimization (no arguments: a built-in demo run on bundled pairs)."),
    "profile": ("leantune.cli.profile", "Token lengths of a dataset: which max_length, padding and packing to use."),
    "kto": ("leantune.cli.kto", "Kahneman-Tversky Optimization (no arguments: a built-in demo run on bundled data)."),
    "reward": ("leantune.cli.reward", "Reward modelling (no arguments: a built-in demo run on bundled pairs)."),
    "grpo": ("leantune.cli.grpo", "GRPO, online RL from rewards (no arguments: a built-in demo with a checked answer)."),
    "rloo": ("leantune.cli.rloo", "RLOO, online RL from rewards (no arguments: a built-in demo with a checked answer)."),
    "vllm-serve": ("leantune.cli.vllm_serve", "A vLLM generation server for GRPO/RLOO with vllm_mode=server."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _print_usage()
        return 0
    if argv[0] in ("-V", "--version"):
        from leantune import __version__

        print(f"leantune {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        _print_usage(sys.stderr)
        print(f"\nleantune: unknown command {command!r}.", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.run(rest) or 0)


def _print_usage(stream=sys.stdout) -> None:
    lines = ["usage: leantune <command> [--config FILE.yaml] [--<field> VALUE ...]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "`leantune <command> --help` lists every flag (they are the config fields)."]
    print("\n".join(lines), file=stream)


def parse_command_args(prog: str, dataclass_types: tuple, argv: list[str]):
    """Parse flags (with YAML defaults from --config) into dataclasses; also return the names set explicitly."""
    import yaml
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_types, prog=prog)
    parser.add_argument("--config", default=None, help="YAML file of field: value pairs; flags override it.")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    explicit = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}
    if known.config:
        with open(known.config, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
        fields = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - fields)
        if unknown:
            parser.error(f"unknown field(s) in {known.config}: {', '.join(unknown)}")
        parser.set_defaults(**values)
        explicit |= set(values)
    outputs = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if outputs[-1]:
        parser.error(f"unrecognised arguments: {' '.join(outputs[-1])}")
    return (*outputs[: len(dataclass_types)], explicit - {"config"})


if __name__ == "__main__":
    sys.exit(main())
