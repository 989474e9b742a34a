"""A compact on-disk copy of a loaded snapshot, so the second open of a big file is fast.

A cache entry decides what memlens reports, so nothing about one is taken on trust:

* **Where.** One folder: ``$MEMLENS_CACHE_DIR``, else ``$XDG_CACHE_HOME/memlens``, else
  ``~/.cache/memlens``, created 0700. It is used only when the opened folder is owned by this
  user and no one else may write to it; entries and the key must be regular files owned by this
  user. Nothing beside the snapshot is read: in a shared folder anyone could plant a file there.
* **Which bytes.** An entry stores the SHA-256 of the snapshot file's bytes and
  ``CACHE_VERSION``; both must match. (Size and modification time prove nothing: a replaced
  file can keep both.) SHA-256 is the fastest collision-resistant hash in ``hashlib`` on CPUs
  with SHA extensions: about 0.05 s for 75 MiB, against more than a second to parse. The file
  name is only a fingerprint (size, first and last 64 KiB), so that the entry can be read on
  one core while the full hash is computed on another.
* **Who wrote it.** Every entry ends with an HMAC-SHA256 of all of its bytes before it, keyed
  with a random per-user secret (``key``, 0600, in the cache folder). Structural checks cannot see an
  edit that stays consistent (a scaled ``size`` or ``allocated`` column keeps every id in
  range and every length right, and reports gigabytes that never existed), and recomputing the
  derived curves would not help either: they would be recomputed from the edited raw columns.
  The MAC is what proves that this user's memlens wrote the whole entry from these bytes; an
  entry copied from someone else, edited, or torn by a crash fails it. (Whoever can read the key
  can already write the folder: only this user and root.) The curves are therefore stored and
  covered by the MAC like everything else: recomputing them needs the window-completeness check,
  which sorts every address (about 0.1 s at a million events, more than reading them).
* **Laid out to be read at once.** A magic line, the length and JSON text of a table of members
  (name, dtype, count, offset), then each member's bytes at a 64-byte aligned offset: the whole
  file is read and its MAC checked in one call each, without the GIL (on the thread that hashes
  the snapshot, when ``memlens whatif`` reads ahead), and every column is a view of those bytes.
* **Well formed.** After the MAC, every column is checked (dtype, length, action codes, id
  ranges, monotonic stack offsets, block states) so that not even a bug in some memlens version
  that wrote the entry can crash an analysis.

Anything that fails a check is ignored (logged at debug level) and rebuilt from the pickle: a
cache never changes an answer. Free-form values (``allocator_settings``, unknown top-level
keys, pool ids) are stored only when they are plain JSON data within a bounded depth and size,
so that they come back exactly as parsed; a snapshot whose values are not (a self-referencing
list, tuples, deep nesting) is simply not cached. Entries are written to a temporary file and
renamed into place, temporary files are removed on any failure (and, if a killed process left
one, by the next writer), and the folder is pruned after each write: entries of older formats
go, then the least recently used until the total is under ``$MEMLENS_CACHE_MAX_BYTES``
(default 2 GiB; 0 turns caching off).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from memlens import cache_folder

# The folder's names, here too: tests and callers read them as ``memlens.snapshot.cache.X``.
from memlens.cache_folder import CACHE_DIR_ENV as CACHE_DIR_ENV
from memlens.cache_folder import CACHE_MAX_BYTES_ENV as CACHE_MAX_BYTES_ENV
from memlens.cache_folder import CACHE_MIN_BYTES as CACHE_MIN_BYTES
from memlens.cache_folder import (
    ENTRY_VERSIONS,
    OPEN_TO_READ,
    BackgroundHash,
    CacheFolder,
    EntryAhead,
    EntryRefused,
    entry_read_ahead,
    file_identity,
    fingerprint_fd,
    hash_file,
    hash_started,
    read_signed,
    read_signed_file,
    remembered_digest,
    signer,
    size_limit,
    write_signed,
)
from memlens.cache_folder import FINGERPRINT_BYTES as FINGERPRINT_BYTES
from memlens.cache_folder import KEY_BYTES as KEY_BYTES
from memlens.cache_folder import KEY_NAME as KEY_NAME
from memlens.cache_folder import SIGNATURE_BYTES as SIGNATURE_BYTES
from memlens.cache_folder import STALE_TEMP_SECONDS as STALE_TEMP_SECONDS
from memlens.cache_folder import cache_dir as cache_dir
from memlens.files import FileRefused, OpenedFile, open_regular
from memlens.snapshot.model import (
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

log = logging.getLogger(__name__)

CACHE_VERSION = ENTRY_VERSIONS["v"]
# Free-form values deeper or bigger than this are not cached (real settings are 1-2 levels deep).
MAX_PLAIN_DEPTH = 32
MAX_PLAIN_NODES = 100_000
MAX_MEMBERS = 4096

_INT8, _INT32, _INT64, _UINT8 = (np.dtype(t) for t in (np.int8, np.int32, np.int64, np.uint8))
_COLUMNS: dict[str, np.dtype[Any]] = {
    "action": _INT8, "address": _INT64, "size": _INT64, "block_size": _INT64, "stream": _INT64, "time_us": _INT64,
    "stack_id": _INT32, "device_free": _INT64, "metadata_id": _INT32, "context_id": _INT32,
    "allocated": _INT64, "reserved": _INT64,
}
_STACK_COLUMNS = {"stack_offsets": _INT64, "stack_frames": _INT32}
# Every segment's blocks, one column per field, segment after segment (a million-event file has
# tens of thousands: as columns they are checked in a few vectorised passes, not one at a time).
_BLOCK_COLUMNS = {"segment_block_offsets": _INT64, "blocks_address": _INT64, "blocks_size": _INT64,
                  "blocks_requested_size": _INT64, "blocks_state": _INT8, "blocks_stack_id": _INT32}
_META = "__meta__"
# The dtypes a member may have, by their text in the table (this machine's byte order).
_MEMBER_DTYPES = {dtype.str: dtype for dtype in (_INT8, _INT32, _INT64, _UINT8)}
_MAGIC = b"memlens columns\n"  # an entry's first 16 bytes
_TABLE_LENGTH_BYTES = 8
_ALIGN = 64  # each member starts at a multiple of this: its column is an aligned view


class _InvalidEntry(EntryRefused):
    """A cache entry that must not be used."""


class _NotCacheable(ValueError):
    """A snapshot whose contents would not come back exactly from the cache."""


# --------------------------------------------------------------------------- public API


def entry_name(fingerprint: str) -> str:
    return cache_folder.entry_name("v", fingerprint)


def content_hash(source: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks: what an entry must have been made from."""
    return hash_file(str(source))[0]


