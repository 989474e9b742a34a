"""The lens services (memlens.ops.group) and moments from text (memlens.ops.moments)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from memlens.analysis import analyze_snapshot
from memlens.analysis.lenses.groups import group_live
from memlens.analysis.lenses.inputs import lens_inputs_of
from memlens.analysis.lenses.lines import file_lines
from memlens.analysis.lenses.moments import Row, StepNumber, Time, Window, resolve_moment
from memlens.analysis.lenses.rules import parse_rules
from memlens.analysis.lenses.stages import annotation_stages, summarize_stages
from memlens.errors import MemlensUsageError
from memlens.ops.group import (
    GroupOptions,
    GroupResultRecord,
    LinesOptions,
    LinesResultRecord,
    StagesResultRecord,
    group,
    lines,
    stages,
)
from memlens.ops.moments import moment_from_text, parse_point, parse_window
from tests.unit.tracebuilder import MODEL, MiB, training_run

# --------------------------------------------------------------------------- moments from text


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1234", Row(1234)), ("1234567us", Time(1234567)), ("1234567µs", Time(1234567)),
     ("+1.5s", Time(1_500_000, since_start=True)), ("+20ms", Time(20_000, since_start=True)),
     ("step3", StepNumber(3)), ("step#4", StepNumber(4)), (" Step 5 ", StepNumber(5))],
)
def test_parse_point(text: str, expected: Any) -> None:
    assert parse_point(text) == expected


@pytest.mark.parametrize("text", ["", "-3", "1.5", "step", "12 parsecs", "3h"])
def test_parse_point_rejects(text: str) -> None:
    with pytest.raises(MemlensUsageError, match="cannot read the moment"):
        parse_point(text)


def test_windows_from_text() -> None:
    assert parse_window("10:40") == Window(Row(10), Row(40))
    assert parse_window(":") == Window()
    assert parse_window("step2:+1s") == Window(StepNumber(2), Time(1_000_000, since_start=True))
    assert parse_window(":500us") == Window(None, Time(500))
    with pytest.raises(MemlensUsageError, match="use A:B"):
        parse_window("10")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"at": "3", "step": 1}, "give one of {at}, {window} and {step}, not {at} and {step}"),
     ({"at": "soon"}, "{at}: cannot read the moment 'soon'"),
     ({"window": "10"}, "{window}: cannot read the window '10'"),
     ({"window": "1:x"}, "{window}: cannot read the moment 'x'"),
     ({"at": "1" + "0" * 5000}, "{at}: the moment")],
)
@pytest.mark.parametrize("names", [("--at", "--window", "--step"), ("at", "window", "step")])
def test_moment_text_errors_name_the_option_as_the_caller_does(kwargs: dict[str, Any], message: str,
                                                               names: tuple[str, str, str]) -> None:
    """The CLI's errors say --at, the MCP server's say at: each face names its own options."""
    at, window, step = names
    with pytest.raises(MemlensUsageError) as raised:
        moment_from_text(**kwargs, names=names)
    assert str(raised.value).startswith(message.format(at=at, window=window, step=step)[:12])
    assert message.format(at=at, window=window, step=step) in str(raised.value)
    if not at.startswith("--"):
        assert "--" not in str(raised.value)


@pytest.mark.parametrize("spec", [Row(3), Time(5, since_start=True), StepNumber(2), Window(Row(1), StepNumber(4)),
                                  Window(None, Time(9))])
def test_a_typed_moment_travels_as_json_and_back(spec: Any) -> None:
    import msgspec

    from memlens.analysis.lenses.moments import MomentSpec

    assert msgspec.json.decode(msgspec.json.encode(spec), type=MomentSpec) == spec
    assert msgspec.json.decode(b'{"type": "row", "event": 7}', type=MomentSpec) == Row(7)


def test_moment_from_text_gives_the_typed_value() -> None:
    assert moment_from_text() is None
    assert moment_from_text(at="17") == Row(17)
    assert moment_from_text(window="3:") == Window(Row(3), None)
    assert moment_from_text(step=2) == StepNumber(2)


# --------------------------------------------------------------------------- services


@pytest.fixture(scope="module")
def analysis() -> Any:
    b = training_run(3)
    with b.scope("forward"):
        b.alloc(3 * MiB, MODEL)
    return analyze_snapshot(b.snapshot())


def test_group_is_the_engines_breakdown_at_the_resolved_moment(analysis: Any) -> None:
    inputs = lens_inputs_of(analysis)
    for spec in (None, Row(5), StepNumber(1), Window(Row(10), Row(40))):
        moment = resolve_moment(inputs, spec)
        result = group(analysis, GroupOptions(by="annotation", moment=spec))
        assert result.groups == group_live(inputs, "annotation", moment.event, (), moment)
        assert result.device == inputs.device and result.source == analysis.report.source
        assert result.start_us == int(inputs.trace.time_us[0])
        payload = result.to_json()
        assert set(payload) == {"source", "device", "groups"}
        assert sum(g["bytes"] for g in payload["groups"]["groups"]) == payload["groups"]["allocated_bytes"]


def test_group_by_category_at_the_peak_is_the_reports_categories(analysis: Any) -> None:
    result = group(analysis, GroupOptions())
    expected = {k: v for k, v in analysis.device().categories_at_peak.items() if v}
    assert {g.name: g.bytes for g in result.groups.groups} == expected


def test_group_mistakes(analysis: Any) -> None:
    with pytest.raises(MemlensUsageError, match="needs at least one rule"):
        group(analysis, GroupOptions(by="rules"))
    with pytest.raises(MemlensUsageError, match="cannot group by 'colour'"):
        group(analysis, GroupOptions(by="colour"))
    with pytest.raises(MemlensUsageError, match="no device 7"):
        group(analysis, GroupOptions(device=7))
    rules = tuple(parse_rules({"rules": {"model": r"model\.py"}}))
    names = {g.name for g in group(analysis, GroupOptions(by="rules", rules=rules)).groups.groups}
    assert names <= {"model", "other"} and "model" in names


def test_stages_and_lines_are_the_engines(analysis: Any) -> None:
    inputs = lens_inputs_of(analysis)
    result = stages(analysis)
    assert result.by_name == summarize_stages(annotation_stages(inputs))
    assert {s["name"] for s in result.to_json()["stages"]["by_name"]} >= {"forward"}
    assert len(result.to_json()["stages"]["runs"]) == len(annotation_stages(inputs))
    at_step = lines(analysis, LinesOptions(path="model.py", moment=StepNumber(1)))
    assert at_step.file == file_lines(inputs, "model.py", resolve_moment(inputs, StepNumber(1)))
    assert at_step.to_json()["file"]["moment"]["how"] == "step"
    with pytest.raises(MemlensUsageError, match="no frame of any recorded stack"):
        lines(analysis, LinesOptions(path="nosuch.py"))


def test_each_lens_results_json_decodes_back_into_its_type(analysis: Any) -> None:
    """The JSON is the encoding of one struct, so a reader gets the same typed value back."""
    answers = [(group(analysis, GroupOptions(by="annotation", moment=spec)), GroupResultRecord)
               for spec in (None, StepNumber(1), Window(Row(10), Row(40)))]
    answers += [(stages(analysis), StagesResultRecord),
                (lines(analysis, LinesOptions(path="model.py", moment=StepNumber(1))), LinesResultRecord)]
    for result, record_type in answers:
        record = result.record()
        assert isinstance(record, record_type)
        assert msgspec.json.decode(json.dumps(result.to_json()), type=record_type) == record
        assert msgspec.json.decode(msgspec.json.encode(record)) == result.to_json()


# --------------------------------------------------------------------------- the MCP tool


def test_the_mcp_group_by_tool_is_ops_group_and_names_its_own_arguments() -> None:
    from memlens.mcp_server import Tools
    from tests.conftest import SAMPLE_SNAPSHOTS_DIR

    sample = str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle")
    tools = Tools()
    analysis = analyze_snapshot(sample)
    payload = tools.group_by(sample, "module", at="step2", file="train_tiny.py")
    expected = group(analysis, GroupOptions(by="module", moment=StepNumber(2))).to_json()
    assert {k: v for k, v in payload.items() if k != "file"} == expected
    file = lines(analysis, LinesOptions(path="train_tiny.py", moment=StepNumber(2)))
    assert payload["file"] == file.to_json()["file"]
    for kwargs, message in (({"at": "soon"}, "at: cannot read the moment 'soon'"),
                            ({"at": "3", "step": 1}, "give one of at, window and step, not at and step"),
                            ({"window": "9"}, "window: cannot read the window '9'")):
        with pytest.raises(MemlensUsageError, match=message) as raised:
            tools.group_by(sample, **kwargs)
        assert "--" not in str(raised.value)
