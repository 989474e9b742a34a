"""Corrupted snapshot files: whatever the damage, the reader answers with a snapshot or one
MemlensFormatError, never another exception from deep inside (hypothesis mutates real bytes)."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memlens
from memlens.errors import MemlensFormatError
from tests.unit.test_reader import tiny_snapshot

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
