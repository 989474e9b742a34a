"""The layers of the house, as rules over the whole import graph (issue 35).

``tests/test_import_graph.py`` already forbids any cycle between modules and any import between
faces. These rules are about packages: two packages that import each other, in whichever modules,
are one package in two folders, and a newcomer cannot tell which of them a change belongs in.
Every import counts (module level, ``if TYPE_CHECKING:``, inside functions), as there.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from tests.conftest import REPO_ROOT
from tests.test_import_graph import GRAPH, face_of


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
    graph: dict[str, dict[str, set[str]]] = {
        "memlens.a.x": {"memlens.b.y": set()}, "memlens.b.z": {"memlens.a.w": set()}, "memlens.a.w": {},
    }
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


# ---------------------------------------------------------------- the snapshot's native door
# (issue 35, snapshot <-> allocator and the limits declared twice): the snapshot's kernels are an
# extension of their own (memlens.snapshot._kernels, src/native/snapshot_kernels.cpp) behind the
# snapshot's door (memlens.snapshot.engine); the rules and settings both packages read live in the
# snapshot (block_rules, allocator_settings); the allocator, which replays snapshots, imports them.
# Every number both C++ and Python hold to is declared once in Python, written into a header by
# CMake (src/native/generate_constants.py) and given back by each extension as DECLARED.

# The Python modules each number is declared in, and the extensions built from them.
DECLARATIONS = {
    "memlens.snapshot.limits": ("memlens._scan",),
    "memlens.snapshot.block_rules": ("memlens._native", "memlens.snapshot._kernels"),
    "memlens.allocator.constants": ("memlens._native",),
    "memlens.snapshot.model.Action": ("memlens._native", "memlens.snapshot._kernels"),
}


def snapshot_imports_of_the_allocator(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """Each import, anywhere in a module of ``memlens.snapshot``, of a module of ``memlens.allocator``."""
    return sorted(f"{importer} -> {target}" for importer, targets in graph.items()
                  if package_of(importer) == "memlens.snapshot"
                  for target in targets if package_of(target) == "memlens.allocator")


def test_the_snapshot_never_imports_the_allocator() -> None:
    """Before: blocks, curves, ahead and reader imported memlens.allocator.engine, .settings and
    .simulator (the snapshot's kernels sat in the allocator's extension, memlens._native), while
    the allocator's fidelity, initial_state, releases and replay import the snapshot."""
    assert snapshot_imports_of_the_allocator({"memlens.snapshot.blocks": {"memlens.allocator.engine": set()}}) == [
        "memlens.snapshot.blocks -> memlens.allocator.engine"]
    assert "memlens.snapshot.model" in GRAPH["memlens.allocator.replay"]  # the allocator still reads snapshots
    found = snapshot_imports_of_the_allocator(GRAPH)
    assert not found, "the snapshot imports the allocator:\n  " + "\n  ".join(found)


def _python_value(qualified: str) -> int:
    """``memlens.snapshot.limits.MAX_DEVICES`` (or ``...model.Action.ALLOC``, ``...Action.__len__``)."""
    import importlib

    owner, _, name = qualified.rpartition(".")
    module_name, _, class_name = owner.rpartition(".")
    try:
        holder: object = importlib.import_module(owner)
    except ImportError:
        holder = getattr(importlib.import_module(module_name), class_name)
    if name == "__len__":
        return len(holder)  # type: ignore[arg-type]
    value = getattr(holder, name)
    return int(value)


def _declared_in_python(declaration: str) -> dict[str, int]:
    """The integer constants ``declaration`` (a module, or an enum class) declares, by qualified name."""
    import importlib
    import re

    try:
        holder: object = importlib.import_module(declaration)
        items: list[tuple[str, object]] = list(vars(holder).items())
    except ImportError:
        module_name, _, class_name = declaration.rpartition(".")
        enum_class = getattr(importlib.import_module(module_name), class_name)
        items = [(member.name, int(member)) for member in enum_class]
        items.append(("__len__", len(enum_class)))
    return {f"{declaration}.{name}": value for name, value in items
            if (re.fullmatch(r"[A-Z][A-Z0-9_]*", name) or name == "__len__")
            and isinstance(value, int) and not isinstance(value, bool)}


