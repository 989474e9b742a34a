"""Read any memory snapshot PyTorch has written (2.0 to today), safely.

A snapshot pickle holds only plain values (dict, list, tuple, str, int, float, bool, None),
so the unpickler refuses *every* global: a file that names ``os.system`` or any class is
rejected before anything runs. Before the C unpickler executes any opcode, the stream is
vetted (``memlens.snapshot.scan``): tuples of containers (hash bombs), sets, DUP, huge
integers and memo indices are refused. Everything that can go wrong with a file (empty,
truncated, not a pickle, wrong shape, a field of the wrong type or out of range, objects
shared where snapshots never share them) becomes one ``MemlensFormatError`` naming the file,
the field and the problem. Work and memory stay proportional to the file: strings are cut to
4 KiB, unknown keys and settings are copied with bounded depth and size, and shared
segments, blocks or entries are refused instead of being walked again.

The raw dicts are turned into columns in a few list-comprehension passes. Frames in real
files are shared objects (PyTorch's pickler memoises them), so stacks are interned by the
identity of their frame dicts first and by value only once per distinct object.

This module reads (unpickling, the sidecar) and turns raw dicts into the model; the rest lives
apart: what kind of file it is and which PyTorch wrote it (``memlens.snapshot.formats``), the
limits and checks on every value (``memlens.snapshot.validate``), and the allocated/reserved
curves built from a parsed trace (``memlens.snapshot.curves``, part of the model).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import io
import itertools
import operator
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from memlens.deferred import after_answer
from memlens.errors import MemlensFormatError, MemlensUsageError
from memlens.files import OpenedFile, opened_snapshot
from memlens.sidecar import sidecar_beside
from memlens.snapshot import ahead, native_scan
from memlens.snapshot.allocator_settings import RecordedAllocatorSettings
from memlens.snapshot.curves import CurveOverflow, build_curves
from memlens.snapshot.formats import BARE_LIST_FORMAT, GZIP_MAGIC, ZIP_MAGIC, guess_format, looks_like_pickle, sniff
from memlens.snapshot.model import (
    ACTION_CODES,
    BLOCK_STATE_ALIASES,
    BLOCK_STATES,
    Action,
    Annotation,
    Block,
    DeviceTrace,
    Frame,
    Segment,
    Snapshot,
    StackTable,
    constant_column,
)
from memlens.snapshot.validate import (
    DEFAULT_TEXT_BUDGET,
    INT64_MAX,
    INT64_MIN,
    MAX_ADDRESS,
    MAX_BYTES,
    MAX_DEVICES,
    MAX_LINE,
    MAX_TEXT,
    MAX_TIME_US,
    MIN_TEXT_BUDGET,
    PLAUSIBLE_BYTES,
    PLAUSIBLE_LINE,
    PLAUSIBLE_TIME_US,
    SHORT_TEXT,
    SINGLE_REFERENCE,
    UINT64_MAX,
    UNKNOWN_LINE,
    Checker,
    as_int64,
    describe,
    plain_copy,
    shorten,
)

if TYPE_CHECKING:
    from memlens.snapshot.cache import CacheEntry
    from memlens.snapshot.scan import PipedVetting, VettedStream

GZIP_MAX_RATIO = 100
# The least a gzip may inflate to, whatever its size: real snapshots compress 4-36x, so a file
# of a few KB needs well under this; at 64 MiB a 44 KB gzip carried 4.36 M events (1.5 GB RSS).
GZIP_MIN_LIMIT = 1 << 20
READ_SHARE = 0.7  # of the load time, for the progress bar: unpickling is most of it


class _RefuseGlobals(pickle.Unpickler):
    """An unpickler that can build only plain containers and scalars."""

    def find_class(self, module: str, name: str) -> Any:
        raise _GlobalRefused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _GlobalRefused(f"persistent id {pid!r}")


class _GlobalRefused(Exception):
    pass


def _unpickle(
    stream: IO[bytes], source: str, vetted: VettedStream | PipedVetting | None = None, total: int | None = None,
    total_is_limit: bool = False,
) -> Any:
    """Unpickle ``stream`` through the opcode vetting (``vetted``: vetting already in place;
    ``total``: the stream's length, or with ``total_is_limit`` the most it may hold)."""
    # The Python vetting (its regexes compile in 15 ms) is imported only when a file goes this way.
    from memlens.snapshot.scan import VettedStream

    vetted = vetted if vetted is not None else VettedStream(stream, total, total_is_limit)
    try:
        return _RefuseGlobals(vetted).load()
    except _GlobalRefused as exc:
        raise _global_refused(source, str(exc)) from None
    except Exception as exc:
        if vetted.refusal is None:
            raise _format_error(exc, source) from None
        # The unpickler stopped where vetting refused the stream (it reads whole frames, so a
        # global in the same frame was not reached): name the global first, as find_class would.
        if vetted.first_global is not None:
            raise _global_refused(source, vetted.first_global) from None
        raise MemlensFormatError(source, str(vetted.refusal)) from None


def _global_refused(source: str, name: str) -> MemlensFormatError:
    return MemlensFormatError(
        source,
        f"refused to load: the pickle names the global {name} (a memory snapshot never needs one; "
        "loading it could run code)",
    )


def _format_error(exc: Exception, source: str) -> MemlensFormatError:
    """The one-line error for an unpickling failure (globals are refused, so it is damage)."""
    from memlens.snapshot.scan import PickleRefused

    if isinstance(exc, PickleRefused):
        return MemlensFormatError(source, str(exc))
    if isinstance(exc, EOFError) or (isinstance(exc, pickle.UnpicklingError) and "truncated" in str(exc)):
        return MemlensFormatError(source, "the file ends early: it is truncated or was still being written")
    if isinstance(exc, RecursionError):
        return MemlensFormatError(source, "the pickle is nested too deeply to be a memory snapshot")
    if isinstance(exc, MemoryError):
        return MemlensFormatError(source, "the pickle is too large to load in this machine's memory")
    if isinstance(exc, OSError | gzip.BadGzipFile):
        return MemlensFormatError(source, f"could not read the file ({exc})")
    return MemlensFormatError(source, f"not a readable pickle ({type(exc).__name__}: {exc})")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while millions of acyclic dicts are created.

    Unpickling a snapshot makes millions of containers; each allocation burst triggers a
    full-heap GC pass that finds nothing (snapshot data has no cycles). Pausing it halves the
    load time; it is restored even if loading fails.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_raw(path: str | os.PathLike[str] | OpenedFile) -> Any:
    """The snapshot object in ``path`` (plain Python values), loaded without running code."""
    with _gc_paused(), opened_snapshot(path) as opened:
        return _read_raw(opened)


class _ProgressReader:
    """A file wrapper that reports how far the unpickler has read (for the progress bar).

    The unpickler reads in 64 KiB frames, so the extra Python call per read costs nothing.
    """

    def __init__(self, handle: IO[bytes], total: int, report: Callable[[float], None]) -> None:
        self._handle = handle
        self._total = max(total, 1)
        self._report = report
        self._done = 0
        self._next_report = 0

    def _advance(self, count: int) -> None:
        self._done += count
        if self._done >= self._next_report:
            self._next_report = self._done + self._total // 100
            self._report(min(self._done / self._total, 1.0))

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self._advance(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        count = self._handle.readinto(buffer)  # type: ignore[attr-defined]
        self._advance(count or 0)
        return count or 0

    def readline(self, size: int = -1) -> bytes:
        data = self._handle.readline(size)
        self._advance(len(data))
        return data


class _Inflation:
    """Refuses a gzip stream that inflates beyond ``limit`` bytes (a compression bomb).

    Real snapshots compress 4-36x; the limit is GZIP_MAX_RATIO times the file, at least
    GZIP_MIN_LIMIT, so memory stays proportional to what was uploaded.
    """

    def __init__(self, stream: Any, limit: int, why: str | None = None, compressed: int | None = None) -> None:
        """``compressed``: the gzip file's size, for the message when its stream is cut short."""
        self._stream = stream
        self._compressed = compressed
        self._left = limit
        self._limit = limit
        self._why = why or (f"{GZIP_MAX_RATIO}x the file, at least {GZIP_MIN_LIMIT:,}; "
                            "real snapshots compress 4-36x")

    @property
    def inflated(self) -> int:
        """Bytes inflated so far."""
        return self._limit - max(self._left, 0)

    def read(self, size: int = -1) -> bytes:
        try:
            data = self._stream.read(size if size is not None and 0 <= size <= self._left + 1 else self._left + 1)
        except EOFError:  # the compressed stream ends before its end-of-stream marker
            if self._compressed is None:
                raise
            from memlens.snapshot.scan import PickleRefused

            raise PickleRefused(f"the file ends early at byte {self._compressed:,} of {self._compressed:,} (its gzip "
                                "stream stops before its end): it is truncated or was still being written") from None
        self._left -= len(data)
        if self._left < 0:
            from memlens.snapshot.scan import PickleRefused

            raise PickleRefused(
                f"refused to load: the gzip stream inflates to more than {self._limit:,} bytes ({self._why})"
            )
        return data


def _read_raw(opened: OpenedFile, on_read: Callable[[float], None] | None = None,
              content: list[int] | None = None, max_content_bytes: int | None = None) -> Any:
    """The raw snapshot; ``content`` (if given) gets the bytes of pickle read: the file's size, or
    what a gzip inflated to, which then stands for the file's size in every limit that scales with it.
    ``max_content_bytes``: the largest plain file accepted (the dashboard's upload limit), which a
    gzip's inflated bytes count against as a plain file's size would."""
    source = opened.name
    size = opened.size
    with opened.reader() as handle:
        head = handle.read(4)
        if not head:
            raise MemlensFormatError(source, "the file is empty")
        handle.seek(0)
        if head.startswith(GZIP_MAGIC):
            with gzip.GzipFile(fileobj=handle) as unzipped:
                limit, why = max(GZIP_MIN_LIMIT, GZIP_MAX_RATIO * size), None
                if max_content_bytes is not None and max_content_bytes < limit:
                    limit, why = max_content_bytes, "the largest snapshot accepted here, compressed or not"
                inflation = _Inflation(io.BufferedReader(unzipped, buffer_size=1 << 20), limit, why, compressed=size)
                stream: Any = inflation
                if on_read is not None:  # progress follows the compressed bytes read
                    stream = _ProgressReader(stream, size, lambda _f: on_read(handle.tell() / max(size, 1)))
                raw = _unpickle(stream, source, total=limit, total_is_limit=True)
                if content is not None:
                    content.append(inflation.inflated)
                return raw
        if head == ZIP_MAGIC:
            raise MemlensFormatError(
                source, "is a zip archive (a torch.save checkpoint?), not a memory snapshot pickle"
            )
        if not looks_like_pickle(head):
            raise MemlensFormatError(source, "not a pickle (expected a pickle written by _dump_snapshot)")
        if content is not None:
            content.append(size)
        from memlens.snapshot import scan

        if scan.parallel_vetting_pays(size):
            piped = _start_piped_vetting(opened, size, on_read)
            if piped is not None:
                try:
                    return _unpickle(handle, source, vetted=piped)
                finally:
                    piped.close()
        if on_read is not None:
            counted: Any = _ProgressReader(handle, size, on_read)
            return _unpickle(counted, source, total=size)
        return _unpickle(handle, source, total=size)


def _read_raw_native(opened: OpenedFile, content: list[int], max_content_bytes: int | None = None) -> Any:
    """The raw snapshot as the native scanner reads it (``memlens.snapshot.native_scan``), its
    plain traces as columns; None when the scanner is off or declines the file: then the Python
    path (``_read_raw``) reads it, and its answer or one-line error is the reference."""
    if native_scan.scanner() is None:
        return None
    with opened.reader() as handle:
        head = handle.read(4)
        handle.seek(0)
        if head.startswith(GZIP_MAGIC):
            limit = max(GZIP_MIN_LIMIT, GZIP_MAX_RATIO * opened.size)
            if max_content_bytes is not None:
                limit = min(limit, max_content_bytes)
            try:
                with gzip.GzipFile(fileobj=handle) as unzipped:
                    # One byte past the limit tells a stream that would inflate further.
                    data = unzipped.read(limit + 1)
            except (OSError, EOFError, gzip.BadGzipFile, MemoryError):
                return None
            if len(data) > limit:
                return None  # the Python path refuses it with its message
        elif looks_like_pickle(head):
            # Read by the scanner itself, a megabyte at a time: the file is never held whole; on
            # another thread already when a face began the scan ahead (``memlens.snapshot.ahead``).
            begun = ahead.take_scan(opened)
            raw, declined = (native_scan.scanned(begun) if begun is not None
                             else native_scan.scan_file(opened.fd, opened.size))
            if declined == REPEATED_ENTRY:
                raise MemlensFormatError(opened.name, declined)
            if raw is not None:
                content.append(opened.size)
            return raw
        else:
            return None
    raw, declined = native_scan.scan(data)
    if declined == REPEATED_ENTRY:
        raise MemlensFormatError(opened.name, declined)
    if raw is not None:
        content.append(len(data))
    return raw


def _start_piped_vetting(
    opened: OpenedFile, size: int, on_read: Callable[[float], None] | None,
) -> PipedVetting | None:
    """A child process that vets the opened file (it inherits the descriptor) while this one
    unpickles what it sends, or None if none starts (then vetting runs in-process)."""
    from memlens.snapshot.scan import PipedVetting

    report = None if on_read is None else (lambda received: on_read(received / max(size, 1)))
    try:
        piped = PipedVetting(opened.fd, report)
    except OSError:  # no process can be started here (limits, sandbox)
        return None
    if piped.started():
        return piped
    piped.close()
    return None


def load(
    path: str | os.PathLike[str] | OpenedFile,
    *,
    cache: bool | None = None,
    progress: Callable[[str, float], None] | None = None,
    max_content_bytes: int | None = None,
) -> Snapshot:
    """Load a snapshot file (``.pickle`` or ``.pickle.gz``) into the columnar model.

    ``path`` may be a file the caller has already opened and checked (``memlens.files.OpenedFile``,
    as ``memlens mcp --root`` does): then that descriptor is what is read, and the sidecar is
    opened beside it the same way. ``cache``: reuse/write a compact columnar copy so the next
    open is fast. ``None`` (default) caches files of ``CACHE_MIN_BYTES`` or more.
    ``progress(stage, fraction)`` is called as loading proceeds (the CLI draws a bar with it).
    ``max_content_bytes``: refuse more pickle than this, a gzip's inflated bytes counted as a plain
    file's (the dashboard passes its upload limit, so a small gzip is no way past it).
    """
    with opened_snapshot(path) as opened:
        return _load(opened, cache, progress, max_content_bytes)


def _load(opened: OpenedFile, cache: bool | None, progress: Callable[[str, float], None] | None,
          max_content_bytes: int | None = None) -> Snapshot:
    from memlens.cache_folder import caches

    source = opened.name
    use_cache = caches(opened.size, cache)
    cache_entry = None
    if use_cache:  # the cache's module (zipfile and all) only when it is used
        from memlens.snapshot import cache as snapshot_cache

        # Hashed once, before parsing: the entry is written only if the file is still these bytes.
        cache_entry = snapshot_cache.CacheEntry.for_opened(opened)
    try:
        if cache_entry is not None:
            cached = cache_entry.read()
            if cached is not None:
                ahead.wait(opened)  # a scan begun ahead (the file was new to the report cache) is not needed
                cached.sidecar, cached.sidecar_problem = sidecar_beside(opened)
                return cached
        on_read = None
        if progress is not None:
            report = progress

            def on_read(fraction: float) -> None:
                report("reading", READ_SHARE * fraction)

        with _gc_paused():
            content: list[int] = []
            raw = _read_raw_native(opened, content, max_content_bytes)
            if raw is None:  # declined (or off): the Python path reads it, and says what is wrong
                content.clear()
                raw = _read_raw(opened, on_read, content, max_content_bytes)
            if progress:
                progress("building timeline", READ_SHARE)
            snapshot = parse(raw, source=source, text_budget=max(MIN_TEXT_BUDGET, 2 * content[0]))
            del raw
        snapshot.sidecar, snapshot.sidecar_problem = sidecar_beside(opened)
        if cache_entry is not None:
            # Written once the answer is out when a face asked for that (memlens.deferred); the
            # entry keeps its own descriptor of the file until then.
            entry, cache_entry = cache_entry, None
            after_answer(lambda: _write_and_close(entry, snapshot))
    finally:
        if cache_entry is not None:
            cache_entry.close()
    if progress:
        progress("done", 1.0)
    return snapshot


def _write_and_close(entry: CacheEntry, snapshot: Snapshot) -> None:
    """The columnar copy of ``snapshot`` stored in its cache entry, then the entry let go."""
    try:
        entry.write(snapshot)
    finally:
        entry.close()


# --------------------------------------------------------------------------- parsing


class _Interner:
    """Interns frames and stacks; identity caches make shared (memoised) frames cheap."""

    def __init__(self) -> None:
        self.table = StackTable()
        self._frame_by_key: dict[tuple[str, int, str], int] = {}
        self._frame_by_id: dict[int, int] = {}
        self._stack_by_key: dict[tuple[int, ...], int] = {}
        self._stack_by_list_id: dict[int, int] = {}
        self._keep_alive: list[Any] = []  # ids are only unique while the objects live

    def frame(self, raw: Any, check: Checker) -> int:
        if not isinstance(raw, dict):
            raise check.fail(f"a stack frame should be a dict, found {describe(raw)}")
        filename = check.text_(raw, "filename", "a stack frame", "??")
        name = check.text_(raw, "name", "a stack frame", "??")
        line = check.int_(raw, "line", "a stack frame", 0, low=INT64_MIN, high=MAX_LINE)
        if not 0 <= line <= PLAUSIBLE_LINE:  # -1 (or 2**64 - 1): PyTorch had no line for the frame
            line = UNKNOWN_LINE
        key = (filename, line, name)
        fid = self._frame_by_key.get(key)
        if fid is None:
            fid = len(self.table.frames)
            self.table.frames.append(Frame(*key))
            self._frame_by_key[key] = fid
        self._frame_by_id[id(raw)] = fid
        self._keep_alive.append(raw)
        return fid

    def stack(self, frames: Any, check: Checker) -> int:
        if frames is None or (isinstance(frames, list | tuple) and not frames):
            return -1
        sid = self._stack_by_list_id.get(id(frames))
        if sid is not None:
            return sid
        if not isinstance(frames, list | tuple):
            raise check.fail(f"'frames' should be a list, found {describe(frames)}")
        by_id = self._frame_by_id
        try:
            key = tuple(map(by_id.__getitem__, map(id, frames)))
        except KeyError:
            key = tuple(by_id[id(f)] if id(f) in by_id else self.frame(f, check) for f in frames)
        sid = self._stack_by_key.get(key)
        if sid is None:
            sid = len(self.table.stacks)
            self.table.stacks.append(key)
            self._stack_by_key[key] = sid
        self._stack_by_list_id[id(frames)] = sid
        self._keep_alive.append(frames)
        return sid

    def distinct_stacks(self, distinct: list[Any], check: Checker) -> list[int]:
        """The stack id of each distinct frames object, interned in this order (what ``stacks``
        does for the distinct objects of its rows, in their order of first appearance)."""
        known = self._stack_by_list_id
        ids = []
        for frames in distinct:
            key = id(frames)
            if key not in known:
                known[key] = self.stack(frames, check)
                self._keep_alive.append(frames)
            ids.append(known[key])
        return ids

    def stacks(self, frame_lists: list[Any], check: Checker) -> np.ndarray:
        """Stack ids for many entries: each distinct list object is interned once, the rest is C."""
        known = self._stack_by_list_id
        for key, frames in dict(zip(map(id, frame_lists), frame_lists, strict=True)).items():
            if key not in known:
                known[key] = self.stack(frames, check)
                self._keep_alive.append(frames)
        ids = map(known.__getitem__, map(id, frame_lists))
        return np.fromiter(ids, dtype=np.int32, count=len(frame_lists))


# One trace entry at two places in device_traces. PyTorch writes every event as a dict of its own;
# a file that refers to one again through the memo (a few bytes a time) made the Python path build a
# dict per event it names -- 2 GB and minutes for a 9 MB gzip of 4.4 M such references -- where the
# native scanner, which reads rows without dicts, declined. Refused on both, in these words (the
# native scanner's are the same: src/native/pickle_scan.cpp, extract_traces), before any other check.
REPEATED_ENTRY = (
    "refused to load: device_traces refers to objects met elsewhere in the file: one trace entry at two places "
    "(met again through the pickle memo; a snapshot never shares its trace entries, PyTorch writes each event once)"
)


def _refuse_repeated_entries(traces: Any, check: Checker) -> None:
    """Refuse a dict that is an entry at two places in the device traces (``REPEATED_ENTRY``).

    One C-level pass over the reference counts finds the entries held by more than their list; only
    those are compared by identity (a real snapshot has none)."""
    if not isinstance(traces, list):
        return
    lists = [trace for trace in traces if type(trace) is list]
    references = list(map(sys.getrefcount, itertools.chain.from_iterable(lists)))
    if max(references, default=0) <= SINGLE_REFERENCE:
        return
    seen: set[int] = set()
    for item, count in zip(itertools.chain.from_iterable(lists), references, strict=True):
        if count > SINGLE_REFERENCE and type(item) is dict:
            if id(item) in seen:
                raise check.fail(REPEATED_ENTRY)
            seen.add(id(item))


def _describe_keys(raw: dict[Any, Any]) -> str:
    names = [describe(k) if not isinstance(k, str) else shorten(k)[:40] for k in itertools.islice(raw, 20)]
    return ", ".join(sorted(names))[:200] or "none"


def parse(raw: Any, source: str = "<memory>", *, text_budget: int = DEFAULT_TEXT_BUDGET) -> Snapshot:
    """Turn a raw snapshot object (as ``torch.cuda.memory._snapshot()`` returns) into a ``Snapshot``.

    ``text_budget``: characters of long texts (frame names and filenames, annotation names,
    segment types over SHORT_TEXT characters) kept at up to MAX_TEXT each; later ones are cut
    to SHORT_TEXT. ``load`` gives twice the file's size (at least MIN_TEXT_BUDGET).
    """
    check = Checker(source, text_budget)
    bare_list = isinstance(raw, list | tuple)
    if bare_list:
        # torch.cuda.memory_snapshot() (no underscore) returns the bare list of segments.
        raw = {"segments": list(raw), "device_traces": []}
    if not isinstance(raw, dict):
        raise check.fail(f"not a memory snapshot: the pickle holds a {type(raw).__name__}, not a dict")
    if "segments" not in raw:
        raise check.fail(f"not a memory snapshot: no 'segments' key (keys: {_describe_keys(raw)})")
    _refuse_repeated_entries(raw.get("device_traces"), check)
    interner = _Interner()
    raw_segments = check.list_(raw["segments"], "'segments'")
    check.walk(raw_segments, "'segments'")
    parsed = [_parse_segment(s, i, check, interner) for i, s in enumerate(raw_segments)]
    segments = [seg for seg in parsed if seg.device >= 0]
    file_notes = []
    if len(segments) < len(parsed):
        file_notes.append(f"{len(parsed) - len(segments):,} segment(s) name no device (a negative ordinal): "
                          "left out")
    raw_traces = check.list_(raw.get("device_traces") or [], "'device_traces'")
    if len(raw_traces) > MAX_DEVICES:
        raise check.fail(f"'device_traces' lists {len(raw_traces):,} devices (at most {MAX_DEVICES:,} are read)")
    annotations = _parse_annotations(raw.get("external_annotations") or [], check)
    settings = _parse_settings(raw.get("allocator_settings") or {}, check)
    known = {"segments", "device_traces", "external_annotations", "allocator_settings"}
    extra = {
        shorten(k) if isinstance(k, str) else describe(k): plain_copy(v)
        for k, v in itertools.islice(((k, v) for k, v in raw.items() if k not in known), 100)
    }

    segments_by_device: dict[int, list[Segment]] = {}
    for seg in segments:  # grouped once: a scan per device is quadratic in the device count
        segments_by_device.setdefault(seg.device, []).append(seg)
    devices: dict[int, DeviceTrace] = {}
    for device, entries in enumerate(raw_traces):
        if isinstance(entries, native_scan.NativeTrace):  # read as columns by the native scanner
            devices[device] = _parse_native_trace(device, entries, check, interner)
            continue
        entries = check.list_(entries, f"device_traces[{device}]")
        if entries or device in segments_by_device:
            check.walk(entries, f"device_traces[{device}]")
            devices[device] = _parse_trace(device, entries, check, interner)
    for device in segments_by_device:
        devices.setdefault(device, DeviceTrace(device=device))
    if not devices:  # an empty snapshot still has the device it was taken on
        devices[0] = DeviceTrace(device=0)
    file_notes.extend(check.notes)
    if check.implausible_sizes:
        file_notes.append(f"{check.implausible_sizes:,} size(s) in the file claim more than "
                          f"{PLAUSIBLE_BYTES >> 40} TiB (no GPU holds that): read as unknown, counted as 0 B")
    rounding, rounding_note = _rounding_settings(settings)
    if rounding_note:
        file_notes.append(rounding_note)
    for device, trace in devices.items():
        trace.curve_warnings.extend(file_notes)
        _build_true_curves(trace, segments_by_device.get(device, []), rounding, check)
    return Snapshot(
        source=source,
        devices=devices,
        segments=segments,
        stacks=interner.table,
        annotations=annotations,
        allocator_settings=settings,
        extra=extra,
        format_guess=BARE_LIST_FORMAT if bare_list else guess_format(raw, raw_segments, [
            [t.first_entry] if isinstance(t, native_scan.NativeTrace) else t for t in raw_traces]),
    )


def _build_true_curves(trace: DeviceTrace, segments: list[Segment], rounding: RecordedAllocatorSettings,
                       check: Checker) -> None:
    """The trace's curves, unless its sizes add up past what any GPU holds (each may be
    plausible, thousands of frees of 10 TiB that were never allocated are not): then the
    trace's sizes are read as unknown (0 B) and the curves are the final state's, with a note.
    Only a final state beyond MAX_TOTAL_BYTES (int64 sums) is refused."""
    notes = list(trace.curve_warnings)
    try:
        build_curves(trace, segments, rounding)
        highest = max(int(trace.allocated.max()) if len(trace) else 0, int(trace.reserved.max()) if len(trace) else 0,
                      trace.baseline_allocated, trace.baseline_reserved)
        if highest <= max(PLAUSIBLE_BYTES, sum(s.total_size for s in segments)):
            return
    except CurveOverflow:
        pass
    trace.size[trace.action != int(Action.OOM)] = 0
    trace.curve_warnings = [*notes, f"the trace's sizes add up to more than {PLAUSIBLE_BYTES >> 40} TiB live at once "
                            "(no GPU holds that): read as unknown, counted as 0 B"]
    try:
        build_curves(trace, segments, rounding)
    except CurveOverflow as exc:
        raise check.fail(str(exc)) from None


def _rounding_settings(settings: dict[str, Any]) -> tuple[RecordedAllocatorSettings, str | None]:
    """The allocator settings that rounded the recorded blocks (``memlens.snapshot.blocks``);
    values PyTorch would never have accepted fall back to its defaults, with a note."""
    try:
        return RecordedAllocatorSettings.from_snapshot_dict(settings), None
    except (MemlensUsageError, ValueError, TypeError, OverflowError) as exc:
        return RecordedAllocatorSettings(), (f"allocator_settings not usable ({exc}): block sizes follow the "
                                             "default rounding")


def _parse_settings(raw: Any, check: Checker) -> dict[str, Any]:
    """``allocator_settings``: a bounded copy, with the keys the simulator reads type-checked."""
    settings = check.dict_(raw, "'allocator_settings'")
    where = "'allocator_settings'"
    if settings.get("max_split_size") is not None:
        check.int_(settings, "max_split_size", where, low=-1, high=(1 << 64) - 1)
    threshold = settings.get("garbage_collection_threshold")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0.0 <= threshold < 1.0
    ):
        raise check.fail(f"{where}: 'garbage_collection_threshold' should be a number in [0, 1), "
                         f"found {describe(threshold)}")
    expandable = settings.get("expandable_segments")
    if expandable is not None and not isinstance(expandable, bool | int):
        raise check.fail(f"{where}: 'expandable_segments' should be true or false, found {describe(expandable)}")
    divisions = settings.get("roundup_power2_divisions")
    if divisions is not None:
        values = list(divisions.values()) if isinstance(divisions, dict) else divisions
        keys = list(divisions) if isinstance(divisions, dict) else []
        # Sizes (MB) to division counts, both size_t: any such value loads; a count past 2**16
        # (a 1 MiB interval cut into pieces of 16 B) is no setting anyone made: unknown.
        if not isinstance(values, list | tuple) or len(values) > 64 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= UINT64_MAX for v in values
        ) or not all(isinstance(k, int | str) and str(k).isdigit() and len(str(k)) <= 20 for k in keys):
            raise check.fail(f"{where}: 'roundup_power2_divisions' should map sizes to counts")
        if any(v > 1 << 16 for v in values):
            settings = {k: v for k, v in settings.items() if k != "roundup_power2_divisions"}
            check.notes.append("allocator_settings: roundup_power2_divisions holds counts past 2**16: read as "
                               "unknown (the replay uses the default rounding)")
    plain = plain_copy(settings)
    return plain if isinstance(plain, dict) else {}


