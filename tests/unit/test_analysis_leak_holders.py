"""The leak finding names what holds it: the recorder's ``leak_holders`` sidecar entries matched
to the leak's surviving blocks by address (memlens.recorder.holders writes them)."""

from __future__ import annotations

from typing import Any

from memlens.analysis import Finding, analyze
from tests.unit.tracebuilder import LEAKY, MiB, TraceBuilder, training_run


def _leak(builder: TraceBuilder, sidecar: dict[str, Any]) -> Finding:
    (leak,) = [f for f in analyze(builder.snapshot(sidecar)).findings if f.kind == "leak"]
    return leak


def _leaked_addresses(builder: TraceBuilder) -> list[int]:
    """Addresses of the blocks the LEAKY stack left alive at the end, oldest first."""
    return sorted(address for address, (_, frames) in builder.live.items() if frames is LEAKY)


def _holder(text: str, addresses: list[int], line: str | None = "train.py:40",
            code: str = "kept.append(logits)", how: str = "append") -> dict[str, Any]:
    lines = [] if line is None else [{"file": line.split(":")[0], "line": int(line.split(":")[1]),
                                      "how": how, "code": code}]
    return {"holder": text, "kind": "global", "line": line, "lines": lines,
            "blocks": [[address, 8 * MiB] for address in addresses], "bytes": 8 * MiB * len(addresses)}


def test_the_leak_says_which_list_holds_it_and_the_line_that_appends() -> None:
    builder = training_run(6, leak=8 * MiB)
    leaked = _leaked_addresses(builder)
    assert len(leaked) == 6
    sidecar = {"leak_holders": {"holders": [_holder("list `kept` (global in train.py)", leaked)]}}
    leak = _leak(builder, sidecar)
    assert "Held by list `kept` (global in train.py), appended at train.py:40 (`kept.append(logits)`)" in leak.summary
    # steps 2-6 are the comparable ones; the warm-up step's survivor is kept by the list too
    assert "6 of the 6 leaked blocks alive at the dump (48.00 MiB)" in leak.summary
    assert leak.recommendation.startswith("Edit train.py:40 (`kept.append(logits)`)")
    assert "Find what keeps" not in leak.recommendation  # the named line is the fix, not a hunt
    assert leak.evidence["held_by"] == "list `kept` (global in train.py)"
    assert leak.evidence["held_by_line"] == "train.py:40"
    assert leak.evidence["held_by_blocks"] == 6 and leak.evidence["held_by_bytes"] == 48 * MiB
    assert leak.evidence["leak_blocks_at_dump"] == 6
    assert leak.bytes == leak.estimated_saving_bytes == 48 * MiB  # what clearing the list frees


def test_a_holder_of_other_blocks_is_not_named() -> None:
    builder = training_run(6, leak=8 * MiB)
    unrelated = {"leak_holders": {"holders": [_holder("dict `state` (global in train.py)", [0x1234_5000])]}}
    leak = _leak(builder, unrelated)
    assert "Held by" not in leak.summary and "held_by" not in leak.evidence
    assert leak.recommendation.startswith("Find what keeps tensors")


def test_several_holders_are_ranked_by_the_leak_bytes_they_hold() -> None:
    builder = training_run(6, leak=8 * MiB)
    leaked = _leaked_addresses(builder)
    sidecar = {"leak_holders": {"holders": [
        _holder("tensor `logits` (global in train.py)", leaked[-1:], "train.py:31", "logits = model(x)", "assignment"),
        _holder("list `kept` (global in train.py)", leaked),
    ]}}
    leak = _leak(builder, sidecar)
    assert leak.evidence["held_by"] == "list `kept` (global in train.py)"
    assert leak.evidence["holders_matched"] == 2
    assert "Also held by tensor `logits` (global in train.py): 1 block." in leak.summary


def test_a_holder_without_a_line_is_named_without_one() -> None:
    builder = training_run(6, leak=8 * MiB)
    sidecar = {"leak_holders": {"holders": [_holder("list (no name)", _leaked_addresses(builder), None)]}}
    leak = _leak(builder, sidecar)
    assert "Held by list (no name): 6 of the 6" in leak.summary
    assert "held_by_line" not in leak.evidence


def test_a_malformed_leak_holders_section_is_ignored() -> None:
    builder = training_run(6, leak=8 * MiB)
    for broken in ({"holders": "x"}, {"holders": [{"holder": 3}, {"holder": "x", "blocks": "y"},
                                                          {"holder": "y", "blocks": [["a", 1], [True, 2]]}]}):
        leak = _leak(builder, {"leak_holders": broken})
        assert "held_by" not in leak.evidence