def test_each_extension_was_built_from_the_python_declarations() -> None:
    """Every constant an extension was built with (its DECLARED) is the Python side's, and every
    constant a declaration holds reached each extension built from it: a number changed on one
    side only, or an extension not rebuilt since, fails here. Before: the numbers were written
    twice (caching_allocator.hpp and allocator/simulator.py, pickle_scan.hpp and snapshot/scan.py
    and validate.py, bindings.cpp's action codes and snapshot.model.Action), and no extension
    had a DECLARED."""
    import importlib

    import pytest

    from memlens.snapshot.engine import pure_python_requested

    if pure_python_requested():
        pytest.skip("MEMLENS_PURE_PYTHON: the extensions are not used")
    built: dict[str, dict[str, int]] = {}
    for extension in sorted({name for names in DECLARATIONS.values() for name in names}):
        try:
            built[extension] = dict(importlib.import_module(extension).DECLARED)
        except ImportError:
            pytest.skip(f"{extension} is not built")
    differ = [f"{extension}: {name} = {value}, Python says {_python_value(name)}"
              for extension, declared in built.items() for name, value in sorted(declared.items())
              if _python_value(name) != value]
    missing = [f"{extension} lacks {name}" for declaration, extensions in DECLARATIONS.items()
               for name in _declared_in_python(declaration) for extension in extensions
               if name not in built[extension]]
    assert not differ and not missing, "\n  ".join(["the two sides differ:", *differ, *missing])


def test_no_cpp_source_declares_a_generated_constant_again() -> None:
    """The headers CMake writes are the C++ side's only declaration of those numbers: a
    ``constexpr`` of the same name in src/native would be a second one (the test above sees only
    the generated copy)."""
    import re
    import runpy

    from tests.conftest import REPO_ROOT

    cpp_name = runpy.run_path(str(REPO_ROOT / "src" / "native" / "generate_constants.py"))["_cpp_name"]
    generated = {cpp_name(qualified.rpartition(".")[2]) for declaration in DECLARATIONS
                 for qualified in _declared_in_python(declaration) if not qualified.endswith(".__len__")}
    generated.add("kActionCount")
    again = []
    for source in sorted((REPO_ROOT / "src" / "native").glob("*.[ch]pp")):
        for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            for name in re.findall(r"\bconstexpr\b[^=;(]*?\b(k[A-Z]\w*)\s*=", line):
                if name in generated:
                    again.append(f"{source.name}:{number}: {line.strip()}")
    assert not again, "declared again in C++:\n  " + "\n  ".join(again)


# ---------------------------------------------------------------- ops, the thin door for plan, predict and fleet
# (issue 35, ops <-> plan): the machinery (each configuration's process, the signals, the run
# written, the fleet's rows and verdicts) lives below the service layer, in memlens.plan,
# memlens.predict and memlens.fleet; memlens.ops imports them and they never import it. Results
# flow down to the renderers as typed values: memlens.reporters and memlens.figures never reach
# up into memlens.ops either.


def imports_into(graph: dict[str, dict[str, set[str]]], importers: tuple[str, ...], imported: str) -> list[str]:
    """Each import, anywhere in a module of one of the ``importers`` packages, of a module of ``imported``."""
    return sorted(f"{importer} -> {target}" for importer, targets in graph.items()
                  if package_of(importer) in importers
                  for target in targets if package_of(target) == imported)