_PLAIN_STATES = frozenset(BLOCK_STATES)


def _plain_block(b: dict[Any, Any], offset: int) -> tuple[int, int, int, str, Any] | None:
    """A block's (address, size, requested size, state, frames) when every field is what PyTorch
    writes (sizes within PLAUSIBLE_BYTES, an address within int64, a known state): exactly what
    ``_parse_segment``'s checks give for it. None otherwise, and those checks then say what is
    wrong (or read it the long way); nothing is counted or cut here."""
    size = b.get("size")
    if type(size) is not int or not 0 <= size <= PLAUSIBLE_BYTES:
        return None
    requested = b.get("requested_size", size)
    if type(requested) is not int or not 0 <= requested <= PLAUSIBLE_BYTES:
        return None
    state = b.get("state", "inactive")
    if type(state) is not str or state not in _PLAIN_STATES:
        return None
    address = b.get("address", offset & UINT64_MAX)
    if type(address) is not int or not 0 <= address <= INT64_MAX:
        return None
    frames = b.get("frames")
    history = b.get("history")
    if frames is None and isinstance(history, list) and history:
        last = history[-1]
        frames = last.get("frames") if isinstance(last, dict) else None
    return address, size, requested, state, frames


def _parse_segment(raw: Any, index: int, check: Checker, interner: _Interner) -> Segment:
    where = f"segment {index}"
    seg = check.dict_(raw, where)
    address = check.address_(seg, "address", where)
    total_size = check.size_(seg, "total_size", where)
    raw_blocks = check.list_(seg.get("blocks", []), f"{where} 'blocks'")
    check.walk(raw_blocks, f"{where} 'blocks'")
    blocks: list[Block] = []
    offset = address  # 2.0 blocks have no address: they tile the segment in order
    for j, raw_block in enumerate(raw_blocks):
        if type(raw_block) is dict:  # the common case, checked inline: the checker's answers without its calls
            block = _plain_block(raw_block, offset)
            if block is not None:
                block_address, size, requested, state, frames = block
                blocks.append(Block(block_address, size, requested, state, interner.stack(frames, check)))
                offset = block_address + size
                continue
        bwhere = f"{where} block {j}"
        b = check.dict_(raw_block, bwhere)
        size = check.size_(b, "size", bwhere)
        requested = check.size_(b, "requested_size", bwhere, default=size)
        state = b.get("state", "inactive")
        if not isinstance(state, str):
            raise check.fail(f"{bwhere}: 'state' should be text, found {describe(state)}")
        state = BLOCK_STATE_ALIASES.get(state, state)
        if state not in BLOCK_STATES:
            raise check.fail(f"{bwhere}: unknown block state {describe(state)}")
        frames = b.get("frames")
        history = b.get("history")
        if frames is None and isinstance(history, list) and history:
            last = history[-1]
            frames = last.get("frames") if isinstance(last, dict) else None
        block_address = check.address_(b, "address", bwhere, default=offset & UINT64_MAX)
        blocks.append(Block(block_address, size, requested, state, interner.stack(frames, check)))
        offset = block_address + size
    pool = seg.get("segment_pool_id", (0, 0))
    if not isinstance(pool, list | tuple) or len(pool) > 8 or not all(
        isinstance(p, int) and not isinstance(p, bool) and INT64_MIN <= p <= UINT64_MAX for p in pool  # CaptureId_t
    ):
        raise check.fail(f"{where}: 'segment_pool_id' should be a pair of integers, found {describe(pool)}")
    expandable = seg.get("is_expandable", False)
    if not isinstance(expandable, bool | int):
        raise check.fail(f"{where}: 'is_expandable' should be true or false, found {describe(expandable)}")
    device = check.int_(seg, "device", where, default=0)  # c10::DeviceIndex (int8; int in older builds)
    if device >= MAX_DEVICES:
        raise check.fail(f"{where}: 'device' is out of range ({describe(device)}; memlens reads devices 0 to "
                         f"{MAX_DEVICES - 1})")
    return Segment(
        device=device,
        address=address,
        total_size=total_size,
        stream=as_int64(check.int_(seg, "stream", where, default=0, high=UINT64_MAX)),  # cudaStream_t
        segment_type=check.text_(seg, "segment_type", where, "large" if total_size > (1 << 21) else "small"),
        pool_id=tuple(pool),
        is_expandable=bool(expandable),
        blocks=blocks,
        stack_id=interner.stack(seg.get("frames"), check),
    )


