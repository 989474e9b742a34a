"""Lenses (memlens.analysis.lenses): group-by at any moment, moments, stages, per source file.

Moments from text (``--at``/``--window``/``--step``) are the faces' (``memlens.ops.moments``):
tests/unit/test_ops_group.py."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memlens.analysis import analyze, analyze_snapshot
from memlens.analysis.lenses.groups import group_live
from memlens.analysis.lenses.inputs import LensInputs, allocated_at, exact_bincount, lens_inputs_of
from memlens.analysis.lenses.labels import (
    BEFORE_HISTORY,
    GROUP_BYS,
    NO_ANNOTATION,
    NO_COMPILE_CONTEXT,
    NO_MODULE,
    NO_STACK,
    UNACCOUNTED,
)
from memlens.analysis.lenses.lines import diff_file_lines, file_lines, file_matches
from memlens.analysis.lenses.moments import Row, StepNumber, Time, Window, resolve_moment
from memlens.analysis.lenses.rules import (
    MAX_RULES,
    MAX_RULES_FILE_BYTES,
    Rule,
    first_rule_per_frame,
    load_rules,
    parse_rules,
)
from memlens.analysis.lenses.stages import annotation_stages, interval_peaks, stage_name, summarize_stages
from memlens.analysis.live import breakdown
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import Snapshot
from memlens.snapshot.reader import parse
from tests.unit.tracebuilder import BACKWARD, LOSS, MODEL, OPTIM_WINDOWS, TEMP, MiB, TraceBuilder, frame, training_run


def lens_inputs(snapshot: Snapshot, device: int | None = None) -> LensInputs:
    """The one way lens inputs are built: from the analysis of the snapshot."""
    return lens_inputs_of(analyze_snapshot(snapshot), device)


def groups_of(inputs: LensInputs, group_by: str, event: int | None, rules: list[Rule] | None = None) -> dict[str, int]:
    result = group_live(inputs, group_by, event, rules or [])
    assert sum(g.bytes for g in result.groups) == result.allocated_bytes == allocated_at(inputs.trace, event)
    return {g.name: g.bytes for g in result.groups}


def last_row(b: TraceBuilder) -> int:
    return len(b.trace) - 1


# --------------------------------------------------------------------------- group-by


def test_category_is_what_analyze_says_at_every_row() -> None:
    snapshot = training_run(3).snapshot()
    report = analyze(snapshot)
    inputs = lens_inputs(snapshot)
    peak = report.device(0).peak_allocated_event
    assert groups_of(inputs, "category", peak) == {k: v for k, v in report.device(0).categories_at_peak.items() if v}
    for event in range(0, len(inputs.trace), 37):
        expected, _ = breakdown(inputs.index, inputs.trace, event)
        assert groups_of(inputs, "category", event) == {k: v for k, v in expected.items() if v}


def _scoped_run() -> tuple[TraceBuilder, int]:
    """A ghost block, then allocations inside outer, inside inner (nested), after inner, and outside."""
    b = TraceBuilder()
    b.ghost(3 * MiB, MODEL)
    with b.scope("outer"):
        b.alloc(1 * MiB, MODEL)
        with b.scope("inner"):
            b.alloc(2 * MiB, LOSS)
        b.alloc(4 * MiB, TEMP)
    b.alloc(8 * MiB, BACKWARD)
    return b, last_row(b)


def test_annotation_is_the_innermost_scope_open_at_the_allocation() -> None:
    b, end = _scoped_run()
    inputs = lens_inputs(b.snapshot())
    assert groups_of(inputs, "annotation", end) == {
        "outer": 5 * MiB, "inner": 2 * MiB, NO_ANNOTATION: 8 * MiB, BEFORE_HISTORY: 3 * MiB}


def test_interleaved_scopes_close_by_name() -> None:
    """Two threads' scopes interleave: A opens, B opens, A ends; B is still the open one."""
    b = TraceBuilder()
    b.annotate("A", "START")
    b.annotate("B", "START")
    b.alloc(1 * MiB, MODEL)
    b.annotate("A", "END")
    b.alloc(2 * MiB, MODEL)
    b.annotate("B", "END")
    b.alloc(4 * MiB, MODEL)
    inputs = lens_inputs(b.snapshot())
    assert groups_of(inputs, "annotation", 2) == {"B": 3 * MiB, NO_ANNOTATION: 4 * MiB}