def test_the_rule_finds_an_engine_import_of_ops() -> None:
    # Guards the rule: a function-local import of the service from the plan's child, as it was.
    graph: dict[str, dict[str, set[str]]] = {
        "memlens.plan.child": {"memlens.ops.predict": set(), "memlens.predict.written": set()},
    }
    assert imports_into(graph, ("memlens.plan",), "memlens.ops") == ["memlens.plan.child -> memlens.ops.predict"]
    assert "memlens.plan.planner" in GRAPH["memlens.ops.plan"]  # the door still calls the engine


def test_plan_and_predict_never_import_ops() -> None:
    """Before: memlens.plan (its callable package), plan.child and plan.preload imported
    memlens.ops.plan and memlens.ops.predict, which imported the plan's child and processes."""
    found = imports_into(GRAPH, ("memlens.plan", "memlens.predict"), "memlens.ops")
    assert not found, "the plan or predict imports the service layer:\n  " + "\n  ".join(found)


def test_the_fleet_never_imports_ops() -> None:
    """The fleet's typed rows, statistics and verdicts (memlens.fleet) sit below the fleet service."""
    found = imports_into(GRAPH, ("memlens.fleet",), "memlens.ops")
    assert not found, "the fleet's rows or verdicts import the service layer:\n  " + "\n  ".join(found)


def test_renderers_never_import_ops() -> None:
    """Before: reporters.fleet imported memlens.ops.fleet (FleetReport, RankRow, no_outlier_verdict),
    figures.ranks memlens.ops.fleet (RanksSideBySide), reporters.diff memlens.ops.diff and
    reporters.group memlens.ops.group (the answers' types)."""
    found = imports_into(GRAPH, ("memlens.reporters", "memlens.figures"), "memlens.ops")
    assert not found, "a renderer imports the service layer:\n  " + "\n  ".join(found)


# ---------------------------------------------------------------- the faces reach the engine only through ops
# (issue 35, the faces' piece): the terminal, the dashboard, the MCP server and the integrations
# ask each question of the service layer (memlens.ops: one call per question) and render its answer
# with the renderers. Beside those two, a face may import only what is listed below: modules whose
# every name a face may take (None), or the few names, mostly result types, it may take from an
# engine module. A call into the analysis, the lenses, the simulator, the reader or the exporter
# goes through an ops function.

FACE_MAY_IMPORT: dict[str, tuple[frozenset[str] | None, str]] = {
    "memlens.ops": (None, "the service layer: one typed call per question a user asks"),
    "memlens.reporters": (None, "the renderers: a typed answer as terminal text, JSON or HTML"),
    "memlens.figures": (None, "the renderers: a typed answer as a plotly figure"),
    "memlens.errors": (None, "the one error hierarchy, which a face catches and words"),
    "memlens.units": (None, "sizes, counts and capacities parsed and printed alike on every face"),
    "memlens.files": (None, "a file opened once and checked before anything reads it; stdout's failures"),
    "memlens.printable": (None, "a snapshot's strings made safe for a terminal"),
    "memlens._version": (None, "the version a face shows"),
    "memlens.analysis.report": (None, "the report: plain dataclasses, and their own words, that a face renders"),
    "memlens.analysis.datatypes": (None, "the report's leaf types (Finding, Timeline, Step)"),
    "memlens.analysis.analysis": (frozenset({"Analysis"}),
                                  "the analysed file a face keeps between questions and hands back to ops"),
    "memlens.analysis.live": (frozenset({"LiveBreakdown"}), "the type of what ops.group.live answers"),
    "memlens.analysis.lenses.groups": (frozenset({"GroupBreakdown"}), "the type of a grouping ops.group answers"),
    "memlens.analysis.lenses.moments": (frozenset({"MomentSpec", "Window"}),
                                        "the typed moments ops.moments makes from text or rows"),
    "memlens.analysis.lenses.rules": (frozenset({"Rule"}), "the type of a rule ops.group reads"),
    "memlens.allocator.replay": (frozenset({"RunFigures", "SimulatedFigures"}),
                                 "the types of the figures a what-if replay (ops.whatif) answers"),
    "memlens.budget": (frozenset({"Reconciliation", "render_budget"}),
                       "the type ops.budget reconciles into, and the budget's text, a renderer in "
                       "memlens.budget's public API"),
    "memlens.sidecar": (None, "the recorder's sidecar as a file (its name, size limit, type and one reader): "
                              "the dashboard vets an upload before pairing it; its numbers reach the budget "
                              "only through ops.budget"),
    "memlens.snapshot.reader": (frozenset({"GZIP_MAX_RATIO", "GZIP_MIN_LIMIT"}),
                                "the reader's inflation limits, which the dashboard applies to a zip's members"),
    "memlens.recorder": (None, "recording happens in the user's own process: `memlens record` and the "
                               "integrations start the recorder; no question about a file is asked"),
}