def _parse_annotations(raw: Any, check: Checker) -> list[Annotation]:
    out = []
    items = check.list_(raw, "'external_annotations'")
    check.walk(items, "'external_annotations'")
    for i, item in enumerate(items):
        where = f"external_annotations[{i}]"
        ann = check.dict_(item, where)
        out.append(
            Annotation(
                name=check.text_(ann, "name", where, ""),
                stage=check.text_(ann, "stage", where, ""),
                # Negative devices mean "every device" (device_annotations); times only order them.
                device=check.int_(ann, "device", where, 0),
                time_us=check.int_(ann, "time_us", where, 0, high=MAX_TIME_US),
            )
        )
    return out


_INT_FIELDS = ("addr", "size", "stream", "time_us")


def _plain_int_columns(entries: list[dict[str, Any]], names: tuple[str, ...]) -> np.ndarray | None:
    """The ``names`` fields of every entry as int64 rows (one per name), or None unless every
    entry has them all as plain ints within int64 (then each column is checked on its own).

    One C-level pass for the types and one for the values: 2.5x faster than a column at a
    time, which pays for vetting the opcode stream. The types are checked first because
    ``np.fromiter`` would convert "512" or 1.5 (and a numeric string shared through the memo
    by a million entries would be converted a million times).
    """
    fields = operator.itemgetter(*names)
    values = itertools.chain.from_iterable
    try:
        if set(map(type, values(map(fields, entries)))) != {int}:
            return None
        flat = np.fromiter(values(map(fields, entries)), dtype=np.int64, count=len(names) * len(entries))
    except (KeyError, OverflowError):  # a missing field, or beyond int64
        return None
    return flat.reshape(len(entries), len(names)).T.copy()


