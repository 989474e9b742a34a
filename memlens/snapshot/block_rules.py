"""PyTorch's caching-allocator rules that decide a block's bytes, declared once for every reader.

The constants are ``c10/cuda/CUDACachingAllocator.cpp``'s; ``round_size`` is its rule. The
snapshot's block sizes (``memlens.snapshot.blocks``), the Python allocator model
(``memlens.allocator.simulator``) and the C++ one (``src/native/``, through a header CMake writes
from this file with ``src/native/generate_constants.py``) all read them from here;
``memlens._native.DECLARED`` and ``memlens.snapshot._kernels.DECLARED`` give back the values the
extensions were built with, and ``tests/test_layers.py`` holds them equal. The generator runs this
file as it is, without importing memlens: its constants are plain integers and it imports nothing
of memlens.
"""

from __future__ import annotations

from collections.abc import Sequence

K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20  # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20  # "small" allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20 << 20  # "large" allocations may be packed in 20 MiB segments
K_MIN_LARGE_ALLOC = 10 << 20  # allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 << 20  # round up large allocations to 2 MiB
# CUDAAllocatorConfig keeps one division count per power-of-two size interval, from 1 MiB
# (log2 = 20, "1") to 32 GiB ("32768", which also covers everything larger): 16 intervals.
ROUNDUP_INTERVALS = 16
ROUNDUP_INTERVAL_START_LOG2 = 20
# What the model covers, on both engines (the native one keeps every address sum inside int64):
# requests up to 2**60 bytes, segments between address 0 and 2**62. PyTorch's own addresses are
# user-space pointers (under 2**57); a file with others gets the same answer from either engine.
MAX_MODELLED_REQUEST = 1 << 60
MAX_MODELLED_ADDRESS = 1 << 62


def round_size(size: int, divisions: Sequence[int]) -> int:
    """``round_size``: 512-byte multiples, or power-of-2 divisions where configured
    (``divisions``: one count per interval, 0 = plain 512-byte rounding)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    count = divisions_for(size, divisions)
    if count > 1 and size > K_MIN_BLOCK_SIZE * count:
        return _roundup_power2_next_division(size, count)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def divisions_for(size: int, divisions: Sequence[int]) -> int:
    """The division count of the interval ``size`` falls in."""
    log_size = size.bit_length() - 1
    index = log_size - ROUNDUP_INTERVAL_START_LOG2 if log_size > ROUNDUP_INTERVAL_START_LOG2 else 0
    return divisions[min(index, ROUNDUP_INTERVALS - 1)]


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step
