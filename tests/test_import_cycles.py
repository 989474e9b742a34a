"""No import cycles inside ``memlens/``: the module-level import graph is acyclic.

The graph is read from the source with ``ast``, not by importing anything, so a cycle that
happens to import fine in today's order (because a name is defined before the cycle comes
back) is still caught. An edge is an import executed when the module is imported:

- counted: imports at module level, including inside module-level ``if``/``try``/``with`` blocks;
- not counted: imports inside functions or classes (run later, when called) and imports under
  ``if TYPE_CHECKING:`` (never run).

``from memlens.x import y`` is an edge to ``memlens.x.y`` when ``y`` is a submodule, else to
``memlens.x`` itself. Importing ``memlens.x.y`` also runs ``memlens/x/__init__.py``; those
implicit parent-package edges are left out, as every package's submodules importing their
siblings by full name would otherwise read as a cycle through ``__init__``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGE = "memlens"


def module_names(package_dir: Path, package: str | None = None) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``); ``package``:
    the name it installs as, when that is not its folder's (``app/`` is ``memlens_app``)."""
    package = package or package_dir.name
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    # A compiled extension (memlens._native, memlens._scan) is a leaf module, known by its type
    # stub: an import of it is an edge to it, not to its package.
    for stub in sorted(package_dir.rglob("*.pyi")):
        modules.setdefault(".".join([package, *stub.relative_to(package_dir).with_suffix("").parts]), stub)
    return modules


def _is_type_checking_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements run when the module is imported (see the module docstring)."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking_guard(node.test):
                pending.extend(node.body)
            pending.extend(node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend(node.body)
            pending.extend(node.orelse)
            pending.extend(node.finalbody)
            for handler in node.handlers:
                pending.extend(handler.body)
        elif isinstance(node, ast.With):
            pending.extend(node.body)


def _resolve_relative(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports at module level."""
    modules = module_names(package_dir)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in module_level_imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve_relative(name, is_package, node)
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in modules else source)
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a closed path ``[a, b, ..., a]``, or ``None`` when the graph is acyclic."""
    visiting: list[str] = []
    on_path: set[str] = set()
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        visiting.append(node)
        on_path.add(node)
        for target in sorted(graph[node]):
            if target in on_path:
                return [*visiting[visiting.index(target):], target]
            if target not in done:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        visiting.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None


def test_graph_sees_the_package() -> None:
    # Guards the test itself: a walker that found no modules or no edges would pass vacuously.
    graph = import_graph(REPO_ROOT / PACKAGE)
    assert "memlens.analysis.report" in graph
    assert "memlens.analysis.lifetimes" in graph["memlens.analysis.categories"]
    # ``from memlens.analysis import fragmentation`` names a submodule, not the package.
    assert "memlens.analysis.fragmentation" in graph["memlens.analysis.oom"]


def test_find_cycle_reports_the_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "leaf.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import mod\n")
    (package / "sub" / "mod.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..leaf import x\n"
        "if TYPE_CHECKING:\n    from pkg.sub import other\n"
        "def f():\n    import pkg.sub\n"
    )
    (package / "sub" / "other.py").write_text("from .mod import y\n")
    graph = import_graph(package)
    assert graph["pkg.sub"] == {"pkg.sub.mod"}
    assert graph["pkg.sub.mod"] == {"pkg.leaf"}
    assert graph["pkg.sub.other"] == {"pkg.sub.mod"}
    assert find_cycle(graph) is None
    (package / "leaf.py").write_text("import pkg.sub.other\n")
    assert find_cycle(import_graph(package)) == ["pkg.leaf", "pkg.sub.other", "pkg.sub.mod", "pkg.leaf"]


def test_memlens_has_no_import_cycles() -> None:
    cycle = find_cycle(import_graph(REPO_ROOT / PACKAGE))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _all_imports(tree: ast.Module) -> Iterator[str]:
    """Every module named by any import in the file: module level, in functions, type-only."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


# The report is plain data: what draws or prints it needs nothing of the snapshot it came from.
REPORT_ONLY = ("memlens/reporters", "memlens/figures", "memlens/analysis/report.py",
               "memlens/analysis/datatypes.py")
# A kernel on plain arrays that the snapshot's extension happens to hold (each pixel column's
# minimum and maximum row): the timeline figure bounds a zoomed range's points with it. It reads
# no snapshot, so a figure that calls it still takes a Report alone.
ARRAY_KERNELS = frozenset(("memlens.snapshot.envelope", "memlens.snapshot.envelope.envelope_rows"))


def test_reporters_and_figures_read_the_report_alone() -> None:
    checked = 0
    for prefix in REPORT_ONLY:
        root = REPO_ROOT / prefix
        for path in ([root] if root.is_file() else sorted(root.rglob("*.py"))):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            bad = sorted({name for name in _all_imports(tree) if name not in ARRAY_KERNELS and (
                name == "memlens.snapshot" or name.startswith("memlens.snapshot.")
                or name.startswith(("memlens.analysis.analysis", "memlens.analysis.live", "memlens.analysis.views")))})
            assert not bad, f"{path.relative_to(REPO_ROOT)} imports {bad}: take a Report, not a snapshot"
            checked += 1
    assert checked >= 8  # the walker found the files it guards
