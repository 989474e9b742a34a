"""The caching allocator's settings as a snapshot records them: what its blocks were rounded and
split under.

A snapshot's ``allocator_settings`` (PyTorch 2.3 on) say how the recorded allocator rounded and
split; ``memlens.snapshot.blocks`` reads them to recover every row's block bytes. The allocator
package extends the same settings (``memlens.allocator.settings.AllocatorSettings``:
``PYTORCH_CUDA_ALLOC_CONF``, the what-if changes, the record a simulated snapshot carries), so the
checks, which follow ``c10/cuda/CUDAAllocatorConfig.cpp``, are made here once for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from memlens.errors import MemlensUsageError
from memlens.snapshot.block_rules import ROUNDUP_INTERVALS
from memlens.units import MiB, format_bytes

# The snapshot's keys of the division counts: one per interval, in MB (1, 2, 4, ... 32768).
ROUNDUP_KEYS_MB: tuple[int, ...] = tuple(1 << i for i in range(ROUNDUP_INTERVALS))

# max_split_size_mb must exceed kLargeBuffer (20 MiB): PyTorch rejects smaller values.
MIN_MAX_SPLIT_SIZE_MB = 20

_Settings = TypeVar("_Settings", bound="RecordedAllocatorSettings")


def check_divisions(value: int) -> int:
    """A division count as PyTorch accepts it: 0, or a power of 2."""
    if value != 0 and (value < 1 or value & (value - 1)):
        raise MemlensUsageError(f"roundup_power2_divisions values must be powers of 2, got {value}")
    return value


def _normalise_divisions(value: dict[int, int] | dict[str, int] | int | None) -> tuple[int, ...]:
    """One division count per interval (0 = plain 512-byte rounding)."""
    if value is None:
        return (0,) * ROUNDUP_INTERVALS
    if isinstance(value, bool):
        raise MemlensUsageError(f"roundup_power2_divisions must be an int or a dict, got {value!r}")
    if isinstance(value, int):
        return (check_divisions(value),) * ROUNDUP_INTERVALS
    divisions = [0] * ROUNDUP_INTERVALS
    for key, count in value.items():
        try:
            size_mb = int(key)
        except (TypeError, ValueError):
            raise MemlensUsageError(f"roundup_power2_divisions key {key!r} is not a size in MB") from None
        if size_mb < 1 or size_mb & (size_mb - 1):
            raise MemlensUsageError(f"roundup_power2_divisions key {key!r} must be a power of 2 (MB)")
        index = min(int(math.log2(size_mb)), ROUNDUP_INTERVALS - 1)
        divisions[index] = check_divisions(int(count))
    return tuple(divisions)


@dataclass(frozen=True)
class RecordedAllocatorSettings:
    """What ``PYTORCH_CUDA_ALLOC_CONF`` (plus a memory fraction) tells the caching allocator.

    ``max_split_size`` is in bytes (``None`` = unset, PyTorch's SIZE_MAX);
    ``roundup_power2_divisions`` is one int for every size or ``{size_mb: divisions}`` keyed
    like the snapshot (``1`` = requests below 2 MiB, ``2`` = [2, 4) MiB, ... ``32768`` = 32 GiB+).
    ``garbage_collection_threshold`` and ``memory_fraction`` only act when the simulator knows
    the device capacity (PyTorch needs ``set_per_process_memory_fraction`` for the former).
    """

    max_split_size: int | None = None
    roundup_power2_divisions: dict[int, int] | int | None = field(default=None, compare=False)
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    memory_fraction: float = 1.0
    # The normalised form (one count per interval) is what equality compares.
    divisions: tuple[int, ...] = field(init=False, repr=False, compare=True)

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size <= MIN_MAX_SPLIT_SIZE_MB * MiB:
            raise MemlensUsageError(
                f"max_split_size must be more than {MIN_MAX_SPLIT_SIZE_MB} MiB "
                f"(PyTorch rejects smaller values), got {format_bytes(self.max_split_size)}"
            )
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise MemlensUsageError(
                f"garbage_collection_threshold must be in [0, 1), got {self.garbage_collection_threshold}"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise MemlensUsageError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        object.__setattr__(self, "divisions", _normalise_divisions(self.roundup_power2_divisions))

    @property
    def max_split_size_or_max(self) -> int:
        """The value the allocator compares against: SIZE_MAX when unset."""
        return self.max_split_size if self.max_split_size is not None else (1 << 64) - 1

    @classmethod
    def from_snapshot_dict(cls: type[_Settings], settings: dict[str, Any] | None) -> _Settings:
        """Settings from a snapshot's ``allocator_settings`` (missing before PyTorch 2.3: defaults)."""
        if not settings:
            return cls()
        max_split = settings.get("max_split_size", -1)
        max_split_size = None if max_split is None or int(max_split) < 0 else int(max_split)
        if max_split_size is not None and max_split_size >= (1 << 63):
            max_split_size = None
        raw_divisions = settings.get("roundup_power2_divisions")
        divisions: dict[int, int] | None = None
        if isinstance(raw_divisions, dict):
            divisions = {int(k): int(v) for k, v in raw_divisions.items() if int(v)}
        elif isinstance(raw_divisions, list | tuple):
            listed = raw_divisions[:ROUNDUP_INTERVALS]
            divisions = {ROUNDUP_KEYS_MB[i]: int(v) for i, v in enumerate(listed) if v}
        return cls(
            max_split_size=max_split_size,
            roundup_power2_divisions=divisions or None,
            garbage_collection_threshold=float(settings.get("garbage_collection_threshold", 0.0) or 0.0),
            expandable_segments=bool(settings.get("expandable_segments", False)),
        )
