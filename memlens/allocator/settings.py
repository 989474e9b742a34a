"""The caching allocator's knobs: ``PYTORCH_CUDA_ALLOC_CONF`` and the snapshot's ``allocator_settings``.

The fields, PyTorch's checks on them and their reading from a snapshot are the snapshot's
(``memlens.snapshot.allocator_settings``, which the block sizes read); ``AllocatorSettings`` adds
what the allocator does with them. Parsing follows ``c10/cuda/CUDAAllocatorConfig.cpp`` so that a
string a user would put in the environment means the same thing to the simulator as to PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import msgspec

from memlens.errors import MemlensUsageError
from memlens.snapshot.allocator_settings import (
    MIN_MAX_SPLIT_SIZE_MB,
    ROUNDUP_KEYS_MB,
    RecordedAllocatorSettings,
    check_divisions,
)
from memlens.snapshot.block_rules import ROUNDUP_INTERVALS
from memlens.units import MiB

# Options PyTorch accepts that change nothing the simulator models (threads, locks, host memory).
_IGNORED_OPTIONS = frozenset(
    {
        "backend",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "graph_capture_record_stream_reuse",
        "per_process_memory_fraction",
        "max_non_split_rounding_mb",
    }
)


def _parse_bool(key: str, value: str) -> bool:
    if value in ("True", "true", "1"):
        return True
    if value in ("False", "false", "0"):
        return False
    raise MemlensUsageError(f"allocator option {key} expects True or False, got {value!r}")


@dataclass(frozen=True)
class AllocatorSettings(RecordedAllocatorSettings):
    """The caching allocator's settings (fields and checks: ``RecordedAllocatorSettings``, what a
    snapshot records), with what the allocator package does with them: ``PYTORCH_CUDA_ALLOC_CONF``
    read and written, the what-if changes, the limit a memory fraction sets and the
    ``allocator_settings`` record a simulated snapshot carries."""

    def allowed_bytes(self, capacity: int | None) -> int | None:
        """``set_fraction`` in PyTorch: the limit the allocator keeps to below the device total
        (a fraction under 1, or garbage collection, which needs one); None without a limit."""
        if capacity is not None and (self.memory_fraction < 1.0 or self.garbage_collection_threshold > 0):
            return int(self.memory_fraction * capacity)
        return None

    def with_changes(
        self,
        *,
        expandable_segments: bool | None = None,
        max_split_size_mb: int | None = None,
        garbage_collection_threshold: float | None = None,
    ) -> AllocatorSettings:
        """These settings with the what-if knobs a user turns (``None``: as they are); the one
        mapping ``memlens whatif``'s flags and the MCP ``whatif`` tool share."""
        changes: dict[str, Any] = {}
        if expandable_segments is not None:
            changes["expandable_segments"] = expandable_segments
        if max_split_size_mb is not None:
            changes["max_split_size"] = max_split_size_mb * MiB
        if garbage_collection_threshold is not None:
            changes["garbage_collection_threshold"] = garbage_collection_threshold
        return replace(self, **changes)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_alloc_conf(cls, conf: str) -> AllocatorSettings:
        """Parse ``PYTORCH_CUDA_ALLOC_CONF``, e.g. ``"expandable_segments:True,max_split_size_mb:128"``."""
        values: dict[str, Any] = {}
        for key, value in _split_conf(conf):
            if key == "max_split_size_mb":
                megabytes = _parse_int(key, value)
                if megabytes <= MIN_MAX_SPLIT_SIZE_MB:
                    raise MemlensUsageError(
                        f"max_split_size_mb too small: must be > {MIN_MAX_SPLIT_SIZE_MB}, got {megabytes}"
                    )
                values["max_split_size"] = megabytes * MiB
            elif key == "roundup_power2_divisions":
                values["roundup_power2_divisions"] = _parse_divisions(value)
            elif key == "garbage_collection_threshold":
                try:
                    threshold = float(value)
                except ValueError:
                    raise MemlensUsageError(f"garbage_collection_threshold: not a number: {value!r}") from None
                if not 0.0 < threshold < 1.0:
                    raise MemlensUsageError(f"garbage_collection_threshold must be in (0, 1), got {value}")
                values["garbage_collection_threshold"] = threshold
            elif key == "expandable_segments":
                values["expandable_segments"] = _parse_bool(key, value)
            elif key in _IGNORED_OPTIONS or key.startswith("pinned_"):
                continue
            else:
                raise MemlensUsageError(f"unknown PYTORCH_CUDA_ALLOC_CONF option {key!r}")
        return cls(**values)

    # ------------------------------------------------------------------ output
    def to_alloc_conf(self) -> str:
        parts = []
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if any(self.divisions):
            inner = ",".join(f"{k}:{v}" for k, v in zip(ROUNDUP_KEYS_MB, self.divisions, strict=True) if v)
            parts.append(f"roundup_power2_divisions:[{inner}]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        return ",".join(parts)

    def snapshot_record(self) -> SnapshotAllocatorSettings:
        """The ``allocator_settings`` PyTorch (2.9) writes into a snapshot, as a struct."""
        return SnapshotAllocatorSettings(
            alloc_conf=self.to_alloc_conf(),
            max_split_size=-1 if self.max_split_size is None else self.max_split_size,
            garbage_collection_threshold=self.garbage_collection_threshold,
            expandable_segments=self.expandable_segments,
            roundup_power2_divisions={str(k): v for k, v in zip(ROUNDUP_KEYS_MB, self.divisions, strict=True)},
        )

    def to_snapshot_dict(self) -> dict[str, Any]:
        """The ``allocator_settings`` dict PyTorch (2.9) writes into a snapshot."""
        return msgspec.to_builtins(self.snapshot_record())


class SnapshotAllocatorSettings(msgspec.Struct, frozen=True):
    """A snapshot's ``allocator_settings`` as PyTorch 2.9 writes them (the keys it has, in its order)."""

    alloc_conf: str = msgspec.field(name="PYTORCH_CUDA_ALLOC_CONF")
    max_split_size: int = -1  # -1: no limit
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    pinned_num_register_threads: int = 1
    release_lock_on_cudamalloc: bool = False
    pinned_use_cuda_host_register: bool = False
    graph_capture_record_stream_reuse: bool = False
    roundup_power2_divisions: dict[str, int] = msgspec.field(default_factory=dict)


def _split_conf(conf: str) -> list[tuple[str, str]]:
    """``"a:1,b:[1:2,>:4],c:x"`` -> [("a", "1"), ("b", "[1:2,>:4]"), ("c", "x")]."""
    pairs: list[tuple[str, str]] = []
    depth = 0
    current = ""
    items: list[str] = []
    for char in conf.replace(" ", ""):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    for item in items:
        if not item:
            continue
        key, sep, value = item.partition(":")
        if not sep or not value:
            raise MemlensUsageError(f"PYTORCH_CUDA_ALLOC_CONF item {item!r} is not key:value")
        pairs.append((key, value))
    return pairs


def _parse_int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise MemlensUsageError(f"allocator option {key} expects an integer, got {value!r}") from None


def _parse_divisions(value: str) -> dict[int, int] | int:
    """``"4"`` or ``"[256:1,512:2,>:8]"`` as CUDAAllocatorConfig::parseRoundUpPower2Divisions reads it."""
    if not value.startswith("["):
        return check_divisions(_parse_int("roundup_power2_divisions", value))
    if not value.endswith("]"):
        raise MemlensUsageError(f"roundup_power2_divisions: unbalanced brackets in {value!r}")
    divisions = [0] * ROUNDUP_INTERVALS
    last_index = 0
    for item in value[1:-1].split(","):
        key, sep, count_text = item.partition(":")
        if not sep:
            raise MemlensUsageError(f"roundup_power2_divisions item {item!r} is not size:divisions")
        count = check_divisions(_parse_int("roundup_power2_divisions", count_text))
        if key == ">":
            # PyTorch fills from the last named interval onwards (that one included).
            for i in range(last_index, ROUNDUP_INTERVALS):
                divisions[i] = count
            continue
        size_mb = _parse_int("roundup_power2_divisions", key)
        if size_mb < 1 or size_mb & (size_mb - 1):
            raise MemlensUsageError(f"roundup_power2_divisions size {key!r} must be a power of 2 (MB)")
        index = min(size_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if last_index == 0:
            for i in range(index):
                divisions[i] = count
        divisions[index] = count
        last_index = index
    return {ROUNDUP_KEYS_MB[i]: v for i, v in enumerate(divisions) if v}
