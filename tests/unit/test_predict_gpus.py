"""``memlens predict --gpu NAME``: the names people type reach the right board."""

from __future__ import annotations

import pytest

from memlens.errors import MemlensUsageError
from memlens.predict.gpus import GPU_NAMES_HELP, GPUS, gpu_spec


@pytest.mark.parametrize(
    ("typed", "key"),
    [
        ("H100", "h100-80gb"),
        ("h100", "h100-80gb"),
        ("A100", "a100-80gb"),
        ("a100-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("H100 NVL", "h100-94gb"),
        ("h200", "h200"),
        ("RTX 4090", "rtx4090"),
        ("rtx-3090", "rtx3090"),
        ("Tesla T4", "t4"),
        ("L40", "l40s"),  # a prefix only one board has
        ("NVIDIA L4", "l4"),
        ("V100-32GB", "v100-32gb"),
    ],
)
def test_names_people_type(typed: str, key: str) -> None:
    assert gpu_spec(typed).key == key


@pytest.mark.parametrize("key", sorted(GPUS))
def test_every_key_and_marketing_name_finds_its_board(key: str) -> None:
    assert gpu_spec(key).key == key
    assert gpu_spec(key.upper()).key == key
    assert gpu_spec(GPUS[key].name).key == key


@pytest.mark.parametrize("typed", ["a10", "v100", "h1"])
def test_an_ambiguous_prefix_names_the_candidates(typed: str) -> None:
    with pytest.raises(MemlensUsageError, match="ambiguous"):
        gpu_spec(typed)


@pytest.mark.parametrize("typed", ["b200", "", "  ", "mi300x"])
def test_an_unknown_name_lists_the_known_ones(typed: str) -> None:
    with pytest.raises(MemlensUsageError, match=r"unknown GPU .*h100-80gb"):
        gpu_spec(typed)


def test_the_help_lists_every_board_and_the_aliases() -> None:
    assert all(key in GPU_NAMES_HELP for key in GPUS)
    assert "H100 = h100-80gb" in GPU_NAMES_HELP and "case-insensitive" in GPU_NAMES_HELP.lower()
