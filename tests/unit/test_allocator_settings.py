"""AllocatorSettings: PYTORCH_CUDA_ALLOC_CONF parsing and the snapshot's allocator_settings."""

from __future__ import annotations

import pytest

from memlens.allocator import AllocatorSettings
from memlens.errors import MemlensUsageError
from memlens.units import MiB

RECORDED = {
    "PYTORCH_CUDA_ALLOC_CONF": "",
    "max_split_size": -1,
    "garbage_collection_threshold": 0.0,
    "expandable_segments": False,
    "pinned_num_register_threads": 1,
    "release_lock_on_cudamalloc": False,
    "pinned_use_cuda_host_register": False,
    "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)},
}


def test_defaults_from_a_real_settings_dict() -> None:
    settings = AllocatorSettings.from_snapshot_dict(RECORDED)
    assert settings == AllocatorSettings()
    assert AllocatorSettings.from_snapshot_dict(None) == AllocatorSettings()


def test_snapshot_dict_round_trip() -> None:
    settings = AllocatorSettings(
        max_split_size=128 * MiB,
        roundup_power2_divisions={1: 4, 1024: 8},
        garbage_collection_threshold=0.6,
        expandable_segments=True,
    )
    written = settings.to_snapshot_dict()
    assert set(RECORDED) <= set(written)
    assert written["max_split_size"] == 128 * MiB
    assert written["roundup_power2_divisions"]["1024"] == 8
    assert AllocatorSettings.from_snapshot_dict(written) == settings
    uniform = AllocatorSettings(max_split_size=128 * MiB, roundup_power2_divisions=4, expandable_segments=True)
    assert AllocatorSettings.from_alloc_conf(uniform.to_alloc_conf()) == uniform


def test_alloc_conf() -> None:
    settings = AllocatorSettings.from_alloc_conf("expandable_segments:True,max_split_size_mb:128")
    assert settings.expandable_segments and settings.max_split_size == 128 * MiB
    assert AllocatorSettings.from_alloc_conf("roundup_power2_divisions:4").divisions == (4,) * 16
    bracketed = AllocatorSettings.from_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert bracketed.divisions[:8] == (1,) * 8  # the first entry also fills the intervals below it
    assert bracketed.divisions[8] == 1 and bracketed.divisions[9:] == (8,) * 7
    assert AllocatorSettings.from_alloc_conf("garbage_collection_threshold:0.8").garbage_collection_threshold == 0.8
    assert AllocatorSettings.from_alloc_conf("backend:native,pinned_use_cuda_host_register:True") == (
        AllocatorSettings()
    )


@pytest.mark.parametrize(
    "conf",
    [
        "max_split_size_mb:20",
        "max_split_size_mb:lots",
        "garbage_collection_threshold:1.5",
        "expandable_segments:maybe",
        "roundup_power2_divisions:3",
        "no_such_option:1",
        "max_split_size_mb",
    ],
)
def test_bad_alloc_conf(conf: str) -> None:
    with pytest.raises(MemlensUsageError):
        AllocatorSettings.from_alloc_conf(conf)


def test_bad_values() -> None:
    with pytest.raises(MemlensUsageError):
        AllocatorSettings(max_split_size=10 * MiB)
    with pytest.raises(MemlensUsageError):
        AllocatorSettings(memory_fraction=0.0)
    with pytest.raises(MemlensUsageError):
        AllocatorSettings(roundup_power2_divisions={3: 2})