@pytest.mark.timeout(120)
def test_unmatched_ends_cost_no_scan_each() -> None:
    """100,000 STARTs never closed, then 100,000 ENDs of another name: linear, not quadratic."""
    b = TraceBuilder()
    for _ in range(100_000):
        b.annotate("open forever", "START")
    for _ in range(100_000):
        b.annotate("never opened", "END")
    b.alloc(MiB, MODEL)
    assert groups_of(lens_inputs(b.snapshot()), "annotation", 0) == {"open forever": MiB}


def test_module_groups_forward_and_backward_scopes_of_a_module_and_ignores_other_scopes() -> None:
    b = TraceBuilder()
    with b.scope("memlens.forward#layers.0"):
        b.alloc(1 * MiB, MODEL)
        with b.scope("aten::linear"):  # not a module scope: the module stays layers.0
            b.alloc(2 * MiB, MODEL)
        with b.scope("memlens.forward#layers.0.mlp"):
            b.alloc(4 * MiB, MODEL)
    with b.scope("memlens.backward#layers.0"):
        b.alloc(8 * MiB, BACKWARD)
    b.alloc(16 * MiB, LOSS)
    inputs = lens_inputs(b.snapshot())
    assert groups_of(inputs, "module", last_row(b)) == {
        "layers.0": 11 * MiB, "layers.0.mlp": 4 * MiB, NO_MODULE: 16 * MiB}


def test_compile_context_of_the_alloc_row() -> None:
    b = TraceBuilder()
    b.ghost(1 * MiB, MODEL)
    for size in (2 * MiB, 4 * MiB, 8 * MiB):
        b.alloc(size, MODEL)
    raw = b.raw()
    contexts = iter(["torch-compiled-region 0/0", "", "torch-compiled-region 0/0"])
    for entry in raw["device_traces"][0]:
        entry["compile_context"] = next(contexts)
    inputs = lens_inputs(parse(raw))
    assert groups_of(inputs, "compile_context", 2) == {
        "torch-compiled-region 0/0": 10 * MiB, NO_COMPILE_CONTEXT: 4 * MiB, BEFORE_HISTORY: 1 * MiB}


def test_file_frame_and_stack_from_the_frames() -> None:
    b = TraceBuilder()
    b.alloc(1 * MiB, MODEL)
    b.alloc(2 * MiB, BACKWARD)
    b.alloc(4 * MiB, None)
    b.alloc(8 * MiB, [frame("forward", "/work/proj/model.py", 10), frame("main", "/work/proj/run.py", 3)])
    inputs = lens_inputs(b.snapshot())
    end = last_row(b)
    # file: the first user frame (torch's autograd frames are skipped for the user's train.py:30).
    assert groups_of(inputs, "file", end) == {
        "/work/proj/model.py:10": 9 * MiB, "/work/proj/train.py:30": 2 * MiB, NO_STACK: 4 * MiB}
    # frame: the innermost Python frame, inside torch or not.
    assert groups_of(inputs, "frame", end) == {
        "forward (/work/proj/model.py:10)": 9 * MiB,
        "_engine_run_backward (/venv/site-packages/torch/autograd/graph.py:824)": 2 * MiB, NO_STACK: 4 * MiB}
    # stack: the whole displayed stack, so two callers of one line are two groups.
    assert groups_of(inputs, "stack", end) == {
        "forward (/work/proj/model.py:10) ← main (/work/proj/run.py:3)": 8 * MiB,
        "forward (/work/proj/model.py:10) ← train (/work/proj/train.py:5)": 1 * MiB,
        "train (/work/proj/train.py:30)": 2 * MiB, NO_STACK: 4 * MiB}


