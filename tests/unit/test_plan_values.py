"""Odd ``memlens plan`` values (issue 33): each is one usage line, never a ValueError from int()
or a folder name the file system refuses."""

from __future__ import annotations

import pytest

from memlens.errors import MemlensUsageError
from memlens.plan.configurations import Configuration
from memlens.plan.levers import parse_max, parse_spec, parse_vary

DIGITS_5000 = "9" * 5000
NAME_MAX = 255  # bytes in one file name on Linux's file systems


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (parse_max, f"B=1..{DIGITS_5000}"),
        (parse_max, f"B={DIGITS_5000}..{DIGITS_5000}"),
        (parse_vary, f"B=1,{DIGITS_5000}"),
        (parse_spec, f"lora={DIGITS_5000}"),
        (parse_spec, f"max-split={DIGITS_5000}"),
        (parse_spec, "max-split=\u00b2"),  # a superscript two: str.isdigit() says yes, int() says no
        (parse_spec, "lora=0"),
    ],
    ids=["max-hi", "max-both", "vary", "lora", "max-split", "superscript", "zero"],
)
def test_numbers_past_any_bound_are_one_usage_line(parse: object, text: str) -> None:
    with pytest.raises(MemlensUsageError) as raised:
        parse(text)  # type: ignore[operator]
    message = str(raised.value)
    assert "\n" not in message and len(message) < 400, message


def test_a_whole_number_vary_value_is_a_number_and_a_superscript_is_text() -> None:
    assert parse_vary("B=1,\u00b2,x") == ("B", ("1", "\u00b2", "x"))
    assert parse_max("B=1..256") == ("B", 1, 256)


@pytest.mark.parametrize(
    "configuration",
    [
        Configuration(values={"B": "x" * 300}),
        Configuration(levers=parse_spec("lora=8+lora-targets=" + ",".join(f"layer{i}" for i in range(200)))),
        Configuration(values={"B": "\u00e9" * 300}),
    ],
    ids=["vary", "lora-targets", "accents"],
)
def test_a_configuration_folder_name_fits_the_file_system(configuration: Configuration) -> None:
    slug = configuration.slug()
    assert len(f"00-{slug}".encode()) <= NAME_MAX
    assert "/" not in slug and slug.isascii()


def test_long_labels_that_share_a_beginning_get_different_folders() -> None:
    first = Configuration(values={"B": "x" * 300 + "1"}).slug()
    second = Configuration(values={"B": "x" * 300 + "2"}).slug()
    assert first != second
    assert Configuration(values={"B": "8"}).slug() == "baseline_B=8"  # short labels as before


@pytest.mark.parametrize("option", ["--jobs", "--world-size"])
@pytest.mark.parametrize("value", ["0", DIGITS_5000], ids=["zero", "5000-digits"])
def test_plan_counts_are_one_usage_line(option: str, value: str) -> None:
    from click.testing import CliRunner

    from memlens.cli.main import cli

    result = CliRunner().invoke(cli, ["plan", option, value, "--", "python", "train.py"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"memlens: error: {option}"), result.output
