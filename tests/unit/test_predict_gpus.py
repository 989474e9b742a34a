"""``memlens predict --gpu NAME``: the names people type reach the right board."""

from __future__ import annotations

import math

import pytest

from memlens.errors import MemlensUsageError
from memlens.predict.gpus import GPU_NAMES_HELP, GPUS, checked_reserve, fit_basis, gpu_spec, printed_gib, with_capacity


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


# What torch reports (its OOM message's "total capacity", ``get_device_properties().total_memory``)
# on each board, at most: issue 32's figures and the cited messages, in GiB. nvidia-smi's MiB
# totals (T4 15.00, A100 80.00, H100 79.65, RTX 4090 23.99, A10G and L4 22.49 GiB) are larger:
# a run that fits by less than the difference was told it fits and then ran out.
TORCH_REPORTS_AT_MOST_GIB = {
    "t4": 14.75, "a100-80gb": 79.25, "h100-80gb": 79.20, "rtx4090": 23.65, "a10g": 21.99, "l4": 22.03,
    "h200": 139.80,
}
NVIDIA_SMI_MIB = {"t4": 15_360, "a100-80gb": 81_920, "h100-80gb": 81_559, "rtx4090": 24_564, "a10g": 23_028,
                  "l4": 23_034, "a100-40gb": 40_960, "l40s": 46_068, "rtx3090": 24_576, "h100-94gb": 95_830,
                  "h200": 143_771}


@pytest.mark.parametrize("key", sorted(TORCH_REPORTS_AT_MOST_GIB))
def test_a_board_is_as_big_as_torch_says_not_as_nvidia_smi_says(key: str) -> None:
    total = GPUS[key].total_memory
    assert total <= TORCH_REPORTS_AT_MOST_GIB[key] * (1 << 30) + (5 << 20)  # within the printed rounding
    assert total < NVIDIA_SMI_MIB[key] << 20


@pytest.mark.parametrize("key", sorted(GPUS))
def test_every_board_says_where_its_figure_comes_from(key: str) -> None:
    spec = GPUS[key]
    assert spec.source_kind in ("published", "measured", "estimated")
    if spec.source_kind == "published":
        assert "https://github.com/" in spec.source and ("torch" in spec.source or "deviceQuery" in spec.source)
    if key in NVIDIA_SMI_MIB:
        assert spec.total_memory < NVIDIA_SMI_MIB[key] << 20


def test_the_h200_is_the_figure_torch_reported_on_ours() -> None:
    """Measured on an H200 on 2026-12-04 (tests/data/h200/extra.txt): the board is torch's
    total_memory to the byte, and its source says when, with which torch and driver."""
    import json
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "data" / "h200" / "extra.txt").read_text()
    measured = json.loads(text[:text.index("\nOOM message:")])
    spec = GPUS["h200"]
    assert spec.total_memory == measured["total_memory"] == measured["mem_get_info_total"] == 150_109_880_320
    assert "total capacity of 139.80 GiB" in text and f"{spec.total_memory / (1 << 30):.2f}" == "139.80"
    assert spec.source_kind == "measured" and (spec.major, spec.minor) == tuple(measured["capability"])
    assert "2026-12-04" in spec.source and "torch 2.11.0+cu130" in spec.source and "driver 580.159.04" in spec.source


def test_a_printed_figure_is_taken_at_the_least_it_can_be() -> None:
    assert printed_gib(14.56) == math.ceil(14.555 * (1 << 30))
    assert f"{printed_gib(14.56) / (1 << 30):.2f}" == "14.56"  # torch would print the same figure


def test_capacity_without_a_gpu_says_whose_behaviour_it_kept() -> None:
    basis = fit_basis(None, 24 * 10**9, 0)
    text = "\n".join(basis.lines())
    assert "--capacity 22.35 GiB" in text and "= 22.35 GiB for PyTorch's allocator" in text
    assert "--capacity without --gpu keeps the a100-80gb's behaviour: compute capability 8.0" in text
    assert "cuBLAS workspace 8.12 MiB" in text and "CUDA context" in text
    named = "\n".join(fit_basis("h100", 24 * 10**9, 1 << 30).lines())
    assert "board behaviour (h100-80gb): compute capability 9.0, cuBLAS workspace 32.00 MiB" in named
    assert "- 1.00 GiB --reserve-outside = 21.35 GiB" in named


def test_the_fit_names_the_boards_figure_and_what_the_reserve_took() -> None:
    text = "\n".join(fit_basis("t4", None, 1 << 30).lines())
    assert "14.56 GiB (the t4 as torch reports it, published) - 1.00 GiB --reserve-outside = 13.56 GiB" in text


def test_a_reserve_as_big_as_the_board_is_refused_in_the_users_units() -> None:
    with pytest.raises(MemlensUsageError) as refused:
        checked_reserve(GPUS["a100-80gb"], 100 << 30)
    assert str(refused.value) == ("--reserve-outside 100.00 GiB is more than the NVIDIA A100-SXM4-80GB's 79.14 GiB: "
                                  "it would leave PyTorch's allocator nothing")
    with pytest.raises(MemlensUsageError, match=r"more than the --capacity 1\.00 GiB"):
        checked_reserve(with_capacity(GPUS["t4"], 1 << 30), 2 << 30)