def test_rules_first_match_wins_and_the_rest_is_other() -> None:
    b = TraceBuilder()
    b.alloc(1 * MiB, MODEL)  # forward in model.py
    b.alloc(2 * MiB, LOSS)  # cross_entropy in train.py
    b.alloc(4 * MiB, TEMP)  # softmax in model.py
    b.alloc(8 * MiB, BACKWARD)
    inputs = lens_inputs(b.snapshot())
    end = last_row(b)
    rules = parse_rules({"rules": [{"name": "forward", "pattern": r"^forward "},
                                   {"name": "model", "pattern": r"model\.py"},
                                   {"name": "loss", "pattern": "cross_entropy"}]})
    assert groups_of(inputs, "rules", end, rules) == {"forward": 1 * MiB, "model": 4 * MiB, "loss": 2 * MiB,
                                                      "other": 8 * MiB}
    reordered = [rules[1], rules[0], rules[2]]  # model.py first: it takes the forward block too
    assert groups_of(inputs, "rules", end, reordered) == {"model": 5 * MiB, "loss": 2 * MiB, "other": 8 * MiB}


def test_rules_that_share_a_name_are_one_group() -> None:
    b = TraceBuilder()
    b.alloc(1 * MiB, MODEL)
    b.alloc(2 * MiB, LOSS)
    inputs = lens_inputs(b.snapshot())
    rules = parse_rules([{"name": "mine", "pattern": "forward"}, {"name": "mine", "pattern": "cross_entropy"}])
    assert groups_of(inputs, "rules", 1, rules) == {"mine": 3 * MiB}


def test_rules_files_json_and_toml(tmp_path: Path) -> None:
    as_json = tmp_path / "rules.json"
    as_json.write_text(json.dumps({"rules": {"attention": "attn|attention", "kv cache": "kv_cache"}}))
    as_toml = tmp_path / "rules.toml"
    as_toml.write_text('[[rules]]\nname = "attention"\npattern = "attn|attention"\n\n'
                       '[[rules]]\nname = "kv cache"\npattern = "kv_cache"\n')
    for path in (as_json, as_toml):
        rules = load_rules(path)
        assert [r.name for r in rules] == ["attention", "kv cache"]
        assert rules[0].pattern.search("self_attn (model.py:3)")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"rules": [{"name": "x", "pattern": "(unclosed"}]}', "bad regular expression"),
        ('{"rules": []}', "non-empty list of rules"),
        ('{"rules": [{"name": "x"}]}', "rule 1 needs a 'name' and a 'pattern'"),
        ('{"rules": [{"name": "x", "pattern": 3}]}', "rule 1 needs"),
        ("this is neither", "not JSON"),
        ('{"rules": [{"name": "x", "pattern": "(a)\\\\1"}]}', "no backreferences"),
        ('{"rules": [{"name": "x", "pattern": "(?<=a)b"}]}', "no backreferences or lookaround"),
        ('{"rules": [{"name": "x", "pattern": "a{4294967295}"}]}', "counts over 1,000"),
        ('{"rules": [{"name": "x", "pattern": "a{2,1001}"}]}', "counts over 1,000"),
    ],
)
def test_bad_rules_files_are_usage_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rules.cfg"
    path.write_text(text)
    with pytest.raises(MemlensUsageError, match=message):
        load_rules(path)


def stacks_named(*names: str) -> LensInputs:
    b = TraceBuilder()
    for name in names:
        b.alloc(1 * MiB, [frame(name, "/work/proj/model.py", 3)])
    return lens_inputs(b.snapshot())


@pytest.mark.timeout(60)
def test_a_catastrophic_pattern_is_matched_in_linear_time() -> None:
    """``(a+)+$`` against a long run of a's: Python's re backtracks for ever (and holds the GIL,
    so the MCP server froze with it); RE2 cannot."""
    inputs = stacks_named("a" * 5000, "forward")
    rules = parse_rules([{"name": "evil", "pattern": "(a+)+$"}, {"name": "runs", "pattern": "a{3}"}])
    assert groups_of(inputs, "rules", 1, rules) == {"runs": 1 * MiB, "other": 1 * MiB}


