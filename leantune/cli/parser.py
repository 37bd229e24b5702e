"""Flags from config dataclasses: grouped (the command's own fields first, transformers' inherited ones last), no
abbreviations, YAML defaults from --config, and every parsing mistake as one line that names the flag."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import os
import types
from typing import get_type_hints

import yaml
from transformers import HfArgumentParser

from ..utils import imports
from .errors import UsageError, as_flags

HELP_WIDTH = 110
INHERITED_GROUP = "training (inherited from transformers' TrainingArguments)"
GROUP_TITLES = {
    "ScriptArguments": "data",
    "ColumnArguments": "columns (other names read as the standard ones)",
    "ProfileArguments": "profile",
    "VLLMServeArguments": "server",
    "ModelConfig": "model",
    "RewardArguments": "rewards",
    "MemoryOptions": "memory engine (every trainer)",
    "ModelLoadingOptions": "model loading (every trainer)",
    "CausalLMOptions": "model loading (every trainer)",
    "ReferenceSyncOptions": "reference model sync (TR-DPO)",
}
# transformers' help of some inherited fields describes its Trainer, not what these commands do with them.
HELP_OVERRIDES = {
    "output_dir": "Folder the model, its checkpoints and logs are written to, relative to the current folder. Unset "
                  "(%(default)s): trainer_output (transformers' default) for a run on --dataset_name; leantune-output/<command>-demo "
                  "for the built-in demo.",
    "resume_from_checkpoint": "Continue a run: true (or latest) resumes from the latest complete checkpoint-N in "
                              "--output_dir; a path resumes from that checkpoint folder. Unset (%(default)s): a fresh run.",
}


def _with_own_help(field: dataclasses.Field) -> dataclasses.Field:
    """The field with leantune's help text where transformers' would mislead (a copy: the class keeps its own)."""
    if field.name not in HELP_OVERRIDES:
        return field

    field = copy.copy(field)
    field.metadata = types.MappingProxyType({**field.metadata, "help": HELP_OVERRIDES[field.name]})
    return field


# Mixins of fields that TRL declares on each config itself (trainers/preference_options.py): listed with the method's
# own fields.
METHOD_FIELD_MIXINS = ("PreferenceOptions", "ReferenceOptions")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--field VALUE` once (not the dashed alias and the upper-case metavar), at a fixed width so that the help
    text (and its cached copy) does not depend on the terminal."""

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        flag = action.option_strings[-1] if action.option_strings[0] == "-h" else action.option_strings[0]
        if action.nargs == 0:
            return flag
        if action.nargs == "?" and action.const is True:
            return f"{flag} [true|false]"
        if action.choices:
            return f"{flag} {{{','.join(map(str, action.choices))}}}"
        return f"{flag} VALUE ..." if action.nargs in ("+", "*") else f"{flag} VALUE"


def _formatter(prog: str) -> argparse.HelpFormatter:
    return _HelpFormatter(prog, width=HELP_WIDTH, max_help_position=40)


def _declaring_class(dtype: type, name: str) -> type:
    for klass in dtype.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return klass
    return dtype


def _group_title(klass: type, dtype: type) -> str:
    if klass.__name__ in METHOD_FIELD_MIXINS:
        klass = dtype
    if klass.__name__ in GROUP_TITLES:
        return GROUP_TITLES[klass.__name__]
    if klass.__module__.startswith("transformers"):
        return INHERITED_GROUP
    return f"{klass.__name__} (the method's own fields)"


