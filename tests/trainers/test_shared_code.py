"""A structural guard (issue 36): the trainer code every method runs through (base.py, online_trainer.py, parts/,
online/) names no method and reads no option of one method's alone. What is one method's lives in its trainer file,
its entry in leantune/methods.py or its loss, and reaches the shared code through a declared interface
(`ScoringNeeds`, `policy_loss`, `regularised`, `scored_prompts`, `split_problem`), never through a test of which
method runs."""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from pathlib import Path

import leantune
from leantune.methods import METHODS

TRAINERS = Path(leantune.__file__).resolve().parent / "trainers"
SHARED = [TRAINERS / "base.py", TRAINERS / "online_trainer.py", *sorted((TRAINERS / "parts").glob("*.py")),
          *sorted((TRAINERS / "online").glob("*.py"))]
# A method's own loss choice, declared by several methods' configs with different meanings: each loss reads its own
LOSS_CHOICES = {"loss_type"}


def method_only_fields() -> dict[str, str]:
    """Each config field declared by exactly one method's config (inherited fields count for every heir), with
    that method."""
    fields = {name: {field.name for field in dataclasses.fields(method.config_class)}
              for name, method in METHODS.items()}
    declared = Counter(field for names in fields.values() for field in names)
    return {field: next(name for name, names in fields.items() if field in names)
            for field, count in declared.items() if count == 1}


def method_names() -> set[str]:
    """Every way the code could name a method: its key, command, card name, trainer and config class."""
    names = set()
    for method in METHODS.values():
        names |= {method.name, method.command, method.card_name, *method_classes(method)}
    return names


def method_classes(method) -> set[str]:
    return {method.trainer_name, method.config.split(":")[1]}


CLASSES = {name for method in METHODS.values() for name in method_classes(method)}


def compared_strings(node: ast.Compare) -> list[str]:
    """The string constants a comparison tests against (`x == "grpo"`, `x in ("grpo", "rloo")`)."""
    found = []
    for operand in (node.left, *node.comparators):
        items = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [operand]
        found += [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]
    return found


def violations(source: str, method_only: dict[str, str], names: set[str]) -> list[str]:
    """(line: what) for every read of a method-only field or loss choice, and every method named, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        read = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            read = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            read = node.args[1].value
        if read in method_only:
            found.append(f"{node.lineno}: reads `{read}` ({method_only[read]}'s alone)")
        elif read in LOSS_CHOICES:
            found.append(f"{node.lineno}: reads `{read}` (each method's loss reads its own)")
        if isinstance(node, ast.Name) and node.id in CLASSES:  # a variable named `reward` names no method
            found.append(f"{node.lineno}: names {node.id}")
        if isinstance(node, ast.Compare):
            found += [f"{node.lineno}: tests {value!r}" for value in compared_strings(node) if value in names]
        if isinstance(node, ast.Tuple | ast.List | ast.Set):  # a list of methods kept aside, e.g. SPLIT_METHODS
            values = [item.value for item in node.elts if isinstance(item, ast.Constant)]
            if values and all(value in names for value in values):
                found.append(f"{node.lineno}: lists methods {values}")
    return found


def test_the_method_only_fields_come_from_the_configs():
    fields = method_only_fields()
    assert {"entropy_coef": "grpo", "top_entropy_quantile": "grpo", "vf_coef": "ppo", "lmbda": "gkd",
            "teacher_model_init_kwargs": "gkd", "normalize_advantages": "rloo"}.items() <= fields.items()
    # declared by several methods' configs: not one method's
    assert not {"max_length", "beta", "temperature", "padding_free", "max_completion_length"} & set(fields)


def test_the_rule_finds_what_it_forbids():
    fields, names = method_only_fields(), method_names()
    source = ("if trainer.method != 'grpo' and args.loss_type == 'bnpo':\n    pass\n"
              "SPLIT = ('grpo', 'rloo')\nx = args.top_entropy_quantile\ny = isinstance(args, GRPOConfig)\n"
              "z = getattr(args, 'vf_coef', 0)\nstore['reward'] = 1\n")
    found = violations(source, fields, names)
    assert sorted(int(line.split(":")[0]) for line in found) == [1, 1, 3, 4, 5, 6], found  # not the metric's key


def test_shared_trainer_code_names_no_method_and_reads_no_method_only_field():
    assert len(SHARED) > 10 and TRAINERS / "online" / "round_parts.py" in SHARED
    fields, names = method_only_fields(), method_names()
    found = {path.relative_to(TRAINERS.parent).as_posix(): violations(path.read_text(), fields, names)
             for path in SHARED}
    assert not {path: lines for path, lines in found.items() if lines}, (
        "shared trainer code tests a method or reads one method's option; let the method declare it (its trainer "
        "file, its methods.py entry or its loss) and the shared code ask through the method's interface")