def _int_column(
    values: list[Any], check: Checker, device: int, field_name: str, low: int = INT64_MIN, high: int = INT64_MAX,
) -> np.ndarray:
    """``values`` as an int64 column; ``high`` up to 2**64 - 1 (a size_t, a pointer): values past
    2**63 - 1 keep their 64 bits (``as_int64``)."""
    where = f"device_traces[{device}]: {field_name!r}"
    if not values:
        return np.zeros(0, dtype=np.int64)
    try:
        column = np.array(values)
    except (ValueError, TypeError, OverflowError, RecursionError):  # ragged lists, nesting
        column = np.zeros(0, dtype=object)
    if column.dtype.kind not in "iu" or column.shape != (len(values),) or column.dtype == np.uint64:
        # Not all plain integers within int64: name the first value that is not, or carry the
        # unsigned ones over bit for bit (rare files only: a Python loop is fine).
        for at, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int):
                raise check.fail(f"{where} should be integers, found {describe(value)}")
            if not low <= value <= high:
                raise _out_of_range(check, device, field_name, at, value, low, high)
        column = np.fromiter(map(as_int64, values), dtype=np.int64, count=len(values))
        return column
    return _bounded(column.astype(np.int64, copy=False), check, device, field_name, low, high)


def _out_of_range(
    check: Checker, device: int, field_name: str, at: int, value: int, low: int, high: int,
) -> MemlensFormatError:
    if value < 0 and low == 0:
        return check.fail(f"device_traces[{device}] entry {at}: negative {field_name} {value}")
    type_name = "2**64 - 1" if high == UINT64_MAX else "2**63 - 1"
    return check.fail(f"device_traces[{device}]: {field_name!r} is out of range at entry {at} "
                      f"({describe(value)}; expected {low} to {type_name})")