@pytest.mark.timeout(120)
def test_five_thousand_rules_scan_each_frame_once() -> None:
    names = [f"layer_{i}_forward" for i in range(3000)]
    inputs = stacks_named(*names)
    rules = parse_rules([{"name": f"rule {i}", "pattern": rf"layer_{i}_(forward|backward)\b"} for i in range(5000)])
    groups = groups_of(inputs, "rules", len(names) - 1, rules)
    assert len(groups) == 3000 and groups["rule 2999"] == 1 * MiB


def test_first_rule_per_frame_takes_the_smallest_index_and_reads_lone_surrogates() -> None:
    rules = parse_rules([{"name": "b", "pattern": "b"}, {"name": "a", "pattern": "a"}, {"name": "s", "pattern": "x"}])
    assert first_rule_per_frame(rules, ["ab", "a", "q\udc80x", "zzz"]).tolist() == [0, 1, 2, 3]


def test_a_text_the_rule_set_fails_on_is_matched_rule_by_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """RE2's set reports nothing when its DFA runs out of memory: no match must not be inferred."""
    import re2

    rules = parse_rules([{"name": "b", "pattern": "b"}, {"name": "a", "pattern": "a"}])
    real = re2.Set.SearchSet

    class Failing:
        def __init__(self, options: Any) -> None:
            self.inner = real(options)

        def Add(self, pattern: str) -> int:
            return int(self.inner.Add(pattern))

        def Compile(self) -> None:
            self.inner.Compile()

        def Match(self, text: bytes) -> None:
            return None

    monkeypatch.setattr(re2.Set, "SearchSet", staticmethod(Failing))
    assert first_rule_per_frame(rules, ["ab", "a", "zz"]).tolist() == [0, 1, 2]


@pytest.mark.timeout(30)
def test_the_rules_file_must_be_a_regular_file_of_bounded_size(tmp_path: Path) -> None:
    fifo = tmp_path / "rules.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer for ever
    with pytest.raises(MemlensUsageError, match="not a regular file"):
        load_rules(fifo)
    with pytest.raises(MemlensUsageError, match="a folder"):
        load_rules(tmp_path)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"rules": {"x": "y" * MAX_RULES_FILE_BYTES}}))
    with pytest.raises(MemlensUsageError, match="larger than 1,048,576 bytes"):
        load_rules(big)
    many = tmp_path / "many.json"
    many.write_text(json.dumps([{"name": "x", "pattern": "y"}] * (MAX_RULES + 1)))
    with pytest.raises(MemlensUsageError, match="at most 10,000"):
        load_rules(many)


def test_missing_rules_file_and_rules_without_a_file(tmp_path: Path) -> None:
    with pytest.raises(MemlensUsageError, match="cannot read the rules file"):
        load_rules(tmp_path / "absent.json")
    with pytest.raises(MemlensUsageError, match="needs at least one rule"):
        group_live(lens_inputs(training_run(1).snapshot()), "rules", 0)
    with pytest.raises(MemlensUsageError, match="unknown grouping"):
        group_live(lens_inputs(training_run(1).snapshot()), "colour", 0)


def test_bytes_the_lifetimes_miss_are_a_group_of_their_own() -> None:
    """A history that lost rows: the curve counts bytes no lifetime holds. They stay in the sum."""
    b, end = _scoped_run()
    inputs = lens_inputs(b.snapshot())
    index = inputs.index
    dropped = int(np.argmax(index.size == 4 * MiB))
    keep = np.arange(index.size.size) != dropped
    thinner = dataclasses.replace(index, alloc_event=index.alloc_event[keep], free_event=index.free_event[keep],
                                  size=index.size[keep], stack_id=index.stack_id[keep],
                                  category=index.category[keep])
    lossy = dataclasses.replace(inputs, index=thinner)
    assert groups_of(lossy, "annotation", end)[UNACCOUNTED] == 4 * MiB
    category = groups_of(lossy, "category", end)
    assert UNACCOUNTED not in category and category["unknown"] >= 4 * MiB  # as categories_at_peak does


