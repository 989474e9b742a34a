"""The layers of the house, as rules over the whole import graph (issue 35).

``tests/test_import_graph.py`` already forbids any cycle between modules and any import between
faces. These rules are about packages: two packages that import each other, in whichever modules,
are one package in two folders, and a newcomer cannot tell which of them a change belongs in.
Every import counts (module level, ``if TYPE_CHECKING:``, inside functions), as there.
"""

from __future__ import annotations

from collections import defaultdict

from tests.test_import_graph import GRAPH


def package_of(module: str) -> str:
    """The room a module lives in: ``memlens.snapshot.reader`` -> ``memlens.snapshot``; a module
    at the top of memlens (``memlens.units``) is a room of its own; the dashboard is one room."""
    parts = module.split(".")
    if parts[0] == "memlens_app":
        return "memlens_app"
    return ".".join(parts[:2])


def package_edges(graph: dict[str, dict[str, set[str]]]) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the module imports behind that edge."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for importer, targets in graph.items():
        for target in targets:
            ours, theirs = package_of(importer), package_of(target)
            if ours != theirs and ours != "memlens" and theirs != "memlens":
                edges[(ours, theirs)].append(f"{importer} -> {target}")
    return edges


def packages_both_ways(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """Each pair of packages that import each other, with the imports each way."""
    edges = package_edges(graph)
    found = []
    for (ours, theirs), forward in sorted(edges.items()):
        backward = edges.get((theirs, ours))
        if backward and ours < theirs:
            found.append(f"{ours} <-> {theirs}: {'; '.join(sorted(forward)[:3])} | {'; '.join(sorted(backward)[:3])}")
    return found


def test_the_rule_finds_a_pair_that_leans_both_ways() -> None:
    # Guards the rule itself: two modules of different packages importing each other's package.
    graph = {"memlens.a.x": {"memlens.b.y": set()}, "memlens.b.z": {"memlens.a.w": set()}, "memlens.a.w": {}}
    expected = "memlens.a <-> memlens.b: memlens.a.x -> memlens.b.y | memlens.b.z -> memlens.a.w"
    assert packages_both_ways(graph) == [expected]
    assert packages_both_ways({"memlens.a.x": {"memlens.b.y": set()}}) == []
    assert package_of("memlens_app.panels.live") == "memlens_app" and package_of("memlens.units") == "memlens.units"


def test_no_two_packages_import_each_other() -> None:
    """snapshot <-> allocator, snapshot <-> sidecar and ops <-> plan each leaned both ways before
    the second pass; the package ``memlens`` itself (its typed front door) is left out, as every
    package is below it."""
    pairs = packages_both_ways(GRAPH)
    assert not pairs, "packages that import each other:\n  " + "\n  ".join(pairs)


# ---------------------------------------------------------------- the sidecar's one home
# (issue 35, the sidecar and record's options): the sidecar's format, reader and writer live in
# memlens.sidecar, which the snapshot reader and model import; it imports nothing of them back.


def sidecar_imports_of_the_snapshot(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """Each import, anywhere in a module of ``memlens.sidecar``, of a module of ``memlens.snapshot``."""
    return sorted(f"{importer} -> {target}" for importer, targets in graph.items()
                  if package_of(importer) == "memlens.sidecar"
                  for target in targets if package_of(target) == "memlens.snapshot")


def test_the_sidecar_imports_nothing_of_the_snapshot() -> None:
    """Before: memlens.sidecar (one module) took LeakHolders and read_leak_holders from
    memlens.snapshot.holder_types, while memlens.snapshot.model and .reader import memlens.sidecar;
    the holder types now live in memlens.sidecar.leak_holders."""
    assert sidecar_imports_of_the_snapshot({"memlens.sidecar.reader": {"memlens.snapshot.scan": set()}}) == [
        "memlens.sidecar.reader -> memlens.snapshot.scan"]
    assert "memlens.sidecar" in GRAPH["memlens.snapshot.model"]  # the reader's side still imports it
    found = sidecar_imports_of_the_snapshot(GRAPH)
    assert not found, "the sidecar imports the snapshot:\n  " + "\n  ".join(found)