def _bounded(column: np.ndarray, check: Checker, device: int, field_name: str, low: int, high: int) -> np.ndarray:
    """An int64 column checked against ``low`` (``high`` beyond int64 cannot be exceeded)."""
    if column.size and int(column.min()) < low:
        at = int(np.argmin(column))
        raise _out_of_range(check, device, field_name, at, int(column[at]), low, high)
    if column.size and high < INT64_MAX and int(column.max()) > high:
        at = int(np.argmax(column))
        raise _out_of_range(check, device, field_name, at, int(column[at]), low, high)
    return column


def _intern_strings(values: list[Any], check: Checker, where: str) -> tuple[np.ndarray, list[str]]:
    """Ids into a table of the distinct strings; "" / "N/A" / missing become -1."""
    distinct = _distinct_texts(values, check, where, allow_none=True)
    table: dict[Any, int] = {}
    names: list[str] = []
    for value in distinct:
        if not value or value == "N/A":
            table[value] = -1
        else:
            table[value] = len(names)
            names.append(shorten(value))
    return np.fromiter(map(table.__getitem__, values), dtype=np.int32, count=len(values)), names


def _distinct_texts(values: list[Any], check: Checker, where: str, allow_none: bool = False) -> list[Any]:
    """The distinct values, found in C; each must be text (or None when allowed).

    Hashing is safe here: the vetted pickle holds no tuple of containers, and string hashes
    are cached, so a shared 10 MB string costs one hash. Checking the types of the distinct
    values only saves a pass over every entry.
    """
    try:
        distinct = list(dict.fromkeys(values))
    except TypeError:  # a list or dict: unhashable
        distinct = None
    if distinct is None or not all(isinstance(v, str) or (allow_none and v is None) for v in distinct):
        bad = next(v for v in values if not (isinstance(v, str) or (allow_none and v is None)))
        raise check.fail(f"{where} should be text, found {describe(bad)}")
    return distinct


