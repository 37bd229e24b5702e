"""The file structure, drawn from the imports: no cycle between files or folders, imports inside functions only for
optional packages, and the floors below.

The graph is read from the source with `ast`: every import statement, at module level and inside functions, with
relative imports and `from package import module` resolved; `if TYPE_CHECKING:` blocks are left out (they never run).

The floors, lowest first; a module imports from its own floor or below, never above (FLOORS):
  0. utils, version.py, methods.py: methods.py is the registry, one `Method` spec per method, data only: it names
     each method's config and trainer classes by path (imported on first use) and imports no other leantune module,
     so every floor above reads it (the trainers their own entry, the planner, the card, the command line).
  1. the techniques, each alone: data, models, losses, memory, metrics, generation, rewards, rollouts, profiling,
     defaults (among them the order is the imports' own: models below losses, data below profiling, ...).
  2. planning: runs whatever trainer class it is given (by the caller, or named in the registry) with fake weights;
     it imports no trainer, so the trainers may call it.
  3. trainers: the configs and trainers; `memory_budget` sizes a run and `plan_check` checks it with the planner
     below. Inside: the trainers' own files (base.py, online_trainer.py, the methods' files, configs) over
     trainers/online (the online round's parts) over trainers/parts (every trainer's parts).
  4. leantune/__init__.py: the exports, named by path.
  5. cli: `leantune <command>`, on top.
Inside any folder the same holds between its own files and each subfolder: no cycle between them.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "leantune"
PACKAGE = "leantune"

# The packages leantune requires (pyproject.toml's dependencies, by import name; and three that transformers and
# datasets require, so always installed), besides the standard library: a function imports none of them, nor any
# leantune module; they are imported once, at the top of a module.
REQUIRED = {"torch", "transformers", "datasets", "accelerate", "peft", "numpy", "tqdm", "yaml", "psutil", "matplotlib",
            "huggingface_hub", "safetensors", "pyarrow"}

# Function-level imports of leantune, required or standard modules kept for a measured reason: (importing module,
# imported module or package) -> the reason. Keep it short: each entry needs its measurement.
FUNCTION_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    # `leantune --help` and a cached `leantune <command> --help` take 0.1 s; the runner imports the configs, so
    # transformers and torch (5.5 s on 2 CPU cores): imported when a command runs.
    ("leantune.cli.main", "leantune.cli.runner"): "the command line's help without torch",
    # the user's help cache: importlib.metadata and hashlib, 41 ms of the 64 ms `import leantune.cli.main` takes
    # with it, for `<command> --help` only
    ("leantune.cli.main", "leantune.cli.help_cache"): "`leantune --help` without the help cache",
    # a `--help` the user's cache does not hold yet is rendered from the configs (5.5 s), once
    ("leantune.cli.main", "leantune.cli.help_render"): "the command line's help without torch",
    # The generation server's HTTP stack is the optional `server` extra (uvicorn, Starlette): the modules that import it
    # are imported when a server is made, so the trainer's client and `vllm_mode="server"` need none of it, and a
    # missing extra is one line naming it (generation/vllm_server.py's require_server_extra, tested)
    ("leantune.generation.vllm_server", "leantune.generation.server_app"): "the optional server extra, when serving",
    ("leantune.generation.vllm_server", "leantune.generation.server_http"): "the optional server extra, when serving",
    # matplotlib's Figure and Agg canvas (0.36 s) only when `leantune profile` draws its figure, not wherever
    # leantune.profiling is imported (the planner's and the trainers' length lines)
    ("leantune.profiling.figure", "matplotlib"): "a figure drawn only when asked for",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Every import of one module: (imported name, line, inside a function)."""

    def __init__(self, name: str, is_package: bool, modules: set[str]):
        self.package = name if is_package else name.rpartition(".")[0]
        self.modules = modules
        self.found: list[tuple[str, int, bool]] = []
        self.depth = 0

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If):
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self.found.append((self._known(alias.name), node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            self.found.append((submodule if submodule in self.modules else self._known(source), node.lineno,
                               self.depth > 0))

    def _known(self, name: str) -> str:
        """A leantune name as its module (the longest prefix that is one); another package's name unchanged."""
        if name.split(".")[0] != PACKAGE:
            return name
        while name not in self.modules and "." in name:
            name = name.rpartition(".")[0]
        return name


def read_imports() -> dict[str, list[tuple[str, int, bool]]]:
    paths = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
    imports = {}
    for name, path in paths.items():
        visitor = _Imports(name, path.name == "__init__.py", set(paths))
        visitor.visit(ast.parse(path.read_text(), str(path)))
        imports[name] = visitor.found
    return imports


IMPORTS = read_imports()
MODULES = set(IMPORTS)


def internal_edges() -> dict[str, set[str]]:
    edges = defaultdict(set)
    for name, found in IMPORTS.items():
        for imported, _, _ in found:
            if imported in MODULES and imported != name:
                edges[name].add(imported)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each as one readable chain: a shortest
    cycle through its first node, and the component's other members after it."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for node in sorted(set(edges) | {n for targets in edges.values() for n in targets}):
        if node not in index:
            visit(node)
    return [_shortest_cycle(component, edges) for component in sorted(components)]


def _shortest_cycle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    start, members = component[0], set(component)
    previous, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    chain = [node]
                    while previous[chain[-1]] is not None:
                        chain.append(previous[chain[-1]])
                    chain = chain[::-1] + [start]
                    rest = sorted(members - set(chain))
                    return chain + ([f"(and {', '.join(rest)})"] if rest else [])
                if nxt in members and nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return component


def _describe(found_cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(chain) for chain in found_cycles)


def folder_edges(folder_of) -> dict[str, set[str]]:
    edges = defaultdict(set)
    for source, targets in internal_edges().items():
        for target in targets:
            pair = folder_of(source, target)
            if pair and pair[0] != pair[1]:
                edges[pair[0]].add(pair[1])
    return edges


def top_level(module: str) -> str:
    """leantune's top-level node of a module: its subpackage (with every folder inside), or a root file as itself;
    leantune/__init__.py is the node `leantune`."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_cycle_between_files():
    found = cycles(internal_edges())
    assert not found, f"{len(found)} import cycles between files:\n{_describe(found)}"


# The floors of the docstring, by top-level node (see `top_level`).
FLOORS = {
    "leantune.utils": 0, "leantune.version": 0, "leantune.methods": 0,
    **{f"leantune.{name}": 1 for name in ("data", "models", "losses", "memory", "metrics", "generation", "rewards",
                                          "rollouts", "profiling", "defaults")},
    "leantune.planning": 2, "leantune.trainers": 3, "leantune": 4, "leantune.cli": 5,
}


def test_every_top_level_node_has_a_floor():
    assert {top_level(name) for name in MODULES} == set(FLOORS)


def test_imports_go_down_the_floors():
    upward = sorted({f"{source} (floor {FLOORS[top_level(source)]}) imports {target} (floor {FLOORS[top_level(target)]})"
                     for source, targets in internal_edges().items() for target in targets
                     if FLOORS.get(top_level(source), -1) < FLOORS.get(top_level(target), -1)})
    assert not upward, f"{len(upward)} imports go up a floor:\n" + "\n".join(upward)


def test_no_cycle_between_top_level_folders():
    found = cycles(folder_edges(lambda source, target: (top_level(source), top_level(target))))
    assert not found, f"{len(found)} import cycles between leantune's folders:\n{_describe(found)}"


def _sibling_folders(source: str, target: str):
    """Within one folder, the node each side belongs to: the folder's own files together, each subfolder whole."""
    source_parts, target_parts = source.split("."), target.split(".")
    source_package = source_parts if source in PACKAGES else source_parts[:-1]
    target_package = target_parts if target in PACKAGES else target_parts[:-1]
    common = []
    for a, b in zip(source_package, target_package):
        if a != b:
            break
        common.append(a)
    if len(common) < 2:  # not inside one of leantune's folders (the top level is checked above)
        return None
    depth = len(common)

    def node(package: list[str]) -> str:
        return ".".join(package[: depth + 1]) if len(package) > depth else ".".join(common) + " (files)"

    return node(source_package), node(target_package)


PACKAGES = {name for name in MODULES if (ROOT.parent / name.replace(".", "/") / "__init__.py").exists()}


def test_no_cycle_between_sibling_folders():
    found = cycles(folder_edges(_sibling_folders))
    assert not found, f"{len(found)} import cycles between folders inside a package:\n{_describe(found)}"


def _is_optional(imported: str) -> bool:
    top = imported.split(".")[0]
    return top != PACKAGE and top not in REQUIRED and top not in sys.stdlib_module_names


def is_allowed_in_function(name: str, imported: str) -> bool:
    return _is_optional(imported) or any(
        name == importer and (imported == allowed or imported.startswith(allowed + "."))
        for importer, allowed in FUNCTION_IMPORTS_ALLOWED)


def test_imports_inside_functions_only_for_optional_packages():
    wrong = sorted({f"{name}:{line} imports {imported}" for name, found in IMPORTS.items()
                    for imported, line, in_function in found
                    if in_function and not is_allowed_in_function(name, imported)})
    assert not wrong, (f"{len(wrong)} imports inside functions of leantune, required or standard modules (import "
                       f"them at the top of the module):\n" + "\n".join(wrong))


def test_every_allowed_function_import_is_still_there():
    """An entry of the allow-list names a function-level import that exists (none is kept after its reason left)."""
    used = {(name, allowed) for name, found in IMPORTS.items() for imported, _, in_function in found if in_function
            for importer, allowed in FUNCTION_IMPORTS_ALLOWED
            if name == importer and (imported == allowed or imported.startswith(allowed + "."))}
    assert set(FUNCTION_IMPORTS_ALLOWED) == used
