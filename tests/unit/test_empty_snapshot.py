"""An empty snapshot (a device, no segments, no trace) says it is empty, on every face, rather
than "nothing stood out": nothing was looked at."""

from __future__ import annotations

import pickle
from pathlib import Path

from click.testing import CliRunner

from memlens.analysis import analyze
from memlens.analysis.report import no_findings_text
from memlens.cli.main import cli
from memlens.reporters.html import render_html
from memlens.snapshot.reader import parse
from memlens_app.panels.timeline import findings_panel
from tests.unit.tracebuilder import MODEL, MiB, TraceBuilder

EMPTY = {"segments": [], "device_traces": [[]]}


def _text(component: object) -> str:
    children = getattr(component, "children", component)
    if isinstance(children, list | tuple):
        return " ".join(_text(c) for c in children)
    return str(children)


def test_an_empty_snapshot_says_it_is_empty(tmp_path: Path) -> None:
    report = analyze(parse(EMPTY, source="<empty>"))
    device = report.device(None)
    assert device.empty and device.findings == []
    assert device.notes[0].startswith("the snapshot is empty on this device: no segments and no trace entries")
    path = tmp_path / "empty.pickle"
    path.write_bytes(pickle.dumps(EMPTY))
    out = CliRunner().invoke(cli, ["triage", str(path), "--width", "200", "--no-color"]).output
    assert "none: the snapshot is empty on this device (no segments, no trace entries)" in out
    assert "stood out" not in out
    assert "The snapshot is empty on this device" in render_html(report)
    assert "stood out" not in render_html(report)
    assert "The snapshot is empty on this device" in _text(findings_panel(device))


def test_a_snapshot_with_history_and_no_finding_still_says_nothing_stood_out() -> None:
    b = TraceBuilder()
    address = b.alloc(4 * MiB, MODEL)
    b.free(address)
    device = analyze(b.snapshot()).device(None)
    assert not device.empty
    assert no_findings_text(device) == "no leak, activation plateau, optimizer spike, fragmentation or OOM stood out"
    assert not any("empty" in note for note in device.notes)