def fingerprint(source: str | os.PathLike[str]) -> str:
    """What an entry is named by: the SHA-256 of the file's size, first and last 64 KiB."""
    with open(source, "rb", buffering=0) as handle:
        return fingerprint_fd(handle.fileno(), os.fstat(handle.fileno()).st_size)


class CacheEntry:
    """The cache slot for one snapshot file's exact bytes.

    The slot is named by a fingerprint (size, head and tail: read at once) so that the entry can
    be opened, read and its MAC checked on one core while the full SHA-256 of the file is
    computed on another (hashlib releases the GIL); the entry is used only if the SHA-256 stored
    in it matches. Two files that share a fingerprint share a slot: the second simply rebuilds it.

    The file is read through its own descriptor (a duplicate of the one the reader parses, read
    with ``pread`` so neither moves the other's position): the bytes hashed are the bytes parsed,
    whatever the path names meanwhile. ``read`` returns the cached snapshot if a valid entry
    exists; ``write`` stores a snapshot parsed from the file, unless the file changed since it
    was hashed (then the parse may not be of the hashed bytes); ``close`` lets the file go.
    """

    def __init__(self, source: str, fd: int, fingerprint: str, identity: tuple[int, ...],
                 hashed: BackgroundHash | None = None, ahead: EntryAhead | None = None) -> None:
        self.source = source
        self.fd = fd
        self.name = entry_name(fingerprint)
        self.identity = identity
        self._hash = hashed if hashed is not None else BackgroundHash(fd, source, known=remembered_digest(fd))
        self._ahead = ahead

    @classmethod
    def for_file(cls, source: str | os.PathLike[str]) -> CacheEntry | None:
        """The slot of the file at ``source``: only a regular file (hashing a pipe or a device
        would consume what the parser needs, and opening a FIFO can block)."""
        try:
            opened = open_regular(source)
        except FileRefused as refused:
            log.debug("memlens cache: cannot read %s: %s", source, refused.reason)
            return None
        with opened:
            return cls.for_opened(opened)

    @classmethod
    def for_opened(cls, opened: OpenedFile) -> CacheEntry | None:
        """The slot of a file already opened and checked (``memlens.files.OpenedFile``). A hash
        of it already running (the triage's report slot started one) is shared, not repeated."""
        try:
            fd = os.dup(opened.fd)
        except OSError as error:
            log.debug("memlens cache: cannot read %s: %s", opened.name, error)
            return None
        try:
            st = os.fstat(fd)
            quick = fingerprint_fd(fd, st.st_size)
        except OSError as error:
            os.close(fd)
            log.debug("memlens cache: cannot read %s: %s", opened.name, error)
            return None
        return cls(opened.name, fd, quick, file_identity(st), hash_started(opened), entry_read_ahead(opened))

    def close(self) -> None:
        """Let go of the file (waits for the hashing thread, which reads it)."""
        self._hash.result()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    @property
    def content_hash(self) -> str | None:
        """The SHA-256 of the file's bytes (waits for the hashing thread); ``None`` when it could
        not be hashed or changed since the fingerprint (no trustworthy digest)."""
        hashed = self._hash.result()
        return hashed[0] if hashed is not None and hashed[1] == self.identity else None

    def read(self) -> Snapshot | None:
        def read_entry(folder: CacheFolder, key: bytes) -> Snapshot:
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                self._hash.result()  # the thread that hashed the file has read the entry since
                if ahead.matches(folder.path, self.name, key):
                    if ahead.error is not None:
                        raise ahead.error
                    if ahead.data is not None:
                        return _decode_entry(ahead.data, self.content_hash, self.source)
            return _read_entry(folder.fd, self.name, key, lambda: self.content_hash, self.source)

        return read_signed(self.name, read_entry, self.source)

    def write(self, snapshot: Snapshot) -> Path | None:
        """Store ``snapshot``; returns the entry's path, or ``None`` when nothing was stored.

        A cache that cannot be written costs speed only: no error reaches the caller, whose
        snapshot loaded fine (temporary files are removed on every path, interrupts included).
        """
        try:
            return self._write(snapshot)
        except Exception as error:
            log.debug("memlens cache: %s not cached: %s: %s", self.source, type(error).__name__, error)
            return None

    def _write(self, snapshot: Snapshot) -> Path | None:
        digest = self.content_hash
        try:
            unchanged = self.fd >= 0 and file_identity(os.fstat(self.fd)) == self.identity
        except OSError:
            unchanged = False
        if digest is None or not unchanged:
            log.debug("memlens cache: %s changed while it was read; not cached", self.source)
            return None
        if size_limit() <= 0:  # caching off: not even encoded
            return None
        try:
            members = _encode(snapshot, digest)
        except _NotCacheable as error:
            log.debug("memlens cache: %s not cached: %s", self.source, error)
            return None

        return write_signed(self.name, lambda key: lambda handle: _write_members(handle, members, key),
                            suffix="columns")


