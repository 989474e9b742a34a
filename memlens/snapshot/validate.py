"""Validation of untrusted snapshot values: the limits, the checker, bounded copies.

Everything that can be wrong with a snapshot's values (a field of the wrong type, out of range,
objects shared where snapshots never share them, texts of megabytes) is caught here and becomes
one ``MemlensFormatError`` naming the file, the field and the problem (``Checker``). The limits
keep work and memory proportional to the file; ``plain_copy`` makes the bounded JSON-ready
copies of unknown values that the cache and the sidecar store.
"""

from __future__ import annotations

import itertools
import math
import sys
from typing import Any

from memlens.errors import MemlensFormatError
from memlens.snapshot.curves import MAX_TOTAL_BYTES

# Shared with the native scanner, so declared in limits (PLAUSIBLE_BYTES: one size, or the bytes
# live at once on a device; MAX_DEVICES: device ordinals).
from memlens.snapshot.limits import MAX_DEVICES, PLAUSIBLE_BYTES

# Two kinds of bound. What PyTorch's C++ types can hold bounds what a file may say: sizes are
# size_t, addresses uintptr_t, streams a cudaStream_t pointer, frame lines uint64 (a Python
# frame without a line is -1 cast to 2**64 - 1), times int64. A value outside those is no file
# PyTorch wrote and is refused. Inside them, a value can still be meaningless (a line of
# 2**64 - 1, a block of 2**60 bytes): it is read as unknown and the file gets a note, never
# refused. Addresses and streams are identities: they are stored in int64 columns with the same
# 64 bits (two's complement), as PyTorch's own pickler casts them.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1
MAX_BYTES = UINT64_MAX  # size_t
MAX_ADDRESS = UINT64_MAX  # uintptr_t
MAX_TIME_US = INT64_MAX  # approx_time_t (int64 microseconds)
MAX_LINE = UINT64_MAX  # unwind::Frame::lineno is uint64
# What can be true, within those: larger values are read as unknown (see above).
PLAUSIBLE_TIME_US = 1 << 60  # microseconds since the epoch: year 36,000
PLAUSIBLE_LINE = (1 << 31) - 1  # CPython's line numbers are C ints
UNKNOWN_LINE = 0  # lines start at 1; PyTorch's C++ frames say 0 when they know none
# Resource limits (they bound the work, not the values).
MAX_TEXT = 4096  # characters kept of a frame's name or filename, a metadata or annotation string
SHORT_TEXT = 256  # ... once the texts longer than this have used up the text budget
DEFAULT_TEXT_BUDGET = 64 << 20  # characters of such long texts, for a file of unknown size
MIN_TEXT_BUDGET = 16 << 20  # for a file: the larger of this and twice its size
TRUNCATION_MARK = "…"
MAX_EXTRA_DEPTH = 32  # nesting kept in unknown keys and allocator_settings (JSON in the cache)
MAX_EXTRA_NODES = 10_000
MAX_EXTRA_CHARS = 1 << 20  # characters of long strings in one such copy
MAX_SHARED_VISITS = 100_000


def as_int64(value: int) -> int:
    """An integer of -2**63 to 2**64 - 1 as the int64 with the same 64 bits (a pointer or a
    stream above 2**63 - 1 keeps its identity in an int64 column)."""
    return value - (1 << 64) if value > INT64_MAX else value


def _references_of_a_list_item() -> int:
    """What ``map(sys.getrefcount, items)`` reports for an item that only the list holds
    (the interpreter's own temporary reference differs between Python versions)."""
    return max(map(sys.getrefcount, [object()]))


SINGLE_REFERENCE = _references_of_a_list_item()


