"""``memlens plan``'s spec parsing, configurations and bisection: no torch, no child process."""

from __future__ import annotations

import pytest

from memlens.errors import MemlensUsageError
from memlens.plan.configurations import Configuration, check_placeholders, expand, substitute
from memlens.plan.levers import Lever, alloc_conf, cost_key, parse_max, parse_spec, parse_vary
from memlens.plan.search import largest_fitting


def test_a_spec_is_levers_joined_by_plus() -> None:
    assert parse_spec("ckpt+lora=8+lora-targets=q,v") == (
        Lever("ckpt"),
        Lever("lora", "8"),
        Lever("lora-targets", "q,v"),
    )
    assert parse_spec("optim=paged-adamw8bit+expandable+max-split=128")[2] == Lever("max-split", "128")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty"),
        ("ckp", "unknown lever 'ckp'"),
        ("lora", "lora needs a value"),
        ("ckpt=1", "ckpt takes no value"),
        ("lora=0", "a positive whole number"),
        ("optim=adam9bit", "one of adamw8bit, paged-adamw8bit, adafactor, sgd"),
        ("ckpt+sac", "ckpt and sac cannot be combined"),
        ("lora=4+qlora=4", "lora and qlora cannot be combined"),
        ("ckpt+ckpt", "ckpt given twice"),
        ("lora-targets=q", "lora-targets needs lora=R or qlora=R"),
        ("lora=4+lora-targets=q;v", "module names separated by commas"),
    ],
)
def test_a_bad_spec_is_one_line(spec: str, message: str) -> None:
    with pytest.raises(MemlensUsageError, match=message) as raised:
        parse_spec(spec)
    assert "\n" not in str(raised.value)


def test_vary_and_max_parse_and_check() -> None:
    assert parse_vary("B=1,2,4") == ("B", ("1", "2", "4"))
    assert parse_max("B=1..256") == ("B", 1, 256)
    for bad in ("B", "B=", "1B=2", "B=1,,2"):
        with pytest.raises(MemlensUsageError, match="--vary"):
            parse_vary(bad)
    for bad in ("B=1-256", "B=9..3", "B=..4"):
        with pytest.raises(MemlensUsageError, match="--max"):
            parse_max(bad)
    with pytest.raises(MemlensUsageError, match=r"has no \{B\}"):
        check_placeholders(["python", "t.py"], ["B"])
    with pytest.raises(MemlensUsageError, match=r"says \{S\}"):
        check_placeholders(["python", "t.py", "--seq={S}"], [])
    assert substitute(["t.py", "--batch={B}", "{B}x{S}"], {"B": "4", "S": "8"}) == ["t.py", "--batch=4", "4x8"]


def test_the_baseline_comes_first_at_every_value() -> None:
    configurations = expand([(Lever("ckpt"),), (), (Lever("ckpt"),)], [("B", ("1", "2"))])
    assert [c.label() for c in configurations] == ["baseline B=1", "baseline B=2", "ckpt B=1", "ckpt B=2"]
    assert Configuration(levers=(Lever("lora", "8"),)).slug() == "lora=8"


def test_allocator_levers_become_the_alloc_conf() -> None:
    levers = parse_spec("expandable+max-split=64")
    assert alloc_conf(levers, "garbage_collection_threshold:0.8") == (
        "garbage_collection_threshold:0.8,expandable_segments:True,max_split_size_mb:64"
    )
    assert alloc_conf((), "") == ""


def test_costs_order_the_levers() -> None:
    cheap, dear = cost_key(parse_spec("expandable")), cost_key(parse_spec("offload=optimizer"))
    assert cost_key(()) < cheap < cost_key(parse_spec("optim=adamw8bit")) < cost_key(parse_spec("ckpt")) < dear
    assert cost_key(parse_spec("ckpt")) < cost_key(parse_spec("ckpt+expandable+optim=sgd"))


@pytest.mark.parametrize("answer", [0, 1, 2, 3, 17, 63, 64, 100])
def test_bisection_is_exact(answer: int) -> None:
    asked: list[int] = []

    def fits(value: int) -> bool:
        assert value not in asked
        asked.append(value)
        return value <= answer

    found = largest_fitting(fits, 1, 64)
    if answer < 1:
        assert found is None
    elif answer >= 64:
        assert found == 64
    else:
        assert found == answer and answer + 1 in asked  # the next value was predicted not to fit
    assert len(asked) <= 2 + 6
