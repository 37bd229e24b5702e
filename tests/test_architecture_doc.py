"""ARCHITECTURE.md kept true (issue 36, item 4): one page (at most 100 lines), every folder of the package named in
its layout, every file it names present, and every rule it states checked by a test it cites by name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "ARCHITECTURE.md"
PACKAGE = REPO / "leantune"
CITATION = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def test_architecture_is_one_page():
    lines = DOC.read_text().splitlines()
    assert len(lines) <= 100, f"ARCHITECTURE.md has {len(lines)} lines; the limit is 100 (details: docs/internals.md)"


def test_every_package_folder_is_in_the_layout():
    text = DOC.read_text()
    folders = sorted(p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py")
                     if p.parent != PACKAGE)
    missing = [folder for folder in folders if f"{folder.split('/')[-1]}/" not in text]
    assert not missing, f"folders of leantune/ that ARCHITECTURE.md does not name: {missing}"


def test_every_file_it_names_exists():
    text = DOC.read_text()
    files = {p.name for p in REPO.rglob("*.py") if ".git" not in p.parts} | {p.name for p in REPO.rglob("*.md")}
    named = set(re.findall(r"(?<![\w>])(\w+\.(?:py|md))\b", text))  # not a pattern like <method>_config.py
    assert named, "the layout names no file: the check below would pass on anything"
    assert not named - files, f"ARCHITECTURE.md names files that do not exist: {sorted(named - files)}"


def rules() -> list[str]:
    """The bullets of the doc's `## Rules` section, one string each."""
    section = DOC.read_text().split("## Rules", 1)[1].split("\n", 1)[1]  # after the heading's line
    return [" ".join(bullet.split()) for bullet in re.split(r"\n- ", "\n" + section.strip()) if bullet.strip()]


def test_every_rule_cites_tests_that_exist():
    stated = rules()
    assert len(stated) >= 5, stated
    for rule in stated:
        cited = CITATION.findall(rule)
        assert cited, f"this rule of ARCHITECTURE.md cites no test (`tests/x.py::test_name`): {rule[:120]}"
        for path, name in cited:
            source = REPO / path
            assert source.is_file(), f"{path}, cited by the rule {rule[:60]!r}, does not exist"
            defined = {node.name for node in ast.walk(ast.parse(source.read_text()))
                       if isinstance(node, ast.FunctionDef)}
            assert name in defined, f"{path} has no test {name}, cited by the rule {rule[:60]!r}"


def test_the_library_never_imports_devkit():
    """A rule of the layout: devkit/ is what tests and benchmarks share, never a dependency of the library."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] == "devkit"]
    assert not offenders, offenders