def _store(line: int, code: str, values_from: list[int], function: str = "train") -> dict[str, Any]:
    return {"file": "train.py", "line": line, "how": "append", "code": code, "function": function,
            "first_line": 1, "last_line": 80, "values_from": values_from}


def _three_branches(builder: TraceBuilder, second: list[int]) -> dict[str, Any]:
    # the leaked blocks are allocated at train.py:50 (LEAKY): only the second store's value comes from there
    lines = [_store(60, "history.append(loss)", [45, 60]), _store(62, "history.append(out)", second),
             _store(64, "history.append(out * 2)", [64])]
    entry = _holder("list `history` (global in train.py)", _leaked_addresses(builder), "train.py:60")
    entry["lines"] = lines
    return {"leak_holders": {"holders": [entry]}}


def test_of_several_stores_the_one_whose_value_the_leaked_blocks_were_allocated_for_is_named() -> None:
    builder = training_run(6, leak=8 * MiB)
    leak = _leak(builder, _three_branches(builder, [50, 62]))
    assert leak.evidence["held_by_line"] == "train.py:62"
    assert leak.evidence["held_by_line_match"] == "allocation stacks"
    assert "appended at train.py:62 (`history.append(out)`)" in leak.summary
    assert leak.recommendation.startswith("Edit train.py:62 (`history.append(out)`)")
    assert "train.py:60" not in leak.summary + leak.recommendation


def test_stores_the_stacks_cannot_tell_apart_are_all_listed() -> None:
    builder = training_run(6, leak=8 * MiB)
    leak = _leak(builder, _three_branches(builder, [62]))  # no store's value comes from train.py:50
    assert "held_by_line" not in leak.evidence
    assert leak.evidence["held_by_line_match"] == "undecided"
    assert leak.evidence["held_by_lines"] == "train.py:60; train.py:62; train.py:64"
    assert "stored by one of 3 lines (memlens could not tell which one ran): train.py:60" in leak.summary
    assert leak.recommendation.startswith("Edit the one of these lines that runs")


def test_a_store_in_another_function_does_not_match() -> None:
    builder = training_run(6, leak=8 * MiB)
    sidecar = _three_branches(builder, [50, 62])
    sidecar["leak_holders"]["holders"][0]["lines"][1]["function"] = "evaluate"  # train.py:50 is in train()
    leak = _leak(builder, sidecar)
    assert leak.evidence["held_by_line_match"] == "undecided"


def test_malformed_store_lines_are_skipped_and_the_rest_still_named() -> None:
    builder = training_run(6, leak=8 * MiB)
    sidecar = _three_branches(builder, [50, 62])
    lines = sidecar["leak_holders"]["holders"][0]["lines"]
    lines[0].update(function=7, first_line="x", values_from="50")  # wrong types: no stack match
    lines.insert(0, {"file": 3, "line": True})  # not a line at all: skipped
    leak = _leak(builder, sidecar)
    assert leak.evidence["held_by_line"] == "train.py:62"


def test_the_recorder_s_struct_is_what_the_analysis_reads() -> None:
    """One struct on both sides: a ``LeakHolders`` as the recorder writes it (to JSON builtins)
    reads back equal, and the leak finding names its holder and line."""
    import msgspec

    from memlens.sidecar.leak_holders import Holder, LeakHolders, StoreLine, read_leak_holders

    builder = training_run(6, leak=8 * MiB)
    leaked = _leaked_addresses(builder)
    line = StoreLine("train.py", 40, "append", "kept.append(logits)", "train", 1, 80, (50,))
    written = LeakHolders(holders=[Holder("list `kept` (global in train.py)", kind="global", name="kept",
                                          container="list", lines=(line,), line=line.where,
                                          blocks=tuple((a, 8 * MiB) for a in leaked), blocks_total=6)])
    section = msgspec.json.decode(msgspec.json.encode(written))
    assert read_leak_holders(section) == written
    assert read_leak_holders(written) is written
    leak = _leak(builder, {"leak_holders": section})
    assert leak.evidence["held_by"] == "list `kept` (global in train.py)"
    assert leak.evidence["held_by_line"] == "train.py:40"


def test_a_holder_keeps_its_lines_that_fit_and_loses_the_rest() -> None:
    from memlens.sidecar.leak_holders import read_leak_holders

    section = {"holders": [{"holder": "list `kept`", "blocks": [[4096, 512]],
                            "lines": [{"file": "train.py", "line": 40}, {"file": 3, "line": True}]},
                           {"holder": 7}]}
    (holder,) = read_leak_holders(section).holders
    assert [line.where for line in holder.lines] == ["train.py:40"]
    assert holder.addresses == frozenset({4096})
