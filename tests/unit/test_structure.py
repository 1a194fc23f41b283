"""The shape of the library: small modules, layers that import only downward, no import circles,
plug-in bases that own their contracts, and a map of the packages that is true.

Static checks on the source (no imports run): a newcomer should be able to find each concern
in one file, change it without reading 1,000 lines, and trust docs/architecture.md.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Set, Tuple

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


#: The layers, lowest first: a module imports only modules of its own layer or below, and
#: nothing in a circle (docs/architecture.md describes them). A module's layer is that of the
#: longest name here it starts with.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    (
        "foundation",
        (
            "sparkdl.errors",
            "sparkdl._lazy",
            "sparkdl._version",
            "sparkdl._spark",
            "sparkdl.filesystem",
            "sparkdl.reporting",
            "sparkdl.resources",
        ),
    ),
    ("network", ("sparkdl._net",)),
    ("plug-in wings", ("sparkdl.checkpoint", "sparkdl.data", "sparkdl.strategies", "sparkdl.connectors")),
    ("rank runtime", ("sparkdl._runtime",)),
    ("task context", ("sparkdl.context",)),
    ("task", ("sparkdl._task",)),
    ("driver", ("sparkdl._driver",)),
    (
        "public entry points",
        (
            "sparkdl.estimator",
            "sparkdl.model",
            # Scoring DataFrames and Parquet datasets with a TorchModel: what transform and predict run.
            "sparkdl.inference",
            # Saving the estimator and model for Spark ML and MLflow: beside them, not below.
            "sparkdl._persistence",
            "sparkdl.custom_loop",
            "sparkdl.launching",
            "sparkdl.comparison",
            "sparkdl.planning",
            "sparkdl.tracking",
            "sparkdl.plotting",
        ),
    ),
    ("package", ("sparkdl",)),
    # The command line is a user of the public package (sparkdl.TorchEstimator...), as a script is.
    ("command line", ("sparkdl.cli",)),
]

#: Imports that may run against the layers, each with why. Registries that load an
#: implementation by name would go here; today none does (each plug-in package's ``__init__``
#: imports its built-in implementations, below everything that looks them up).
ALLOWED_UPWARD: Dict[Tuple[str, str], str] = {}

#: Plug-in points: the base module (the contract) and the built-in implementations its package's
#: ``__init__`` registers. The base never imports an implementation.
PLUGINS: Dict[str, Tuple[str, ...]] = {
    "sparkdl.strategies": ("allreduce", "averaging", "sharded", "parameter_server"),
    "sparkdl.data.readers": ("arrow", "petastorm"),
    "sparkdl.checkpoint": ("file_store",),
    "sparkdl.connectors": ("delta", "parquet", "spark_table"),
}


def _imports(tree: ast.Module) -> List[ast.stmt]:
    """Every import statement of a module: at the top, inside functions and classes, and under
    ``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader follows)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _dynamic_imports(tree: ast.Module) -> List[str]:
    """The modules a module imports by name at run time: ``importlib.import_module("sparkdl.x")``
    (also as ``import_module(...)``) and ``__import__("sparkdl.x")``, with a literal name."""
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        first = node.args[0]
        if (
            called in ("import_module", "__import__")
            and isinstance(first, ast.Constant)
            and isinstance(first.value, str)
        ):
            names.append(first.value)
    return names


def _import_graph(root: pathlib.Path = ROOT) -> Dict[str, Set[str]]:
    """Module -> the package modules it names in an import. ``from package import name`` is an
    edge to ``package.name`` when that is a module, else to the package itself (so
    ``from sparkdl import __version__`` depends on the whole package). Imports by name at run
    time (``importlib.import_module``, ``__import__``) count as well."""
    modules = _modules(root)
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        targets: List[str] = list(_dynamic_imports(tree))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets += [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
        for target in targets:
            while target and target not in modules:  # import a.b.c of a non-module c: a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _layer(module: str) -> int:
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


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
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def _upward_imports(graph: Dict[str, Set[str]]) -> List[Tuple[str, str]]:
    """The imports that run against the layers (not allowed by ALLOWED_UPWARD)."""
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if _layer(target) > _layer(module) and (module, target) not in ALLOWED_UPWARD
    )


def _cycle_report(graph: Dict[str, Set[str]]) -> List[str]:
    """One line per import that closes a circle, with one circle it closes. Upward imports are
    the layers test's to report (one upward import closes as many circles as there are ways
    back down): the circles are looked for among the other imports."""
    upward = set(_upward_imports(graph))
    downward = {module: {t for t in targets if (module, t) not in upward} for module, targets in graph.items()}
    closing: Dict[Tuple[str, str], List[str]] = {}
    for cycle in _cycles(downward):
        closing.setdefault((cycle[-2], cycle[-1]), cycle)
    return [f"{a} -> {b} (closes {' -> '.join(cycle)})" for (a, b), cycle in sorted(closing.items())]


def test_no_import_cycles():
    graph = _import_graph()
    assert "sparkdl._driver.settings" in graph["sparkdl.estimator"], "the graph should see the estimator's imports"
    report = _cycle_report(graph)
    assert not report, "imports that close a circle (one line each):\n" + "\n".join(report)


