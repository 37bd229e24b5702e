"""The quick tier's promise (`python -m pytest -m quick`, README): every module of leantune/ has code of its own run by
a test, a function or method body beyond the definitions its import makes. A call tracer notes, for each file under
leantune/ that defines a function, the first test that runs one of them; calls made while a module is being imported
do not count. The files are listed when the run starts, so a module added or moved is checked without a change here.

On for the quick tier over the default test paths (`-m quick`; no paths, -k, --lf or --sw), and for any run with
LEANTUNE_QUICK_COVERAGE=1 (=0: off); the run then fails naming the modules no test entered (`-v`: each module with
the test that entered it first). Code run in a child process (a CLI run, torchrun's ranks) is not seen."""

from __future__ import annotations

import ast
import os
import sys
import threading
from pathlib import Path

import pytest

import leantune

PACKAGE = Path(leantune.__file__).parent

# Modules no test here can enter, each with why (relative to leantune/).
UNENTERABLE: dict[str, str] = {}

_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>"})
_NEW_LOCALS = 0x0002  # CO_NEWLOCALS: a function's frame (a module's or class body's code runs in a namespace it is given)
_IMPORTING = "<frozen importlib._bootstrap"


def modules_with_functions(package: Path = PACKAGE) -> dict[str, str]:
    """Each .py file under `package` that defines a function or method (its path -> its name under the package): a
    file of imports and constants has nothing to run beyond its import."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) for node in ast.walk(tree)):
            modules[str(path)] = path.relative_to(package).as_posix()
    return modules


class ModuleEntries:
    """The tracer of one test process: `entered` maps a module to the first test that ran a function of it."""

    def __init__(self, entered: dict[str, str]):
        self.waiting = modules_with_functions()
        self.entered = entered
        self.test = "(no test)"

    def trace(self, frame, event, arg):
        """sys.settrace's call hook: looks up the file of each new frame; returns None, so no line is traced."""
        module = self.waiting.get(frame.f_code.co_filename)
        if module is not None and self._entered_at_run_time(frame):
            del self.waiting[frame.f_code.co_filename]
            self.entered[module] = self.test
        return None

    @staticmethod
    def _entered_at_run_time(frame) -> bool:
        code = frame.f_code
        if not code.co_flags & _NEW_LOCALS or code.co_name in _COMPREHENSIONS:
            return False  # a module or class body, or a comprehension that may run at import
        caller = frame.f_back
        while caller is not None:
            if caller.f_code.co_filename.startswith(_IMPORTING):
                return False  # called while some module was being imported
            caller = caller.f_back
        return True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item):
        self.test = item.nodeid
        if self.waiting and sys.gettrace() is not self.trace:
            sys.settrace(self.trace)  # (again, if a test replaced it)
            threading.settrace(self.trace)
        try:
            return (yield)
        finally:
            if not self.waiting:  # every module entered: the rest of the run untraced
                sys.settrace(None)
                threading.settrace(None)


class QuickTierCheck:
    """The run's verdict, where the tests' results come together (the xdist controller, or the one process)."""

    def __init__(self, entered: dict[str, str]):
        self.entered = entered

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        for module, test in getattr(node, "workeroutput", {}).get("leantune_entered", {}).items():
            self.entered.setdefault(module, test)

    def missing(self) -> list[str]:
        return sorted(set(modules_with_functions().values()) - set(self.entered) - set(UNENTERABLE))

    def pytest_sessionfinish(self, session):
        if self.missing() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, config):
        missing = self.missing()
        terminalreporter.section("leantune modules entered (tests/quick_tier.py)")
        if config.option.verbose > 0:
            for module, test in sorted(self.entered.items()):
                terminalreporter.line(f"{module}  <-  {test}")
            for module, reason in sorted(UNENTERABLE.items()):
                terminalreporter.line(f"{module}  (not entered here: {reason})")
        if missing:
            terminalreporter.line(f"{len(missing)} modules of leantune/ that no test entered: " + ", ".join(missing),
                                  red=True)
        else:
            terminalreporter.line(f"every module entered: {len(self.entered)}, {len(UNENTERABLE)} exceptions")


def is_quick_tier(config) -> bool:
    """`-m quick` over the default test paths, with nothing deselected by keyword, last failures or stepwise."""
    return (config.option.markexpr == "quick" and not config.option.keyword
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not getattr(config.option, "lf", False) and not getattr(config.option, "stepwise", False))


def register(config) -> None:
    """Registers the tracer where tests run and the check where results meet, when the run asks for them."""
    wanted = os.environ.get("LEANTUNE_QUICK_COVERAGE")
    if wanted == "0" or (wanted != "1" and not is_quick_tier(config)) or config.option.collectonly:
        return
    worker = hasattr(config, "workerinput")
    entered = config.workeroutput.setdefault("leantune_entered", {}) if worker else {}
    if worker or getattr(config.option, "dist", "no") == "no":  # a process that runs tests (not xdist's controller)
        config.pluginmanager.register(ModuleEntries(entered), "leantune_module_entries")
    if not worker:
        config.pluginmanager.register(QuickTierCheck(entered), "leantune_quick_tier_check")