# (importer, imported module) -> why: the one face module that may go below ops, and only there.
HEAD_START = "the program's first lines: the file is hashed or scanned on another thread before click, ops and " \
             "the command are imported, so it cannot wait for them"
FACE_MAY_IMPORT_HERE: dict[tuple[str, str], str] = {
    ("memlens.cli.head_start", "memlens.snapshot.ahead"): HEAD_START,
    ("memlens.cli.head_start", "memlens.snapshot.formats"): HEAD_START,
    ("memlens.cli.head_start", "memlens.cache_folder"): HEAD_START,
}


def _allowed_for_faces(target: str) -> frozenset[str] | None:
    """The names a face may take from ``target``: None for any, else those (none for a module
    not listed); a whole module (``import a.b``, ``from a import b``) only where any name may be."""
    for module, (names, _why) in FACE_MAY_IMPORT.items():
        if target == module or (names is None and target.startswith(module + ".")):
            return names
    return frozenset()


def faces_below_ops(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """Each import by a face of memlens below the service layer that ``FACE_MAY_IMPORT`` (and
    ``FACE_MAY_IMPORT_HERE``) does not allow; an import of another face is the face rule's."""
    found = []
    for importer, targets in sorted(graph.items()):
        if face_of(importer) is None:
            continue
        for target, names in sorted(targets.items()):
            if face_of(target) is not None or (importer, target) in FACE_MAY_IMPORT_HERE:
                continue
            allowed = _allowed_for_faces(target)
            if allowed is None or (names and names <= allowed):
                continue
            taken = f" ({', '.join(sorted(names))})" if names else ""
            found.append(f"{importer} imports {target}{taken}")
    return found


@pytest.mark.parametrize(("importer", "target", "names", "wrong"), [
    ("memlens_app.panels.live", "memlens.analysis.lenses.groups", {"group_live"}, True),
    ("memlens_app.panels.live", "memlens.analysis.lenses.groups", {"GroupBreakdown"}, False),  # a type
    ("memlens_app.panels.live", "memlens.analysis.lenses.groups", set(), True),  # the whole module
    ("memlens_app.panels.live", "memlens.analysis", {"live_at"}, True),
    ("memlens.cli.main", "memlens.allocator.engine", {"engine_name"}, True),
    ("memlens.cli.export", "memlens.snapshot.reader", {"load"}, True),
    ("memlens.mcp_server", "memlens.analysis.lenses.rules", {"rules_from_text"}, True),
    ("memlens.cli.group", "memlens.ops.group", {"group"}, False),
    ("memlens.cli.diff", "memlens.reporters.diff", {"render_diff"}, False),
    ("memlens.cli.head_start", "memlens.snapshot.ahead", set(), False),  # named, for its importer only
    ("memlens.cli.triage", "memlens.snapshot.ahead", set(), True),
    ("memlens.ops.group", "memlens.analysis.lenses.groups", {"group_live"}, False),  # not a face
])
def test_the_rule_for_faces(importer: str, target: str, names: set[str], wrong: bool) -> None:
    # Guards the rule itself: what it lets through and what it catches.
    assert bool(faces_below_ops({importer: {target: names}})) == wrong


def test_faces_reach_the_engine_only_through_ops() -> None:
    """Before: the dashboard's live and timeline panels called live_at, group_live,
    resolve_moment, allocated_at and timeline_of themselves; memlens group rendered in the command
    and read rules with the lenses, memlens diff borrowed its renderer, whatif printed through
    allocator.report, --version asked allocator.engine, export loaded through the reader; the MCP
    server read rules with the lenses."""
    found = faces_below_ops(GRAPH)
    assert not found, "a face reaches below memlens.ops:\n  " + "\n  ".join(found)


def test_each_allowance_for_the_faces_is_still_needed() -> None:
    # The lists only shrink: a module (or name) no face imports any more is taken off them.
    taken: dict[str, set[str]] = {}
    for importer, targets in GRAPH.items():
        if face_of(importer) is not None:
            for target, names in targets.items():
                for module in FACE_MAY_IMPORT:
                    if target == module or target.startswith(module + "."):
                        taken.setdefault(module, set()).update(names)
    unused = sorted(set(FACE_MAY_IMPORT) - set(taken))
    unused += [f"{module}: {', '.join(sorted(names - taken.get(module, set())))}"
               for module, (names, _why) in FACE_MAY_IMPORT.items() if names and names - taken.get(module, set())]
    unused += [f"{importer} -> {target}" for importer, target in FACE_MAY_IMPORT_HERE
               if target not in GRAPH.get(importer, {})]
    assert not unused, "allowed for the faces, imported by none:\n  " + "\n  ".join(unused)


# --- One capacity parser (issue 35): a device's size is read and checked in memlens.units only.

CAPACITY_SIGN_CHECK = re.compile(r"capacity[A-Za-z_.]*\s*(?:<=|<)\s*0\b|device needs more than 0 bytes")


def own_capacity_checks() -> list[str]:
    """Each line outside memlens/units.py that checks a capacity's sign itself (five copies with
    three messages before: ops.triage, ops.whatif, both allocator engines, the units)."""
    found = []
    for folder in (REPO_ROOT / "memlens", REPO_ROOT / "app"):
        for path in sorted(folder.rglob("*.py")):
            if path == REPO_ROOT / "memlens" / "units.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if CAPACITY_SIGN_CHECK.search(line):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    return found


def test_the_capacity_check_is_found_where_it_is_written() -> None:
    assert CAPACITY_SIGN_CHECK.search("        if self.capacity is not None and self.capacity <= 0:")
    assert CAPACITY_SIGN_CHECK.search('raise MemlensUsageError("capacity 0 B: a device needs more than 0 bytes")')
    assert not CAPACITY_SIGN_CHECK.search("capacity_bytes(self.capacity)")


def test_a_capacity_is_checked_in_memlens_units_only() -> None:
    found = own_capacity_checks()
    assert not found, "capacity checked outside memlens.units (call units.capacity_bytes):\n  " + "\n  ".join(found)


def test_every_capacity_option_is_read_by_memlens_units() -> None:
    """Each command's --capacity goes through the one parser: click's DeviceCapacity type (which
    calls units.parse_capacity), or text handed to units.parse_capacity / capacity_bytes by the
    command (budget keeps the text as its label; plan passes it to PlanOptions)."""
    import importlib

    from memlens.cli.common import DeviceCapacity
    from memlens.cli.main import SUBCOMMANDS

    kinds = {}
    for name, (target, _) in SUBCOMMANDS.items():
        module, attribute = target.split(":")
        command = getattr(importlib.import_module(module), attribute)
        for param in command.params:
            if "--capacity" in getattr(param, "opts", ()):
                kinds[name] = "DeviceCapacity" if isinstance(param.type, DeviceCapacity) else "text"
    assert {name for name, kind in kinds.items() if kind == "text"} == {"budget", "plan"}, kinds
    assert len(kinds) == 8  # every command that takes a device's size