def test_every_module_is_in_a_layer_and_no_import_runs_upward():
    graph = _import_graph()
    upward = [
        f"{module} ({LAYERS[_layer(module)][0]}) -> {target} ({LAYERS[_layer(target)][0]})"
        for module, target in _upward_imports(graph)
    ]
    assert not upward, "imports against the layers (move the code down, or pass what it needs):\n" + "\n".join(upward)
    stale = sorted(pair for pair in ALLOWED_UPWARD if pair[1] not in graph.get(pair[0], ()))
    assert not stale, f"allowed upward imports that no longer exist: {stale}"


def test_plugin_bases_import_no_implementation_and_their_packages_register_them():
    graph = _import_graph()
    for package, implementations in PLUGINS.items():
        names = {f"{package}.{implementation}" for implementation in implementations}
        base = f"{package}.base"
        assert base in graph, f"{package} has no base module"
        reached = _reachable(graph, base)
        assert not reached & names, f"{base} imports implementations {sorted(reached & names)}"
        assert names <= graph[package], (
            f"{package}/__init__.py must import its built-ins: {sorted(names - graph[package])}"
        )


def _reachable(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen: Set[str] = set()
    todo = [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_import_graph_sees_every_import(tmp_path):
    """The checker itself: module level, TYPE_CHECKING and function bodies all count, and an
    import of a package's attribute depends on the package."""
    package = tmp_path / "sparkdl"
    package.mkdir()
    (package / "__init__.py").write_text("VERSION = 1\n")
    (package / "a.py").write_text("from sparkdl import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sparkdl.c\n")
    (package / "c.py").write_text("def f():\n    import sparkdl.a\n")
    (package / "d.py").write_text("from sparkdl import VERSION\nfrom . import a\n")
    (package / "e.py").write_text(
        "import importlib\nfrom importlib import import_module\n"
        "def f():\n    importlib.import_module('sparkdl.a')\n    import_module('sparkdl.b.thing')\n"
        "    __import__('sparkdl.c')\n    importlib.import_module(name_from_elsewhere)\n"
    )
    graph = _import_graph(tmp_path)
    assert graph == {
        "sparkdl": set(),
        "sparkdl.a": {"sparkdl.b"},
        "sparkdl.b": {"sparkdl.c"},
        "sparkdl.c": {"sparkdl.a"},
        "sparkdl.d": {"sparkdl", "sparkdl.a"},
        "sparkdl.e": {"sparkdl.a", "sparkdl.b", "sparkdl.c"},
    }
    assert _cycles(graph) == [["sparkdl.a", "sparkdl.b", "sparkdl.c", "sparkdl.a"]]


def test_one_upward_import_is_one_line_not_a_line_per_circle_it_closes():
    """An upward import closes a circle for every way back down from its target: the layers
    test names it once, and the circle report leaves it out."""
    graph = {
        "sparkdl.errors": set(),
        "sparkdl._runtime.rank": {"sparkdl.errors"},
        "sparkdl._runtime.stream": {"sparkdl.errors", "sparkdl._runtime.rank"},
        "sparkdl._driver.stage": {"sparkdl._runtime.rank", "sparkdl._runtime.stream", "sparkdl.errors"},
    }
    graph["sparkdl.errors"].add("sparkdl._driver.stage")  # dynamic or not, it runs upward
    assert _cycles(graph)  # the circles it closes (on the real tree, one such import closed 80)
    assert _upward_imports(graph) == [("sparkdl.errors", "sparkdl._driver.stage")]
    assert _cycle_report(graph) == []
    graph["sparkdl._runtime.rank"].add("sparkdl._runtime.stream")  # a circle within one layer
    assert _cycle_report(graph) == [
        "sparkdl._runtime.stream -> sparkdl._runtime.rank (closes sparkdl._runtime.rank -> sparkdl._runtime.stream "
        "-> sparkdl._runtime.rank)"
    ]


def test_the_layer_of_a_module_is_its_longest_prefix():
    assert LAYERS[_layer("sparkdl")][0] == "package" and LAYERS[_layer("sparkdl.cli._train")][0] == "command line"
    assert LAYERS[_layer("sparkdl._net.server")][0] == "network"
    assert LAYERS[_layer("sparkdl.strategies.parameter_server.wire")][0] == "plug-in wings"
    assert (
        _layer("sparkdl.errors")
        < _layer("sparkdl._runtime.rank")
        < _layer("sparkdl.context")
        < _layer("sparkdl._task.entry")
    )


def _architecture_packages() -> Set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    match = re.search(r"^## Packages\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, "docs/architecture.md needs a '## Packages' section"
    return set(re.findall(r"^\| `(sparkdl[\w.]*)` \|", match.group(1), re.M))


def test_the_architecture_page_names_every_package_and_nothing_else():
    """A newcomer finds a thing from the tree; docs/architecture.md's table says what each
    package is for. Every package is in it, and every name in it exists."""
    modules = _modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    described = _architecture_packages()
    missing, stale = sorted(packages - described), sorted(described - set(modules))
    assert not missing and not stale, (
        f"docs/architecture.md: packages not described {missing}; described but absent {stale}"
    )


def test_the_top_level_holds_public_modules_and_few_private_ones():
    """Issue #30: the top level was 37 modules side by side. Private code lives in role packages
    (_net, _runtime, _task, _driver); the top level keeps the public modules and a few
    foundation ones."""
    top = sorted(p.stem for p in (ROOT / "sparkdl").glob("*.py") if p.stem != "__init__")
    private = [name for name in top if name.startswith("_")]
    assert len(top) <= 16 and len(private) <= 4, f"top-level modules: {top}"