def read(source: str | os.PathLike[str]) -> Snapshot | None:
    """The cached snapshot for ``source``, or ``None`` when there is no valid entry."""
    entry = CacheEntry.for_file(source)
    if entry is None:
        return None
    try:
        return entry.read()
    finally:
        entry.close()


def write(source: str | os.PathLike[str], snapshot: Snapshot) -> Path | None:
    """Cache ``snapshot`` as the parse of ``source``'s current bytes (see ``CacheEntry.write``)."""
    entry = CacheEntry.for_file(source)
    if entry is None:
        return None
    try:
        return entry.write(snapshot)
    finally:
        entry.close()


def prune(max_bytes: int | None = None) -> None:
    """Bring the cache folder under ``max_bytes`` (default: the configured limit)."""
    folder = CacheFolder.open(create=False)
    if folder is not None:
        with folder:
            folder.prune(size_limit() if max_bytes is None else max_bytes, keep=None)


# --------------------------------------------------------------------------- encoding


def _check_plain(value: Any, what: str) -> None:
    """Raise ``_NotCacheable`` unless ``value`` is JSON data that comes back from JSON exactly
    (dicts with text keys, lists, text, ints, finite floats, bools, None) within bounded depth
    and size. Iterative, so a self-referencing or deeply nested value cannot recurse or hang."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    nodes = 1
    while pending:
        item, depth = pending.pop()
        if depth > MAX_PLAIN_DEPTH:
            raise _NotCacheable(f"{what} is nested deeper than {MAX_PLAIN_DEPTH} levels")
        kind = type(item)
        if kind is dict or kind is list:
            nodes += len(item)
            if nodes > MAX_PLAIN_NODES:
                raise _NotCacheable(f"{what} holds more than {MAX_PLAIN_NODES} values")
            if kind is dict:
                if any(type(k) is not str for k in item):
                    raise _NotCacheable(f"{what} has a key that is not text")
                pending.extend((v, depth + 1) for v in item.values())
            else:
                pending.extend((v, depth + 1) for v in item)
        elif kind is float:
            if not math.isfinite(item):
                raise _NotCacheable(f"{what} holds {item}")
        elif kind is int:
            if item.bit_length() > 256:
                raise _NotCacheable(f"{what} holds an integer of {item.bit_length()} bits")
        elif not (kind is str or kind is bool or item is None):
            raise _NotCacheable(f"{what} holds a {kind.__name__}")


def _column(trace: DeviceTrace, name: str) -> np.ndarray:
    column = getattr(trace, name)
    if not isinstance(column, np.ndarray) or column.dtype != _COLUMNS[name] or column.ndim != 1:
        raise _NotCacheable(f"device {trace.device} column {name} is not a 1-D {_COLUMNS[name]} array")
    return np.ascontiguousarray(column)


def _expect_cacheable(condition: bool, problem: str) -> None:
    if not condition:
        raise _NotCacheable(problem)


# What the entry stores besides the columns; a model field in neither is not cached (see _encode).
_TRACE_SCALARS = ("user_metadata", "compile_context", "baseline_allocated", "baseline_reserved", "pending_free_peak",
                  "pending_free_final", "window_complete", "has_time", "curve_warnings")
_SNAPSHOT_FIELDS = frozenset(("source", "devices", "segments", "stacks", "annotations", "allocator_settings", "extra",
                              "sidecar", "sidecar_problem", "format_guess", "from_cache"))


def _model_is_covered() -> bool:
    """True when every field of the model is stored (or, like ``source``, set on load). A field
    added to ``DeviceTrace`` or ``Snapshot`` without a place here turns the cache off rather
    than letting it drop the field and change an answer."""
    trace_fields = {f.name for f in dataclasses.fields(DeviceTrace)}
    snapshot_fields = {f.name for f in dataclasses.fields(Snapshot)}
    return trace_fields <= {"device", *_COLUMNS, *_TRACE_SCALARS} and snapshot_fields <= _SNAPSHOT_FIELDS


def _encode(snapshot: Snapshot, digest: str) -> dict[str, np.ndarray]:
    _expect_cacheable(_model_is_covered(), "the snapshot model has fields this cache does not store")
    members: dict[str, np.ndarray] = {}
    devices_meta = []
    for device, trace in snapshot.devices.items():
        events = len(trace)
        constant = []
        for name in _COLUMNS:
            column = _column(trace, name)
            _expect_cacheable(column.size == events, f"device {device} column {name} has {column.size} rows")
            if events > 1 and bool((column == column[0]).all()):
                # Streams, OOM free bytes and string ids are often one value throughout: one
                # element instead of millions keeps the entry (and the MAC pass over it) small.
                column = column[:1].copy()
                constant.append(name)
            members[f"d{device}_{name}"] = column
        info: dict[str, Any] = {"device": device, "events": events, "constant_columns": constant}
        info.update((name, getattr(trace, name)) for name in _TRACE_SCALARS)
        devices_meta.append(info)
    stacks = snapshot.stacks.stacks
    members["stack_offsets"] = np.cumsum([0] + [len(s) for s in stacks], dtype=np.int64)
    members["stack_frames"] = np.fromiter((f for s in stacks for f in s), dtype=np.int32)
    members.update(_encode_blocks(snapshot.segments))
    for segment in snapshot.segments:
        _check_plain(list(segment.pool_id), "a segment pool id")
    _check_plain(snapshot.allocator_settings, "allocator_settings")
    _check_plain(snapshot.extra, "the snapshot's extra keys")
    meta = {
        "version": CACHE_VERSION,
        "content_hash": digest,
        "devices": devices_meta,
        "frames": [[f.filename, f.line, f.name] for f in snapshot.stacks.frames],
        "segments": [
            [s.device, s.address, s.total_size, s.stream, s.segment_type, list(s.pool_id), s.is_expandable,
             s.stack_id]
            for s in snapshot.segments
        ],
        "annotations": [[a.name, a.stage, a.device, a.time_us] for a in snapshot.annotations],
        "allocator_settings": snapshot.allocator_settings,
        "extra": snapshot.extra,
        "format_guess": snapshot.format_guess,
    }
    try:
        text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise _NotCacheable(f"not representable as JSON: {error}") from None
    members[_META] = np.frombuffer(text.encode(), dtype=np.uint8)
    return members


def _encode_blocks(segments: list[Segment]) -> dict[str, np.ndarray]:
    blocks = [b for s in segments for b in s.blocks]
    state_code = {state: code for code, state in enumerate(BLOCK_STATES)}
    try:
        return {
            "segment_block_offsets": np.cumsum([0] + [len(s.blocks) for s in segments], dtype=np.int64),
            "blocks_address": np.array([b.address for b in blocks], dtype=np.int64),
            "blocks_size": np.array([b.size for b in blocks], dtype=np.int64),
            "blocks_requested_size": np.array([b.requested_size for b in blocks], dtype=np.int64),
            "blocks_state": np.array([state_code[b.state] for b in blocks], dtype=np.int8),
            "blocks_stack_id": np.array([b.stack_id for b in blocks], dtype=np.int32),
        }
    except (OverflowError, KeyError) as error:  # a value past 64 bits, or a state the model lacks
        raise _NotCacheable(f"a block that does not fit the columns: {error!r}") from None


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _write_members(handle: IO[bytes], members: dict[str, np.ndarray], key: bytes) -> None:
    """The entry: ``_MAGIC``, the table's length and JSON text (``[name, dtype, count, offset]``
    per member, offsets from the first aligned byte after the table), each member at its offset
    (zeros between), and last the signature over all of it (``cache_folder.read_signed_file``).
    Written in one pass, signed as it goes."""
    mac = signer(key, "v")

    def put(data: bytes | memoryview) -> None:
        handle.write(data)
        mac.update(data)

    arrays = [(name, np.ascontiguousarray(members[name]).reshape(-1)) for name in sorted(members)]
    offsets, end = [], 0
    for _, array in arrays:
        offsets.append(_aligned(end))
        end = offsets[-1] + array.nbytes
    table = [[name, array.dtype.str, int(array.size), offset]
             for (name, array), offset in zip(arrays, offsets, strict=True)]
    text = json.dumps(table).encode()
    head = _MAGIC + len(text).to_bytes(_TABLE_LENGTH_BYTES, "little") + text
    put(head + bytes(_aligned(len(head)) - len(head)))
    written = 0
    for (_, array), offset in zip(arrays, offsets, strict=True):
        put(bytes(offset - written))
        put(array.view(np.uint8).data)
        written = offset + array.nbytes
    handle.write(mac.digest())


# --------------------------------------------------------------------------- decoding


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise _InvalidEntry(problem)


def _read_entry(folder_fd: int, name: str, key: bytes, digest: Callable[[], str | None], source: str) -> Snapshot:
    fd = os.open(name, OPEN_TO_READ, dir_fd=folder_fd)
    try:
        data = read_signed_file(fd, key, "v")
    finally:
        os.close(fd)
    return _decode_entry(data, digest(), source)


def _decode_entry(data: bytearray, digest: str | None, source: str) -> Snapshot:
    """The snapshot in an entry's signed bytes; ``digest``: the full hash of the file it is for,
    computed meanwhile on another thread (``None``: it could not be hashed)."""
    _expect(digest is not None, "the snapshot could not be hashed")
    assert digest is not None
    return _decode(_unpack(data), digest, source)


def _unpack(data: bytearray) -> dict[str, np.ndarray]:
    """Every member of an entry's bytes (signature removed), as a view of them: the table is
    checked against the bytes before any view is made (a name once, a known dtype, aligned
    offsets in order and inside the data), so that not even a bug in the memlens that wrote it
    can make a view reach past them."""
    start = len(_MAGIC) + _TABLE_LENGTH_BYTES
    _expect(len(data) >= start and data[: len(_MAGIC)] == _MAGIC, "not a memlens columns file")
    length = int.from_bytes(data[len(_MAGIC):start], "little")
    _expect(length <= len(data) - start, "table runs past the end")
    try:
        table = json.loads(bytes(data[start:start + length]))
    except ValueError as error:  # a JSON or text decoding error
        raise _InvalidEntry(f"table: {error}") from None
    _expect(type(table) is list and len(table) <= MAX_MEMBERS, "table")
    base = _aligned(start + length)
    members: dict[str, np.ndarray] = {}
    free_from = base  # the first byte no member before this one holds
    for item in table:
        _expect(type(item) is list and len(item) == 4 and type(item[0]) is str and type(item[1]) is str
                and _is_int(item[2]) and _is_int(item[3]), "a table row")
        name, dtype_text, count, offset = item
        dtype = _MEMBER_DTYPES.get(dtype_text)
        _expect(dtype is not None, f"{name}: dtype {dtype_text!r}")
        assert dtype is not None
        _expect(name not in members, f"duplicate member {name!r}")
        at = base + offset
        _expect(count >= 0 and offset >= 0 and offset % _ALIGN == 0 and at >= free_from, f"{name}: offset {offset}")
        _expect(at + count * dtype.itemsize <= len(data), f"{name}: runs past the end")
        members[name] = (np.frombuffer(data, dtype=dtype, count=count, offset=at) if count
                         else np.empty(0, dtype=dtype))
        free_from = at + count * dtype.itemsize
    return members


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_text_list(value: Any) -> bool:
    return type(value) is list and all(type(v) is str for v in value)


def _check_ids(column: np.ndarray, count: int, what: str) -> None:
    """Ids are -1 (none) or index a table of ``count`` rows."""
    if column.size:
        _expect(int(column.min()) >= -1 and int(column.max()) < count, f"{what} out of range")


def _decode_stacks(members: dict[str, np.ndarray], meta: dict[str, Any]) -> StackTable:
    raw_frames = meta["frames"]
    _expect(type(raw_frames) is list, "frames")
    frames = []
    for item in raw_frames:
        _expect(type(item) is list and len(item) == 3 and type(item[0]) is str and _is_int(item[1])
                and type(item[2]) is str, "a frame")
        frames.append(Frame(item[0], item[1], item[2]))
    offsets, flat = members["stack_offsets"], members["stack_frames"]
    _expect(offsets.size >= 1 and int(offsets[0]) == 0 and int(offsets[-1]) == flat.size, "stack offsets bounds")
    _expect(bool((np.diff(offsets) >= 0).all()), "stack offsets not monotonic")
    _check_ids(flat, len(frames), "frame id")
    _expect(not flat.size or int(flat.min()) >= 0, "frame id out of range")
    starts, items = offsets.tolist(), flat.tolist()
    stacks = [tuple(items[a:b]) for a, b in itertools.pairwise(starts)]
    return StackTable(frames=frames, stacks=stacks)


def _decode_device(info: Any, members: dict[str, np.ndarray], stack_count: int) -> DeviceTrace:
    _expect(type(info) is dict and set(info) == {"device", "events", "constant_columns", *_TRACE_SCALARS},
            "device info fields")
    device, events, constant = info["device"], info["events"], info["constant_columns"]
    _expect(_is_int(device) and device >= 0, "device number")
    _expect(_is_int(events) and events >= 0, "event count")
    _expect(_is_text_list(constant) and set(constant) <= set(_COLUMNS) and (events > 1 or not constant),
            "constant columns")
    columns = {name: members[f"d{device}_{name}"] for name in _COLUMNS}
    for name, column in columns.items():
        _expect(column.dtype == _COLUMNS[name], f"device {device} {name}: dtype {column.dtype}")
        rows = 1 if name in constant else events
        _expect(column.size == rows, f"device {device} {name}: {column.size} rows, not {rows}")
        if name in constant:
            columns[name] = constant_column(column[0], events, column.dtype)
    user_metadata, compile_context = info["user_metadata"], info["compile_context"]
    _expect(_is_text_list(user_metadata) and _is_text_list(compile_context), "string tables")
    _expect(_is_text_list(info["curve_warnings"]), "curve warnings")
    for flag in ("window_complete", "has_time"):
        _expect(type(info[flag]) is bool, flag)
    for baseline in ("baseline_allocated", "baseline_reserved"):
        _expect(_is_int(info[baseline]), baseline)
    for pending in ("pending_free_peak", "pending_free_final"):
        _expect(_is_int(info[pending]) and info[pending] >= 0, pending)
    if events:
        action = columns["action"]
        _expect(int(action.min()) >= 0 and int(action.max()) < len(Action), "action code out of range")
        _expect(int(columns["size"].min()) >= 0 and int(columns["block_size"].min()) >= 0, "negative size")
        _expect(int(columns["allocated"].min()) >= 0 and int(columns["reserved"].min()) >= 0, "negative curve")
    _check_ids(columns["stack_id"], stack_count, "stack id")
    _check_ids(columns["metadata_id"], len(user_metadata), "user_metadata id")
    _check_ids(columns["context_id"], len(compile_context), "compile_context id")
    fields: dict[str, Any] = {name: info[name] for name in _TRACE_SCALARS}
    fields.update(columns)
    return DeviceTrace(device=device, **fields)


def _decode_blocks(members: dict[str, np.ndarray], segment_count: int, stack_count: int) -> list[list[Block]]:
    """Each segment's blocks from the block columns, every value checked first."""
    for name, dtype in _BLOCK_COLUMNS.items():
        _expect(members[name].dtype == dtype and members[name].ndim == 1, f"{name}: dtype {members[name].dtype}")
    offsets = members["segment_block_offsets"]
    columns = [members[name] for name in _BLOCK_COLUMNS if name != "segment_block_offsets"]
    count = columns[0].size
    _expect(all(column.size == count for column in columns), "block columns of different lengths")
    _expect(offsets.size == segment_count + 1 and int(offsets[0]) == 0 and int(offsets[-1]) == count,
            "block offsets bounds")
    _expect(bool((np.diff(offsets) >= 0).all()), "block offsets not monotonic")
    address, size, requested, state, stack_id = columns
    if count:
        _expect(int(size.min()) >= 0 and int(requested.min()) >= 0, "negative block size")
        _expect(int(state.min()) >= 0 and int(state.max()) < len(BLOCK_STATES), "block state out of range")
        _expect(int(stack_id.min()) >= -1 and int(stack_id.max()) < stack_count, "block stack id out of range")
    states = [BLOCK_STATES[code] for code in state.tolist()]
    blocks = [Block(*fields) for fields in zip(address.tolist(), size.tolist(), requested.tolist(), states,
                                               stack_id.tolist(), strict=True)]
    starts = offsets.tolist()
    return [blocks[a:b] for a, b in itertools.pairwise(starts)]


