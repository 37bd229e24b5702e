"""The quick tier's check (tests/quick_tier.py) on a module of its own: what counts as entering a module, and which
files have anything to enter."""

from __future__ import annotations

import importlib
import sys

import pytest

from .quick_tier import ModuleEntries, modules_with_functions

pytestmark = pytest.mark.quick

PROBE = '''
def helper():
    return 1


CONSTANT = helper()  # runs while the module is imported: not an entry
SQUARES = [i * i for i in range(3)]


class Holder:
    size = 2

    def method(self):
        return [i for i in range(self.size)]
'''


def test_a_module_is_entered_by_a_function_run_after_its_import_not_by_the_import(tmp_path, monkeypatch):
    (tmp_path / "quick_tier_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(tmp_path)
    entries = ModuleEntries({})
    entries.waiting = modules_with_functions(tmp_path)
    entries.test = "the probe's test"
    previous = sys.gettrace()
    sys.settrace(entries.trace)
    try:
        module = importlib.import_module("quick_tier_probe")
        after_import = dict(entries.entered)
        module.Holder().method()
    finally:
        sys.settrace(previous)
        sys.modules.pop("quick_tier_probe", None)
    assert after_import == {}
    assert entries.entered == {"quick_tier_probe.py": "the probe's test"} and not entries.waiting


def test_files_without_a_function_have_nothing_to_enter(tmp_path):
    package = tmp_path / "package"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("from .inner.work import run\n")
    (package / "constants.py").write_text("LIMIT = 3\n")
    (package / "inner" / "work.py").write_text("def run():\n    return 1\n")
    (package / "inner" / "shapes.py").write_text("class Shape:\n    def area(self):\n        return 0\n")
    assert sorted(modules_with_functions(package).values()) == ["inner/shapes.py", "inner/work.py"]