def _column(entries: list[dict[str, Any]], key: str, default: Any) -> list[Any]:
    """One field of every entry (entries are known to be dicts), in one C-level pass."""
    return list(map(dict.get, entries, itertools.repeat(key), itertools.repeat(default)))


def _has_key(entries: list[dict[str, Any]], key: str) -> bool:
    return any(map(dict.__contains__, entries, itertools.repeat(key)))


def _parse_trace(device: int, entries: list[Any], check: Checker, interner: _Interner) -> DeviceTrace:
    # Every pass below is one C-level map over the entries: at a million entries each pass
    # costs tens of milliseconds, a Python-level loop would cost a second.
    try:  # only a dict can be indexed by a string: this also checks every entry is one
        names = list(map(operator.itemgetter("action"), entries))
    except KeyError:
        raise check.fail(f"device_traces[{device}]: an entry has no 'action'") from None
    except TypeError:
        bad = next(e for e in entries if not isinstance(e, dict))
        raise check.fail(f"device_traces[{device}] should hold dicts, found {describe(bad)}") from None
    distinct = _distinct_texts(names, check, f"device_traces[{device}]: 'action'")
    position = {name: i for i, name in enumerate(distinct)}
    codes = np.array([ACTION_CODES.get(name, int(Action.OTHER)) for name in distinct], dtype=np.int8)
    action = codes[np.fromiter(map(position.__getitem__, names), dtype=np.intp, count=len(names))]
    has_time = bool(entries) and "time_us" in entries[0]
    columns = _plain_int_columns(entries, _INT_FIELDS)
    # What PyTorch's types hold: addr and size are size_t, stream a cudaStream_t pointer (both
    # carried bit for bit past 2**63 - 1), time_us an int64.
    bounds = {"addr": (INT64_MIN, MAX_ADDRESS), "size": (0, MAX_BYTES), "stream": (INT64_MIN, UINT64_MAX),
              "time_us": (INT64_MIN, MAX_TIME_US)}
    address, size, stream, time_us = (
        _int_column(_column(entries, name, 0), check, device, name, *bounds[name]) if columns is None
        else _bounded(columns[i], check, device, name, *bounds[name])
        for i, name in enumerate(_INT_FIELDS)
    )
    notes, time_us, times_known = _unknown_sizes_and_times(size, time_us, action == int(Action.OOM))
    has_time = has_time and times_known
    oom_rows = np.flatnonzero(action == int(Action.OOM))
    device_free = np.zeros(len(entries), dtype=np.int64)
    for row in oom_rows:
        free = entries[row].get("device_free")
        device_free[row] = 0 if free is None else check.size_(
            entries[row], "device_free", f"device_traces[{device}] entry {int(row)}")
    stack_id = interner.stacks(_column(entries, "frames", None), check)
    no_strings: tuple[np.ndarray, list[str]] = (np.full(len(entries), -1, dtype=np.int32), [])
    where = f"device_traces[{device}]"
    metadata_id, user_metadata = (
        _intern_strings(_column(entries, "user_metadata", None), check, f"{where}: 'user_metadata'")
        if _has_key(entries, "user_metadata") else no_strings)
    context_id, compile_context = (
        _intern_strings(_column(entries, "compile_context", None), check, f"{where}: 'compile_context'")
        if _has_key(entries, "compile_context") else no_strings)
    return DeviceTrace(
        device=device,
        action=action,
        address=address,
        size=size,
        stream=stream,
        time_us=time_us,
        stack_id=stack_id,
        device_free=device_free,
        metadata_id=metadata_id,
        context_id=context_id,
        user_metadata=user_metadata,
        compile_context=compile_context,
        has_time=has_time,
        curve_warnings=notes,
    )


