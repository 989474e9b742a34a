from __future__ import annotations

import pytest

from memlens.errors import MemlensUsageError
from memlens.units import GiB, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * GiB), ("24GB", 24_000_000_000), ("1.5e9", 1_500_000_000), (4096, 4096),
     ("512 MiB", 512 << 20), ("2g", 2_000_000_000)],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "big", "-1GB", "10 parsecs", True])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(MemlensUsageError):
        parse_bytes(text)


def test_format_bytes_names_the_unit() -> None:
    assert format_bytes(3 * GiB) == "3.00 GiB"
    assert format_bytes(112e9, binary=False) == "112.00 GB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(-2 * 2**20) == "-2.00 MiB"
