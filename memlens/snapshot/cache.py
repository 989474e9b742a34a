"""A compact on-disk copy of a loaded snapshot, so the second open of a big file is fast.

The columns go into an uncompressed ``.npz`` (numpy reads them at disk speed); the small
parts (segments, frames, settings) go into one JSON member. The cache is keyed by the
pickle's absolute path, size and modification time and by ``CACHE_VERSION``; a stale or
unreadable cache is ignored and rebuilt, never trusted. It lives beside the pickle when that
folder is writable, else under ``$XDG_CACHE_HOME/memlens`` (``~/.cache/memlens``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from memlens.snapshot.model import Annotation, Block, DeviceTrace, Frame, Segment, Snapshot, StackTable

CACHE_VERSION = 1
# Below this, parsing the pickle takes well under a second: not worth a file on disk.
CACHE_MIN_BYTES = 8 << 20
_COLUMNS = ("action", "address", "size", "stream", "time_us", "stack_id", "device_free",
            "metadata_id", "context_id", "allocated", "reserved")


def _key(source: str) -> str:
    stat = os.stat(source)
    text = f"{os.path.abspath(source)}|{stat.st_size}|{stat.st_mtime_ns}|{CACHE_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _user_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "memlens"


def candidate_paths(source: str) -> list[Path]:
    name = f"{Path(source).name}.{_key(source)}.memlens-cache.npz"
    return [Path(source).parent / name, _user_cache_dir() / name]


def read(source: str) -> Snapshot | None:
    """The cached snapshot for ``source``, or ``None`` when there is no valid cache."""
    try:
        paths = candidate_paths(source)
    except OSError:
        return None
    for path in paths:
        if path.is_file():
            try:
                return _read(path, source)
            except (OSError, ValueError, KeyError, zipfile.BadZipFile, TypeError):
                continue  # stale or damaged: rebuild from the pickle
    return None


def write(source: str, snapshot: Snapshot) -> Path | None:
    """Write the cache atomically; returns where, or ``None`` if no location was writable."""
    arrays, meta = _encode(snapshot)
    for path in candidate_paths(source):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".memlens-cache-", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as handle:
                    members: dict[str, Any] = dict(arrays)
                    members["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
                    np.savez(handle, **members)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return path
        except OSError:
            continue
    return None


def _encode(snapshot: Snapshot) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    arrays: dict[str, np.ndarray] = {}
    devices_meta = []
    for device, trace in snapshot.devices.items():
        for column in _COLUMNS:
            arrays[f"d{device}_{column}"] = getattr(trace, column)
        devices_meta.append({
            "device": device,
            "user_metadata": trace.user_metadata,
            "compile_context": trace.compile_context,
            "baseline_allocated": trace.baseline_allocated,
            "baseline_reserved": trace.baseline_reserved,
            "window_complete": trace.window_complete,
            "has_time": trace.has_time,
            "curve_warnings": trace.curve_warnings,
        })
    stacks = snapshot.stacks.stacks
    arrays["stack_offsets"] = np.cumsum([0] + [len(s) for s in stacks], dtype=np.int64)
    arrays["stack_frames"] = np.fromiter((f for s in stacks for f in s), dtype=np.int32)
    meta = {
        "version": CACHE_VERSION,
        "devices": devices_meta,
        "frames": [[f.filename, f.line, f.name] for f in snapshot.stacks.frames],
        "segments": [
            [s.device, s.address, s.total_size, s.stream, s.segment_type, list(s.pool_id), s.is_expandable,
             s.stack_id, [[b.address, b.size, b.requested_size, b.state, b.stack_id] for b in s.blocks]]
            for s in snapshot.segments
        ],
        "annotations": [[a.name, a.stage, a.device, a.time_us] for a in snapshot.annotations],
        "allocator_settings": snapshot.allocator_settings,
        "extra": _jsonable(snapshot.extra),
        "format_guess": snapshot.format_guess,
    }
    return arrays, meta


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError, RecursionError):
        return {str(k): repr(v)[:1000] for k, v in value.items()} if isinstance(value, dict) else repr(value)[:1000]


def _read(path: Path, source: str) -> Snapshot:
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(npz["__meta__"].tobytes().decode())
        if meta.get("version") != CACHE_VERSION:
            raise ValueError("old cache version")
        devices = {}
        for info in meta["devices"]:
            device = int(info["device"])
            columns = {c: npz[f"d{device}_{c}"] for c in _COLUMNS}
            devices[device] = DeviceTrace(
                device=device,
                user_metadata=info["user_metadata"],
                compile_context=info["compile_context"],
                baseline_allocated=info["baseline_allocated"],
                baseline_reserved=info["baseline_reserved"],
                window_complete=info["window_complete"],
                has_time=info["has_time"],
                curve_warnings=info["curve_warnings"],
                **columns,
            )
        offsets = npz["stack_offsets"].tolist()
        flat = npz["stack_frames"].tolist()
    stacks = [tuple(flat[offsets[i]: offsets[i + 1]]) for i in range(len(offsets) - 1)]
    table = StackTable(frames=[Frame(f[0], int(f[1]), f[2]) for f in meta["frames"]], stacks=stacks)
    segments = [
        Segment(device=s[0], address=s[1], total_size=s[2], stream=s[3], segment_type=s[4],
                pool_id=tuple(s[5]), is_expandable=s[6], stack_id=s[7], blocks=[Block(*b) for b in s[8]])
        for s in meta["segments"]
    ]
    return Snapshot(
        source=source,
        devices=devices,
        segments=segments,
        stacks=table,
        annotations=[Annotation(*a) for a in meta["annotations"]],
        allocator_settings=meta["allocator_settings"],
        extra=meta["extra"],
        format_guess=meta["format_guess"],
        from_cache=True,
    )
