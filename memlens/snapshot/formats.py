"""What kind of file or object a snapshot is: magic numbers, and which PyTorch wrote it."""

from __future__ import annotations

import os
from typing import Any

GZIP_MAGIC = b"\x1f\x8b"
ZIP_MAGIC = b"PK\x03\x04"
# The first byte of a pickle: protocol 2+ (PROTO), or the MARK / EMPTY_LIST / EMPTY_DICT of protocol 0-1.
PICKLE_FIRST_BYTES = (b"\x80", b"(", b"]", b"}")
BARE_LIST_FORMAT = "memory_snapshot() segment list"


def looks_like_pickle(head: bytes) -> bool:
    """Whether the first bytes of a file can start a pickle."""
    return head[:1] in PICKLE_FIRST_BYTES


def guess_format(raw: dict[str, Any], segments: list[Any], traces: list[Any]) -> str:
    """Which PyTorch release wrote the file, from the keys it has (a guess, shown to users)."""
    first_block = next((b for s in segments if isinstance(s, dict) for b in s.get("blocks", [])), None)
    first_entry = next((e for t in traces if isinstance(t, list) for e in t if isinstance(e, dict)), None)
    if isinstance(first_block, dict) and "history" in first_block:
        return "2.0"
    if first_entry is not None and "user_metadata" in first_entry:
        return "2.10+"
    if first_entry is not None and "compile_context" in first_entry:
        return "2.8-2.9"
    if "external_annotations" in raw:
        return "2.5-2.7" if first_entry is None or "time_us" in first_entry else "2.5+"
    if "allocator_settings" in raw:
        return "2.3-2.4"
    if first_entry is not None and "time_us" in first_entry:
        return "2.2"
    return "2.1"


def sniff(path: str | os.PathLike[str]) -> bool:
    """Cheap check that a path looks like a pickle or gzip file (for directory scans): only a
    regular file is read (a FIFO in the folder would block the scan for ever)."""
    from memlens.files import FileRefused, open_regular

    try:
        with open_regular(path) as opened:
            head = os.pread(opened.fd, 4, 0)
    except (FileRefused, OSError):
        return False
    return head.startswith(GZIP_MAGIC) or head[:1] == b"\x80"


__all__ = ["BARE_LIST_FORMAT", "GZIP_MAGIC", "ZIP_MAGIC", "guess_format", "looks_like_pickle", "sniff"]