def test_exact_bincount_beyond_float_precision() -> None:
    sizes = np.array([(1 << 53) + 1, 1, (1 << 55) + 3, 7], dtype=np.int64)
    totals = exact_bincount(np.array([0, 0, 1, 1]), sizes, 3)
    assert totals.tolist() == [(1 << 53) + 2, (1 << 55) + 10, 0]


# --------------------------------------------------------------------------- moments


def test_moments_resolve_to_rows() -> None:
    b = training_run(3)
    inputs = lens_inputs(b.snapshot())
    trace = inputs.trace
    assert resolve_moment(inputs).event == int(np.argmax(trace.allocated))
    assert resolve_moment(inputs, Row(17)).event == 17
    # A time on the trace's clock: the last row at or before it (rows are 10 µs apart).
    t17 = int(trace.time_us[17])
    assert resolve_moment(inputs, Time(t17)).event == 17
    assert resolve_moment(inputs, Time(t17 + 5)).event == 17
    assert resolve_moment(inputs, Time(t17 - int(trace.time_us[0]), since_start=True)).event == 17
    assert resolve_moment(inputs, Time(int(trace.time_us[0]) - 1)).event == -1  # before the first row
    step = inputs.steps[1]
    in_step = trace.allocated[step.start_event:step.end_event]
    expected = step.start_event + int(np.argmax(in_step))
    moment = resolve_moment(inputs, StepNumber(step.index))
    assert moment.event == expected and moment.window == (step.start_event, step.end_event - 1)
    assert moment.how == "step" and moment.text == f"the peak of step {step.index}"
    window = resolve_moment(inputs, Window(Row(10), Row(40)))
    assert window.event == 10 + int(np.argmax(trace.allocated[10:41])) and window.window == (10, 40)
    assert window.text == "the peak of events 10–40"
    assert resolve_moment(inputs, Window()).event == resolve_moment(inputs).event
    assert resolve_moment(inputs, Window(StepNumber(step.index), StepNumber(step.index))).event == expected
    by_time = resolve_moment(inputs, Window(Time(int(trace.time_us[10])), Time(int(trace.time_us[40]))))
    assert by_time.window == (10, 40)
    assert resolve_moment(inputs, Window(None, Row(5))).window == (0, 5)


@pytest.mark.parametrize(
    ("spec", "message"),
    [(StepNumber(99), "no step 99"), (StepNumber(0), "no step 0"), (Row(100000), "outside the trace"),
     (Window(Row(40), Row(10)), "the window events 40–10 holds no trace rows"),
     (Window(StepNumber(1), Row(100000)), "outside the trace")],
)
def test_moment_mistakes_name_the_moment_and_no_option(spec: Any, message: str) -> None:
    """The core is shared by every face: its errors say what is wrong with the moment, never
    which command-line flag gave it (the CLI says --at, the MCP server at)."""
    inputs = lens_inputs(training_run(3).snapshot())
    with pytest.raises(MemlensUsageError, match=message) as raised:
        resolve_moment(inputs, spec)
    assert "--" not in str(raised.value)


def test_a_time_needs_times() -> None:
    b = TraceBuilder(with_time=False)
    b.alloc(MiB, MODEL)
    inputs = lens_inputs(b.snapshot())
    with pytest.raises(MemlensUsageError, match="has no times"):
        resolve_moment(inputs, Time(1_000_000, since_start=True))
    assert groups_of(inputs, "annotation", 0) == {"(no times recorded)": MiB}


# --------------------------------------------------------------------------- stages