def _decode_segment(item: Any, blocks: list[Block], devices: dict[int, DeviceTrace], stack_count: int) -> Segment:
    _expect(type(item) is list and len(item) == 8, "a segment")
    device, address, total_size, stream, segment_type, pool_id, is_expandable, stack_id = item
    _expect(_is_int(device) and device in devices, "segment device")
    _expect(_is_int(address) and _is_int(total_size) and total_size >= 0, "segment extent")  # addresses: 64 bits
    _expect(_is_int(stream) and type(segment_type) is str and type(pool_id) is list
            and type(is_expandable) is bool, "segment fields")
    _expect(_is_int(stack_id) and -1 <= stack_id < stack_count, "segment stack id")
    return Segment(device=device, address=address, total_size=total_size, stream=stream,
                   segment_type=segment_type, pool_id=tuple(pool_id), is_expandable=is_expandable,
                   stack_id=stack_id, blocks=blocks)


def _decode(members: dict[str, np.ndarray], digest: str, source: str) -> Snapshot:
    raw_meta = members.pop(_META, None)
    _expect(raw_meta is not None and raw_meta.dtype == _UINT8, "no metadata")
    assert raw_meta is not None
    meta = json.loads(raw_meta.tobytes())
    _expect(type(meta) is dict, "metadata is not an object")
    _expect(meta.get("version") == CACHE_VERSION, f"format version {meta.get('version')!r}")
    _expect(meta.get("content_hash") == digest, "written for other bytes")
    raw_devices = meta["devices"]
    _expect(type(raw_devices) is list and len(raw_devices) > 0, "device list")
    device_numbers = [d.get("device") if type(d) is dict else None for d in raw_devices]
    expected = {f"d{n}_{c}" for n in device_numbers for c in _COLUMNS} | set(_STACK_COLUMNS) | set(_BLOCK_COLUMNS)
    _expect(len(set(device_numbers)) == len(device_numbers), "duplicate devices")
    _expect(set(members) == expected, "members do not match the metadata")
    for name, dtype in _STACK_COLUMNS.items():
        _expect(members[name].dtype == dtype, f"{name}: dtype {members[name].dtype}")
    stacks = _decode_stacks(members, meta)
    devices = {}
    for info in raw_devices:
        trace = _decode_device(info, members, len(stacks))
        devices[trace.device] = trace
    raw_segments, raw_annotations = meta["segments"], meta["annotations"]
    _expect(type(raw_segments) is list and type(raw_annotations) is list, "segments / annotations")
    blocks = _decode_blocks(members, len(raw_segments), len(stacks))
    segments = [_decode_segment(item, segment_blocks, devices, len(stacks))
                for item, segment_blocks in zip(raw_segments, blocks, strict=True)]
    annotations = []
    for a in raw_annotations:
        _expect(type(a) is list and len(a) == 4 and type(a[0]) is str and type(a[1]) is str
                and _is_int(a[2]) and _is_int(a[3]), "an annotation")
        annotations.append(Annotation(*a))
    settings, extra, format_guess = meta["allocator_settings"], meta["extra"], meta["format_guess"]
    _expect(type(settings) is dict and type(extra) is dict and type(format_guess) is str, "settings / extra")
    return Snapshot(
        source=source,
        devices=devices,
        segments=segments,
        stacks=stacks,
        annotations=annotations,
        allocator_settings=settings,
        extra=extra,
        format_guess=format_guess,
        from_cache=True,
    )
