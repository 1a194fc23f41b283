"""The shape of the library: small modules, no import cycles, and a README layout that is true.

Static checks on the source (no imports run): a newcomer should be able to find each concern
in one file, change it without reading 1,000 lines, and trust the README's map of the tree.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: "No module in sparkdl/ over ~450 lines" (issue #13).
MAX_LINES = 450


def _modules(root: pathlib.Path = ROOT) -> Dict[str, pathlib.Path]:
    """Dotted name -> file of every module of ``root/sparkdl`` (``__init__`` files as the package)."""
    modules = {}
    for path in sorted((root / "sparkdl").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _module_level_imports(tree: ast.Module) -> List[ast.stmt]:
    """Import statements that run when the module is imported: top level and inside top-level
    ``try``/``if`` blocks, except ``if TYPE_CHECKING:`` (those never run)."""
    found: List[ast.stmt] = []

    def visit(statements: List[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return found


def _import_graph(root: pathlib.Path = ROOT) -> Dict[str, Set[str]]:
    """Module -> the package modules it imports when it is imported."""
    modules = _modules(root)
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _module_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                # A module's own packages are initialized before it runs: those edges are not cycles.
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def test_no_module_is_longer_than_the_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every cycle a depth-first walk meets, as the path that closes it."""
    cycles: List[List[str]] = []
    state: Dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycles():
    graph = _import_graph()
    assert "sparkdl._settings" in graph["sparkdl.estimator"], "the graph should see the estimator's imports"
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_import_graph_sees_module_level_imports_only(tmp_path):
    """The checker itself: what runs at import counts; TYPE_CHECKING and function bodies do not."""
    package = tmp_path / "sparkdl"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from sparkdl import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nimport sparkdl.a\nif TYPE_CHECKING:\n    import sparkdl.c\n")
    (package / "c.py").write_text("def f():\n    import sparkdl.a\n")
    graph = _import_graph(tmp_path)
    assert graph == {"sparkdl": set(), "sparkdl.a": {"sparkdl.b"}, "sparkdl.b": {"sparkdl.a"}, "sparkdl.c": set()}
    assert _cycles(graph) == [["sparkdl.a", "sparkdl.b", "sparkdl.a"]]


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## Layout\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "README.md needs a '## Layout' section"
    return match.group(1)


def _described(layout: str) -> Set[str]:
    """The files the layout table describes: a row's own path, and the ``file.py`` names a
    package row (``sparkdl/cli/``) lists in its text."""
    described: Set[str] = set()
    for path, text in re.findall(r"^\| `(sparkdl/[\w/.]*)` \| (.*) \|$", layout, re.M):
        if path.endswith("/"):
            described.add(path + "__init__.py")
            described.update(path + name for name in re.findall(r"`(\w+\.py)`", text))
        else:
            described.add(path)
    return described


def test_the_readme_layout_names_every_module_and_nothing_else():
    described = _described(_readme_layout())
    actual = {path.relative_to(ROOT).as_posix() for path in _modules().values()}
    missing, stale = sorted(actual - described), sorted(described - actual)
    assert not missing and not stale, f"README layout: not described {missing}; described but absent {stale}"
