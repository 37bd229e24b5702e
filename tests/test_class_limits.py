"""Every class in leantune/ stays small enough to read: at most 300 lines and 25 methods (each function defined in
its body counts, properties and their setters too). A class that grows past either limit has a concern of its own
to move into a part, not lines to squeeze."""

from __future__ import annotations

import ast
import pathlib

import leantune

MAX_LINES = 300
MAX_METHODS = 25
PACKAGE = pathlib.Path(leantune.__file__).parent


def class_sizes(root: pathlib.Path = PACKAGE) -> dict[str, tuple[int, int]]:
    """{"path:Class": (lines, methods)} of every class (nested ones too) under `root`."""
    sizes = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
                sizes[f"{path.relative_to(root.parent)}:{node.name}"] = (node.end_lineno - node.lineno + 1, methods)
    return sizes


def test_the_counter_counts_lines_and_methods(tmp_path):
    (tmp_path / "sample.py").write_text(
        "class A:\n"
        "    x = 1\n\n"
        "    def f(self):\n        pass\n\n"
        "    @property\n    def p(self):\n        return 1\n\n"
        "    @p.setter\n    def p(self, value):\n        pass\n\n"
        "    class B:\n        async def g(self):\n            pass\n")
    sizes = class_sizes(tmp_path)
    assert sizes == {f"{tmp_path.name}/sample.py:A": (17, 3), f"{tmp_path.name}/sample.py:B": (3, 1)}


def test_no_class_over_the_limits():
    sizes = class_sizes()
    assert len(sizes) > 100  # the scan reads the package
    over = {name: size for name, size in sizes.items() if size[0] > MAX_LINES or size[1] > MAX_METHODS}
    assert not over, (f"classes over {MAX_LINES} lines or {MAX_METHODS} methods (lines, methods): {over}; move a "
                      "concern of the class into a part that gets only what it needs")
