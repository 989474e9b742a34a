# Types of the native snapshot scanner (src/native/scan_bindings.cpp), for mypy; its Python face
# is memlens.snapshot.native_scan.
from typing import Any

# The limits this extension was built with, by their Python names (memlens.snapshot.limits).
DECLARED: dict[str, int]

def scan(data: bytes) -> tuple[bool, Any]:
    """(False, reason) when the scanner declines the file, else (True, (raw, traces))."""

def scan_file(fd: int, size: int, chunk: int = ...) -> tuple[bool, Any]:
    """scan() of the `size` bytes of the open file `fd`, read with pread `chunk` bytes at a time."""