def shorten(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters (a 10 MB frame name is no real frame's)."""
    return text if len(text) <= limit else text[: limit - 1] + TRUNCATION_MARK


def describe(value: Any) -> str:
    """A short description of a value for an error message (never its full repr: it may be huge)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return f"{value}" if abs(value) < 1 << 70 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value):,} characters"
    return f"a {type(value).__name__}"


class Checker:
    """Raises format errors that name the file and where in it the problem is."""

    def __init__(self, source: str, text_budget: int = DEFAULT_TEXT_BUDGET) -> None:
        self.source = source
        self._seen: set[int] = set()  # ids of shared items already walked (see walk)
        self._containers: set[int] = set()
        self._walked: list[Any] = []
        self._shared_visits = 0
        self._cut_by_id: dict[tuple[int, int], str] = {}
        self._text_left = text_budget
        self.implausible_sizes = 0  # sizes read as unknown (see size_)
        self.notes: list[str] = []  # other values read as unknown, said on every device

    def fail(self, problem: str) -> MemlensFormatError:
        return MemlensFormatError(self.source, problem)

    def dict_(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{where} should be a dict, found {describe(value)}")
        return value

    def list_(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list | tuple):
            raise self.fail(f"{where} should be a list, found {describe(value)}")
        return list(value) if isinstance(value, tuple) else value

    def walk(self, items: list[Any], where: str) -> None:
        """Count the work of walking ``items``; refuse when shared objects multiply it.

        Real snapshots share frame dicts and frame lists only; one segment, block or entry
        referred to 20,000 times (memo references cost two bytes each) would make the work
        grow with the square of the file. Items referenced once (the common case, checked
        with one C-level pass over reference counts) cannot be met anywhere else; others are
        counted by identity, and more than MAX_SHARED_VISITS repeated visits is refused.
        """
        if id(items) in self._containers:
            self._shared_visits += len(items)
        else:
            self._containers.add(id(items))
            self._walked.append(items)  # keeps the id unique while parsing
        if max(map(sys.getrefcount, items), default=0) > SINGLE_REFERENCE:
            identities = set(map(id, items))
            new = identities - self._seen
            self._shared_visits += len(items) - len(new)
            self._seen |= new
        if self._shared_visits > MAX_SHARED_VISITS:
            raise self.fail(
                f"{where} refers to objects met elsewhere in the file, {self._shared_visits:,} times so far "
                "(a snapshot never shares its segments, blocks or trace entries)"
            )

    def int_(
        self, container: dict[str, Any], key: str, where: str, default: int | None = None,
        low: int | None = INT64_MIN, high: int | None = INT64_MAX,
    ) -> int:
        value = container.get(key, default)
        if value is None:
            raise self.fail(f"{where} has no {key!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{where}: {key!r} should be an integer, found {describe(value)}")
        if low is not None and high is not None and not low <= value <= high:
            raise self.fail(f"{where}: {key!r} is out of range ({describe(value)}; expected {low} to {high})")
        return value

    def size_(self, container: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
        """A size_t: 0 to 2**64 - 1, refused outside; beyond PLAUSIBLE_BYTES it is unknown (0),
        counted in ``implausible_sizes``."""
        value = self.int_(container, key, where, default, low=None, high=None)
        if value < 0:
            raise self.fail(f"{where}: {key!r} is negative ({value})")
        if value > MAX_BYTES:
            raise self.fail(f"{where}: {key!r} is out of range ({describe(value)}; a size is at most 2**64 - 1)")
        if value > PLAUSIBLE_BYTES:
            self.implausible_sizes += 1
            return 0
        return value

    def address_(self, container: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
        """A pointer (uintptr_t, or the int64 PyTorch's pickler casts it to), as its 64 bits in an int64."""
        return as_int64(self.int_(container, key, where, default, low=INT64_MIN, high=MAX_ADDRESS))

    def text_(self, container: dict[str, Any], key: str, where: str, default: str) -> str:
        value = container.get(key, default)
        if not isinstance(value, str):
            raise self.fail(f"{where}: {key!r} should be text, found {describe(value)}")
        if len(value) <= SHORT_TEXT:
            return value
        # Long texts share a budget: one long name in 100,000 distinct frame dicts costs the file
        # a few bytes per dict but 4 KiB per frame in the model, the cache and the reports. Past
        # the budget, long texts are cut to SHORT_TEXT characters.
        limit = MAX_TEXT if self._text_left > 0 else SHORT_TEXT
        if len(value) <= limit:
            self._text_left -= len(value)
            return value
        # One cut copy per original string object (and limit): a name shared by many frame
        # dicts is cut once, and its copies share one cached hash.
        cut = self._cut_by_id.get((id(value), limit))
        if cut is None:
            cut = self._cut_by_id[(id(value), limit)] = shorten(value, limit)
            self._walked.append(value)  # keeps the id unique while parsing
        self._text_left -= len(cut)
        return cut



def plain_copy(value: Any, int_limit: int = INT64_MAX, max_nodes: int = MAX_EXTRA_NODES) -> Any:
    """A bounded JSON-ready copy of an unknown value (what the cache and sidecar writers store).

    Self-references, deep nesting and huge strings are cut, not followed: at most
    MAX_EXTRA_DEPTH levels and ``max_nodes`` values, strings cut to MAX_TEXT characters (to
    SHORT_TEXT once long ones have used MAX_EXTRA_CHARS);
    integers beyond ``int_limit`` and non-finite floats become text describing them.
    Iterative, so no nesting depth can reach the recursion limit.
    """
    budget = max_nodes
    chars_left = MAX_EXTRA_CHARS  # of long strings; later ones are cut shorter

    def scalar(item: Any) -> Any:
        nonlocal chars_left
        if isinstance(item, str):
            if len(item) <= SHORT_TEXT:
                return item
            cut = shorten(item, MAX_TEXT if chars_left > 0 else SHORT_TEXT)
            chars_left -= len(cut)
            return cut
        if item is None or isinstance(item, bool | int | float):
            if isinstance(item, int) and not isinstance(item, bool) and not -int_limit <= item <= int_limit:
                return describe(item)
            if isinstance(item, float) and not math.isfinite(item):
                return repr(item)
            return item
        return None

    root: list[Any] = [None]
    # (the value, the container to put its copy in, the key or index there, depth)
    pending: list[tuple[Any, Any, Any, int]] = [(value, root, 0, 0)]
    while pending:
        item, parent, slot, depth = pending.pop()
        budget -= 1
        if isinstance(item, dict | list | tuple):
            if depth >= MAX_EXTRA_DEPTH or budget <= 0:
                parent[slot] = f"<{type(item).__name__} cut: nested or sized beyond what memlens keeps>"
                continue
            if isinstance(item, dict):
                copy: Any = {}
                for key, sub in itertools.islice(item.items(), max(budget, 0)):
                    name = shorten(key) if isinstance(key, str) else describe(key)
                    copy[name] = None
                    pending.append((sub, copy, name, depth + 1))
            else:
                copy = [None] * min(len(item), max(budget, 0))
                pending.extend((sub, copy, i, depth + 1) for i, sub in enumerate(item[: len(copy)]))
            parent[slot] = copy
        else:
            parent[slot] = scalar(item)
    return root[0]


__all__ = [
    "DEFAULT_TEXT_BUDGET",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_ADDRESS",
    "MAX_BYTES",
    "MAX_DEVICES",
    "MAX_EXTRA_CHARS",
    "MAX_EXTRA_DEPTH",
    "MAX_EXTRA_NODES",
    "MAX_LINE",
    "MAX_SHARED_VISITS",
    "MAX_TEXT",
    "MAX_TIME_US",
    "MAX_TOTAL_BYTES",
    "MIN_TEXT_BUDGET",
    "PLAUSIBLE_BYTES",
    "PLAUSIBLE_LINE",
    "PLAUSIBLE_TIME_US",
    "SHORT_TEXT",
    "TRUNCATION_MARK",
    "UINT64_MAX",
    "UNKNOWN_LINE",
    "Checker",
    "as_int64",
    "describe",
    "plain_copy",
    "shorten",
]