def make_parser(prog: str, dataclass_types: tuple):
    class CommandParser(HfArgumentParser):
        """HfArgumentParser with fields grouped by the class that declares them, and one-line errors."""

        def __init__(self, dataclass_types, **kwargs):
            self._inherited = []
            super().__init__(dataclass_types, **kwargs)
            self.add_argument("--config", default=None, help="YAML file of field: value pairs; flags override it.")
            if not any("debug" in {f.name for f in dataclasses.fields(d)} for d in self.dataclass_types):
                self.add_argument("--debug", action="store_true", help="Show the Python traceback of an error.")
            if self._inherited:
                group = self.add_argument_group(INHERITED_GROUP)
                seen = {a.dest for a in self._actions}
                for _, fields in self._inherited:
                    for field in fields:
                        if field.name not in seen:
                            self._parse_dataclass_field(group, _with_own_help(field))
                            seen.add(field.name)

        def _add_dataclass_arguments(self, dtype):
            hints = get_type_hints(dtype)
            groups: dict[str, argparse._ArgumentGroup] = {}
            inherited = []
            taken = {action.dest for action in self._actions}
            for field in dataclasses.fields(dtype):
                if not field.init or field.name in taken:  # declared by an earlier class (leantune plan's
                    continue  # --memory_budget): one flag, whose value each class that declares it receives
                field.type = hints[field.name]
                title = _group_title(_declaring_class(dtype, field.name), dtype)
                if title == INHERITED_GROUP:
                    inherited.append(field)
                    continue
                if title not in groups:
                    groups[title] = self.add_argument_group(title)
                self._parse_dataclass_field(groups[title], _with_own_help(field))
            if inherited:
                self._inherited.append((dtype, inherited))

        def error(self, message: str):
            raise UsageError(_explain_parse_error(message, self))

        def parse_args_into_dataclasses(self, args=None, return_remaining_strings=False, **_):
            """HfArgumentParser's, where a field two classes declare (leantune plan's --memory_budget and the
            config's) is one flag whose value both receive (HfArgumentParser gives it to the first only)."""
            namespace, remaining = self.parse_known_args(args=args)
            values, used = vars(namespace), set()
            outputs = []
            for dtype in self.dataclass_types:
                names = [f.name for f in dataclasses.fields(dtype) if f.init and f.name in values]
                used.update(names)
                outputs.append(dtype(**{name: values[name] for name in names}))
            rest = {k: v for k, v in values.items() if k not in used}
            if rest:
                outputs.append(argparse.Namespace(**rest))
            return (*outputs, remaining) if return_remaining_strings else tuple(outputs)

    parser = CommandParser(
        dataclass_types, prog=prog, allow_abbrev=False, formatter_class=_formatter,
        usage=f"{prog} [--config FILE.yaml] [--<field> VALUE ...]",
        description="Every config field is a flag; --config FILE.yaml sets any of them (flags override it). "
                    "--debug alone shows the Python traceback of an error.",
    )
    return parser


def _explain_parse_error(message: str, parser) -> str:
    """argparse's message, with the closest flag suggested for a misspelt one."""
    if message.startswith("unrecognized arguments:") or message.startswith("unrecognised arguments:"):
        unknown = [a for a in message.split(":", 1)[1].split() if a.startswith("--")]
        if unknown:
            name = unknown[0].split("=", 1)[0]
            flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else "; `--help` lists every flag"
            return f"unknown flag {name}{hint}"
    return message


def flag_names(parser) -> set[str]:
    return {a.dest for a in parser._actions}


def _read_yaml(path: str, parser) -> dict:
    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: no such file.")
    try:
        with open(path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"--config {path}{where}: not valid YAML ({getattr(error, 'problem', error)}).") from error
    except UnicodeDecodeError as error:
        raise UsageError(f"--config {path}: not UTF-8 text ({error.reason} at byte {error.start}).") from error
    if not isinstance(values, dict):
        raise UsageError(f"--config {path}: expected `field: value` lines, found a {type(values).__name__}.")
    unknown = sorted(set(values) - flag_names(parser))
    if unknown:
        close = {u: difflib.get_close_matches(u, flag_names(parser), n=1, cutoff=0.75) for u in unknown}
        names = ", ".join(f"{u} (did you mean {c[0]}?)" if c else u for u, c in close.items())
        raise UsageError(f"--config {path}: unknown field(s) {names}.")
    return values


def parse_command_args(prog: str, dataclass_types: tuple, argv: list[str]):
    """Parse flags (with YAML defaults from --config) into dataclasses; also return the names set explicitly."""
    parser = make_parser(prog, dataclass_types)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    explicit = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    if known.config:
        values = _read_yaml(known.config, parser)
        parser.set_defaults(**values)
        explicit |= set(values)
    _check_config_files(argv, values if known.config else {})
    try:
        outputs = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except UsageError:
        raise
    except (ValueError, TypeError) as error:
        # A config's own validation (__post_init__): its messages name fields in backticks.
        raise UsageError(as_flags(str(error), flag_names(parser))) from error
    if outputs[-1]:
        raise UsageError(_explain_parse_error(f"unrecognized arguments: {' '.join(outputs[-1])}", parser))
    return (*outputs[: len(dataclass_types)], explicit - {"config", "debug"})


def _check_config_files(argv: list[str], yaml_values: dict) -> None:
    """A DeepSpeed or FSDP config named by a path that is not there: one line naming the flag (transformers' own
    message does not)."""
    for name in ("deepspeed", "fsdp_config"):
        value = yaml_values.get(name)
        for index, arg in enumerate(argv):
            if arg == f"--{name}" and index + 1 < len(argv):
                value = argv[index + 1]
            elif arg.startswith(f"--{name}="):
                value = arg.split("=", 1)[1]
        if isinstance(value, str) and value.endswith(".json") and not os.path.isfile(value):
            raise UsageError(f"--{name} {value}: no such file (a JSON config the engine reads).")
        if name == "deepspeed" and value:  # transformers imports it while parsing: check before, in one line
            if not imports.is_available("deepspeed"):
                raise UsageError("--deepspeed needs deepspeed, which is not installed: "
                                 "pip install \"leantune[deepspeed]\".")
