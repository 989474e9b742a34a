"""The whole import graph of memlens and the dashboard: no cycle at all, and faces that never
import each other.

Unlike ``tests/test_import_cycles.py`` (what runs at import time), every import counts here: at
module level, under ``if TYPE_CHECKING:``, and inside functions. A type-only cycle still says two
modules know each other's insides (``analysis.analysis`` <-> ``analysis.live`` was one), and a
function-local import is a dependency too, only a later one.

The faces are the terminal (``memlens.cli``, with ``memlens.__main__``), the dashboard
(``memlens_app``, the ``app/`` folder), the MCP server (``memlens.mcp_server``) and the framework
integrations (``memlens.integrations``). Each may import the service layer (``memlens.ops``), the
renderers (``memlens.reporters``, ``memlens.figures``) and the engine, never another face, and
nothing else imports a face. One kind of edge is allowed, by name: the command that starts another
face (``memlens serve``, ``memlens mcp``) imports that face's entry point, and only it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.test_import_cycles import _resolve_relative, find_cycle, module_names

# Installed package name -> its folder in the repository (setup.cfg's package_dir).
PACKAGES = {"memlens": REPO_ROOT / "memlens", "memlens_app": REPO_ROOT / "app"}

FACES = {
    "memlens.cli": "the terminal",
    "memlens.__main__": "the terminal",
    "memlens_app": "the dashboard",
    "memlens.mcp_server": "the MCP server",
    "memlens.integrations": "the integrations",
}

# (importer, imported module) -> the names it may take from there: a face's start, nothing more.
LAUNCHES: dict[tuple[str, str], frozenset[str]] = {
    ("memlens.cli.serve", "memlens_app.main"): frozenset({"create_app", "DEFAULT_SAMPLE_DIR"}),
    # The analyses' forkserver and the library, started while the dashboard's modules import (issue 37).
    ("memlens.cli.serve", "memlens_app.start"): frozenset({"start_workers", "new_library"}),
    ("memlens.cli.mcp", "memlens.mcp_server"): frozenset({"serve"}),
}


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Every module by dotted name (a package by its ``__init__.py``), over several packages."""
    found: dict[str, Path] = {}
    for package, folder in packages.items():
        found |= module_names(folder, package)
    return found


def imports(tree: ast.Module, name: str, is_package: bool, known: dict[str, Path]) -> Iterator[tuple[str, set[str]]]:
    """Every import in the file, anywhere in it: (the module imported, the names taken from it).

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b`` (taking
    ``c``); ``import a.b`` is an edge to ``a.b``. Parent packages a submodule import also runs are
    left out, as in ``test_import_cycles``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, set()
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_relative(name, is_package, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield (submodule, set()) if submodule in known else (source, {alias.name})


def full_graph(packages: dict[str, Path]) -> dict[str, dict[str, set[str]]]:
    """Module -> {module of ours it imports anywhere: the names it takes from it}."""
    known = modules(packages)
    graph: dict[str, dict[str, set[str]]] = {name: {} for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target, names in imports(tree, name, path.name == "__init__.py", known):
            if target in known and target != name:
                graph[name].setdefault(target, set()).update(names)
    return graph


def face_of(module: str) -> str | None:
    for prefix, face in FACES.items():
        if module == prefix or module.startswith(prefix + "."):
            return face
    return None


def face_violations(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """Each import from one face into another, or into a face from outside the faces."""
    found = []
    for importer, targets in sorted(graph.items()):
        for target, names in sorted(targets.items()):
            theirs, ours = face_of(target), face_of(importer)
            if theirs is None or theirs == ours:
                continue
            allowed = LAUNCHES.get((importer, target))
            if allowed is not None and names and names <= allowed:
                continue
            taken = f" ({', '.join(sorted(names))})" if names else ""
            found.append(f"{importer} ({ours or 'not a face'}) imports {target}{taken} ({theirs})")
    return found


GRAPH = full_graph(PACKAGES)


def test_the_graph_sees_both_packages_and_every_kind_of_import() -> None:
    # Guards the test: a walker that missed the app, type-only or function-local imports would pass.
    assert "memlens_app.panels.ranks" in GRAPH and "memlens.ops.fleet" in GRAPH
    assert "memlens.ops.fleet" in GRAPH["memlens_app.panels.ranks"]  # module level
    assert "memlens.ops.fleet" in GRAPH["memlens.cli.fleet"]  # inside the command's function too
    assert "memlens.analysis.analysis" in GRAPH["memlens.ops.triage"]  # under TYPE_CHECKING
    assert GRAPH["memlens.cli.serve"]["memlens_app.main"] == {"create_app", "DEFAULT_SAMPLE_DIR"}


def test_a_type_only_or_function_local_cycle_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (package / "b.py").write_text("def f():\n    from pkg import a\n")
    assert find_cycle({m: set(t) for m, t in full_graph({"pkg": package}).items()}) == ["pkg.a", "pkg.b", "pkg.a"]


def test_no_import_cycle_in_memlens_or_the_dashboard_counting_every_import() -> None:
    cycle = find_cycle({module: set(targets) for module, targets in GRAPH.items()})
    assert cycle is None, "import cycle (any import counts): " + " -> ".join(cycle or [])


@pytest.mark.parametrize(("importer", "target", "names", "wrong"), [
    ("memlens.mcp_server", "memlens.cli.common", {"json_text"}, True),
    ("memlens.cli.triage", "memlens_app.library", set(), True),
    ("memlens.ops.fleet", "memlens.cli.common", {"json_text"}, True),  # nothing outside imports a face
    ("memlens.cli.serve", "memlens_app.main", {"create_app"}, False),  # starting the dashboard
    ("memlens.cli.serve", "memlens_app.main", {"Library"}, True),  # ... and only that
    ("memlens.cli.fleet", "memlens.ops.fleet", {"triage_fleet"}, False),
    ("memlens_app.panels.ranks", "memlens.figures.ranks", {"ranks_figure"}, False),
])
def test_the_face_rule(importer: str, target: str, names: set[str], wrong: bool) -> None:
    assert bool(face_violations({importer: {target: names}})) == wrong


def test_the_faces_never_import_each_other() -> None:
    violations = face_violations(GRAPH)
    assert not violations, "a face imports another face:\n  " + "\n  ".join(violations)
