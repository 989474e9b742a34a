"""Corrupted snapshot files: whatever the damage, the reader answers with a snapshot or one
MemlensFormatError, never another exception from deep inside. Hypothesis mutates the bytes,
and replaces typed fields with hostile values; what is accepted goes through the whole
pipeline (analysis, the terminal report, what-if)."""

from __future__ import annotations

import copy
import io
import math
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memlens
from memlens.errors import MemlensError, MemlensFormatError
from memlens.reporters.terminal import make_console, render_triage
from tests import hostile_files
from tests.unit.test_reader import tiny_snapshot

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

GOOD = pickle.dumps(tiny_snapshot(), protocol=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flips=st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    keep=st.integers(1, len(GOOD)),
)
def test_mutated_bytes_give_a_snapshot_or_one_clear_error(flips: list[tuple[int, int]], keep: int) -> None:
    data = bytearray(GOOD)
    for position, value in flips:
        data[position] = value
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "damaged.pickle"
        path.write_bytes(bytes(data[:keep]))
        try:
            snapshot = memlens.load(path, cache=False)
        except MemlensFormatError as exc:
            assert str(path) in str(exc)
            return
        for trace in snapshot.devices.values():  # whatever loaded is a consistent model
            assert len(trace.allocated) == len(trace.action)
            assert (trace.allocated >= 0).all()


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_deeply_nested_junk_is_refused_or_loaded_without_recursion_errors(tmp_path: Path, depth: int) -> None:
    """A pickle can nest lists far deeper than Python's recursion limit without recursing."""
    payload = b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."
    path = tmp_path / "deep.pickle"
    path.write_bytes(payload)
    with pytest.raises(MemlensFormatError):
        memlens.load(path, cache=True)


# --------------------------------------------------------------------------- typed mutations

def _deep_list(depth: int) -> list[Any]:
    nested: list[Any] = []
    for _ in range(depth):
        nested = [nested]
    return nested


def _self_referencing() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


# What a hostile or careless writer could put in any field.
HOSTILE_VALUES: list[Callable[[], Any]] = [
    lambda: math.nan, lambda: math.inf, lambda: -math.inf, lambda: -1, lambda: 0, lambda: 1 << 31,
    lambda: 1 << 62, lambda: (1 << 63) - 1, lambda: 1 << 63, lambda: 1 << 64, lambda: 1 << 80,
    lambda: -(1 << 63), lambda: 2.5, lambda: "text", lambda: "", lambda: "x" * 10_000, lambda: "\x1b[2J\n",
    lambda: [1], lambda: [], lambda: {"a": 1}, lambda: {}, lambda: None, lambda: True, lambda: (1, 2),
    lambda: b"bytes", lambda: _deep_list(400), _self_referencing, lambda: [{"filename": 1}],
]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every field of the template (and each list's first items), as a path of keys/indices."""
    found: list[tuple[Any, ...]] = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
        found.append((*prefix, "unknown_field"))
    elif isinstance(value, list):
        for index, item in enumerate(value[:2]):
            found += _paths(item, (*prefix, index))
    return found


TEMPLATE = hostile_files.snapshot()
FIELD_PATHS = sorted(set(_paths(TEMPLATE)), key=repr)


def _mutated(mutations: list[tuple[tuple[Any, ...], Any]]) -> Any:
    raw: Any = copy.deepcopy(TEMPLATE)
    for path, value in mutations:
        if not path:
            raw = value
            continue
        parent = raw
        for step in path[:-1]:
            parent = parent[step] if isinstance(parent, dict | list) and _has(parent, step) else None
        if isinstance(parent, dict | list) and (isinstance(parent, dict) or _has(parent, path[-1])):
            parent[path[-1]] = value
    return raw


def _has(container: Any, step: Any) -> bool:
    return step in container if isinstance(container, dict) else isinstance(step, int) and step < len(container)


def test_every_field_of_the_template_is_mutated() -> None:
    assert ("segments", 0, "blocks", 0, "state") in FIELD_PATHS
    assert ("device_traces", 0, 0, "frames", 0, "line") in FIELD_PATHS
    assert ("external_annotations", 0, "time_us") in FIELD_PATHS
    assert ("allocator_settings", "garbage_collection_threshold") in FIELD_PATHS
    assert len(FIELD_PATHS) > 60


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.tuples(st.sampled_from(FIELD_PATHS), st.sampled_from(HOSTILE_VALUES)),
                          min_size=1, max_size=3))
def test_typed_mutations_give_one_clear_error_or_a_full_analysis(
    mutations: list[tuple[tuple[Any, ...], Callable[[], Any]]],
) -> None:
    """Any field replaced by NaN, inf, huge or negative numbers, text, containers, None, deep
    or self-referencing lists: one MemlensFormatError line, or analysis, the terminal report
    and what-if all succeed on what was accepted."""
    raw = _mutated([(path, make()) for path, make in mutations])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mutant.pickle"
        path.write_bytes(pickle.dumps(raw, protocol=4))
        try:
            snapshot = memlens.load(path, cache=True)
        except MemlensFormatError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc)
            return
        assert memlens.load(path, cache=True) is not None  # the cache it wrote reads back
    _full_pipeline(snapshot)


def _full_pipeline(snapshot: Any) -> None:
    for trace in snapshot.devices.values():
        assert len(trace.allocated) == len(trace.action)
        assert (trace.allocated >= 0).all() and (trace.reserved >= 0).all()
    try:
        report = memlens.analyze(snapshot, capacity=1 << 34)
        report.to_json()
        render_triage(make_console(file=io.StringIO(), width=100, color=False), report)
        memlens.whatif(snapshot)
    except MemlensError:
        pass  # a usage-level refusal (e.g. a capacity the file contradicts) is one line too