def test_stages_say_what_each_scope_added_and_its_peak() -> None:
    b = TraceBuilder()
    b.alloc(1 * MiB, MODEL)
    with b.scope("forward"):
        keep = b.alloc(4 * MiB, MODEL)
        temp = b.alloc(8 * MiB, TEMP)
        b.free(temp)
    with b.scope("backward"):
        b.free(keep)
    with b.scope("forward"):
        b.alloc(2 * MiB, MODEL)
    inputs = lens_inputs(b.snapshot())
    stages = annotation_stages(inputs)
    assert [(s.name, s.bytes_at_start, s.added_bytes, s.peak_bytes) for s in stages] == [
        ("forward", 1 * MiB, 4 * MiB, 13 * MiB), ("backward", 5 * MiB, -4 * MiB, 5 * MiB),
        ("forward", 1 * MiB, 2 * MiB, 3 * MiB)]
    summary = {s.name: s for s in summarize_stages(stages)}
    assert summary["forward"].runs == 2 and summary["forward"].added_bytes == 6 * MiB
    assert summary["forward"].max_added_bytes == 4 * MiB and summary["forward"].peak_bytes == 13 * MiB
    assert summary["backward"].added_bytes == -4 * MiB


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 5), min_size=1, max_size=40),
       ranges=st.lists(st.tuples(st.integers(0, 45), st.integers(-1, 45)), max_size=20))
def test_interval_peaks_is_max_and_first_argmax(values: list[int], ranges: list[tuple[int, int]]) -> None:
    array = np.array(values, dtype=np.int64)
    n = len(values)
    first = np.array([min(a, n - 1) for a, _ in ranges], dtype=np.int64)
    last = np.array([min(b, n - 1) for _, b in ranges], dtype=np.int64)
    peak, row = interval_peaks(array, first, last)
    for i, (a, b) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
        if b < a:
            assert (peak[i], row[i]) == (np.iinfo(np.int64).min, -1)
        else:
            assert peak[i] == max(values[a:b + 1]) and row[i] == a + values[a:b + 1].index(peak[i])


def test_step_markers_are_one_stage_name_module_numbers_are_not() -> None:
    assert stage_name("memlens.step#12") == stage_name("memlens.step#3") == "memlens.step#N"
    assert stage_name("ProfilerStep#7") == "ProfilerStep#N"
    assert stage_name("memlens.forward#0") == "memlens.forward#0"  # a module named "0"


def test_the_default_device_is_the_one_the_report_details() -> None:
    """Device 0 has more rows, device 1 the higher peak: both choose device 1."""
    busy = TraceBuilder()
    for _ in range(10):
        busy.free(busy.alloc(MiB, MODEL))
    heavy = TraceBuilder()
    heavy.alloc(64 * MiB, MODEL)
    raw = heavy.raw()
    for segment in raw["segments"]:
        segment["device"] = 1
    raw["device_traces"] = [busy.trace, heavy.trace]
    snapshot = parse(raw)
    assert analyze(snapshot).device().device == 1
    assert lens_inputs(snapshot).device == 1 and lens_inputs(snapshot, 0).device == 0


# --------------------------------------------------------------------------- per source file


def test_file_matches_whole_path_parts() -> None:
    assert file_matches("/work/proj/model.py", "model.py")
    assert file_matches("/work/proj/model.py", "proj/model.py")
    assert file_matches("/work/proj/model.py", "/work/proj/model.py")
    assert file_matches("C:\\proj\\train.py", "proj/train.py")
    assert not file_matches("/work/proj/mymodel.py", "model.py")


def test_file_lines_at_the_peak_and_the_files_own_peak() -> None:
    b = TraceBuilder()
    b.alloc(1 * MiB, MODEL)  # model.py:10
    b.alloc(2 * MiB, TEMP)  # model.py:30
    b.alloc(4 * MiB, LOSS)  # train.py only
    inputs = lens_inputs(b.snapshot())
    result = file_lines(inputs, "model.py")
    assert result.files == ["/work/proj/model.py"]
    assert [(r.line, r.function, r.bytes) for r in result.lines] == [(30, "softmax", 2 * MiB), (10, "forward", 1 * MiB)]
    assert result.file_bytes == 3 * MiB and result.elsewhere_bytes == 4 * MiB
    assert (result.file_peak_event, result.file_peak_bytes) == (1, 3 * MiB)
    # train.py appears in every stack: each block counts at its innermost train.py frame.
    train = file_lines(inputs, "train.py")
    assert {r.line: r.bytes for r in train.lines} == {5: 3 * MiB, 20: 4 * MiB}
    assert train.elsewhere_bytes == 0