def _parse_native_trace(device: int, trace: native_scan.NativeTrace, check: Checker,
                        interner: _Interner) -> DeviceTrace:
    """``_parse_trace`` for a trace the native scanner read as columns: the scanner checked the
    types and bounds of the integer fields (it declines a file where one is off, so their errors
    are the Python path's); what is left is done here as ``_parse_trace`` does it, in its order:
    the action codes, the unknown sizes and times, the stacks interned (frames checked and texts
    cut by the same checker, in the same order), the metadata strings."""
    codes = np.array([ACTION_CODES.get(name, int(Action.OTHER)) for name in trace.actions], dtype=np.int8)
    action = codes[trace.action_local]
    notes, time_us, times_known = _unknown_sizes_and_times(trace.size, trace.time_us, action == int(Action.OOM))
    stack_ids = np.array(interner.distinct_stacks(trace.frames, check), dtype=np.int32)
    no_strings = constant_column(-1, len(trace), np.int32)
    return DeviceTrace(
        device=device,
        action=action,
        address=trace.address,
        size=trace.size,
        stream=trace.stream,
        time_us=time_us,
        stack_id=stack_ids[trace.frames_local],
        device_free=trace.device_free,
        metadata_id=_intern_distinct(trace.metadata, trace.metadata_local) if trace.has_user_metadata
        else no_strings,
        context_id=_intern_distinct(trace.context, trace.context_local) if trace.has_compile_context
        else no_strings,  # one array for both, as _parse_trace has it
        user_metadata=_distinct_names(trace.metadata) if trace.has_user_metadata else [],
        compile_context=_distinct_names(trace.context) if trace.has_compile_context else [],
        has_time=trace.has_time and times_known,
        curve_warnings=notes,
    )