def test_an_unknown_file_is_a_usage_error_with_a_hint() -> None:
    b = TraceBuilder()
    b.alloc(MiB, OPTIM_WINDOWS)
    b.alloc(MiB, MODEL)
    with pytest.raises(MemlensUsageError, match=r"did you mean /work/proj/model.py"):
        file_lines(lens_inputs(b.snapshot()), "Model")


def test_diff_file_lines_per_line_growth() -> None:
    def run(second: int) -> LensInputs:
        b = TraceBuilder()
        b.alloc(1 * MiB, MODEL)
        b.alloc(second, TEMP)
        return lens_inputs(b.snapshot())

    result = diff_file_lines(run(2 * MiB), run(6 * MiB), "model.py")
    assert [(c.line, c.before_bytes, c.after_bytes, c.delta_bytes) for c in result.lines] == [
        (30, 2 * MiB, 6 * MiB, 4 * MiB), (10, 1 * MiB, 1 * MiB, 0)]
    payload = result.to_json()
    assert payload["file_bytes"] == {"before": 3 * MiB, "after": 7 * MiB, "delta": 4 * MiB}


# --------------------------------------------------------------------------- property


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 64 * MiB), st.integers(0, 4)),
        st.tuples(st.just("free"), st.integers(0, 1000), st.just(0)),
        st.tuples(st.just("open"), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("close"), st.integers(0, 2), st.just(0)),
    ),
    min_size=1, max_size=60,
)
STACKS = [MODEL, LOSS, TEMP, BACKWARD, None]
SCOPES = ["memlens.forward#a", "memlens.backward#a.b", "Optimizer.step"]


@settings(max_examples=60, deadline=None)
@given(ops=OPS, ghosts=st.lists(st.integers(1, 8 * MiB), max_size=3), data=st.data())
def test_groups_sum_to_allocated_at_random_moments(ops: list[tuple[str, int, int]], ghosts: list[int],
                                                   data: st.DataObject) -> None:
    b = TraceBuilder()
    for size in ghosts:
        b.ghost(size, MODEL)
    live: list[int] = []
    for op, value, stack in ops:
        if op == "alloc":
            live.append(b.alloc(value, STACKS[stack]))
        elif op == "free" and live:
            b.free(live.pop(value % len(live)))
        elif op in ("open", "close"):
            b.annotate(SCOPES[value], "START" if op == "open" else "END")
    if not b.trace:
        b.alloc(MiB, MODEL)
    inputs = lens_inputs(b.snapshot())
    rules = parse_rules({"rules": {"model": r"model\.py", "loss": "cross_entropy"}})
    event = data.draw(st.integers(-1, len(inputs.trace) - 1))
    for group_by in GROUP_BYS:
        result = group_live(inputs, group_by, event, rules)
        assert sum(g.bytes for g in result.groups) == result.allocated_bytes == allocated_at(inputs.trace, event)
        assert sum(g.blocks for g in result.groups) == int(inputs.index.live_mask(event).sum())


def test_no_event_means_the_peak_as_live_at_does() -> None:
    """``group_live(inputs, g)`` with no row is the peak (a trace with rows), never every lifetime
    at once against the baseline."""
    from memlens.analysis import live_at
    from memlens.analysis.lenses.moments import whole_peak

    analysis = analyze_snapshot(training_run(3).snapshot())
    inputs = lens_inputs_of(analysis)
    at_peak = group_live(inputs, "category", whole_peak(inputs.trace))
    default = group_live(inputs, "category")
    assert default.groups == at_peak.groups and default.allocated_bytes == at_peak.allocated_bytes
    assert default.allocated_bytes == analysis.device().peak_allocated_bytes == live_at(analysis, None).total_bytes
    assert sum(g.bytes for g in group_live(inputs, "file").groups) == default.allocated_bytes