def _distinct_names(distinct: list[str | None]) -> list[str]:
    """The table ``_intern_strings`` keeps of distinct strings: "" / "N/A" / None left out, cut."""
    return [shorten(value) for value in distinct if value and value != "N/A"]


def _intern_distinct(distinct: list[str | None], local: np.ndarray) -> np.ndarray:
    """``_intern_strings``'s ids from the distinct values and each row's index into them."""
    ids, next_id = [], 0
    for value in distinct:
        if not value or value == "N/A":
            ids.append(-1)
        else:
            ids.append(next_id)
            next_id += 1
    table = np.array(ids, dtype=np.int32)
    if not len(local):
        return np.zeros(0, dtype=np.int32)
    if local.strides == (0,):  # one value throughout (a constant column): its id throughout
        return constant_column(int(table[local[0]]), len(local), np.int32)
    return table[local]


def _unknown_sizes_and_times(
    size: np.ndarray, time_us: np.ndarray, oom_rows: np.ndarray,
) -> tuple[list[str], np.ndarray, bool]:
    """Read the meaningless values of a trace as unknown, and say so: the notes, the time column
    to keep and whether the trace's clock is known.

    A size past PLAUSIBLE_BYTES (or one that, as size_t, wrapped into a negative int64) is no
    allocation a GPU served: it counts 0 B (``size`` is set in place). An OOM row's size is a
    request, which can be absurd (``torch.empty(2**50)`` asks for 1 PiB): it is kept up to
    2**63 - 1. A time before the epoch or past PLAUSIBLE_TIME_US makes the trace's clock unknown:
    every time reads 0 (one constant column; the one given may be read-only) and the trace has no
    time."""
    notes = []
    implausible = (size < 0) | ((size > PLAUSIBLE_BYTES) & ~oom_rows)
    if implausible.any():
        count = int(implausible.sum())
        size[implausible] = 0
        notes.append(f"{count:,} trace entr{'y claims' if count == 1 else 'ies claim'} more than "
                     f"{PLAUSIBLE_BYTES >> 40} TiB (no GPU holds that): read as unknown, counted as 0 B")
    if time_us.size and (int(time_us.min()) < 0 or int(time_us.max()) > PLAUSIBLE_TIME_US):
        notes.append("the trace's times are not microseconds since the epoch: read as unknown")
        return notes, constant_column(0, len(time_us), np.int64), False
    return notes, time_us, True


# MAX_TEXT and SHORT_TEXT are re-exported: callers read the text limits from the reader.
__all__ = ["MAX_TEXT", "SHORT_TEXT", "load", "parse", "read_raw", "sniff"]
