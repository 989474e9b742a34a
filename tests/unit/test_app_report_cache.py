"""The dashboard's report cache is bounded in bytes, not only in count: each upload of a small
gzip holding millions of tiny events grew the server by ~270 MB, six of them 1.6 GB."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import memlens
from memlens.analysis import analyze_snapshot
from memlens_app import library as library_module
from memlens_app.library import Library, analysis_bytes
from tests.conftest import SAMPLE_SNAPSHOTS_DIR


def _fake_worker(sizes: dict[str, int]) -> Any:
    def analyse(path: str, **_: Any) -> Any:
        return SimpleNamespace(name=Path(path).name, bytes=sizes[Path(path).name])
    return analyse


def test_reports_past_the_byte_budget_are_evicted_oldest_first(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    sizes = {"a.pickle": 300, "b.pickle": 300, "c.pickle": 300, "huge.pickle": 5_000}
    monkeypatch.setattr(library_module, "analyse_in_worker", _fake_worker(sizes))
    monkeypatch.setattr(library_module, "analysis_bytes", lambda report: report.bytes)
    library = Library(report_cache=6, report_cache_bytes=1_000)
    try:
        ids = {}
        for name in sizes:
            (tmp_path / name).write_bytes(b"x")
            ids[name] = library.add_path(tmp_path / name).id
        for name in ("a.pickle", "b.pickle", "c.pickle"):
            library.analysis(ids[name])
        assert library.cached_ids() == [ids["a.pickle"], ids["b.pickle"], ids["c.pickle"]]
        assert library.cached_bytes() == 900
        library.analysis(ids["a.pickle"])  # used again: the most recent
        library.analysis(ids["huge.pickle"])  # over the budget alone: kept (the page shows it), alone
        assert library.cached_ids() == [ids["huge.pickle"]] and library.cached_bytes() == 5_000
        library.analysis(ids["b.pickle"])
        assert library.cached_ids() == [ids["b.pickle"]]
        library.analysis(ids["c.pickle"])
        assert library.cached_ids() == [ids["b.pickle"], ids["c.pickle"]]
        library.clear_reports()
        assert library.cached_bytes() == 0
    finally:
        library.close()


def test_analysis_bytes_follows_the_memory_an_analysis_holds() -> None:
    """The estimate is within a factor of two of what tracemalloc sees the analysis hold."""
    path = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        analysis = analyze_snapshot(memlens.load(path, cache=False))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held / 2 < analysis_bytes(analysis) < 2 * held + (1 << 20)
    assert analysis_bytes(SimpleNamespace()) > 0  # anything else the worker may send costs something


def test_the_mcp_servers_analyses_are_bounded_in_bytes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlens import mcp_server
    from memlens.files import open_regular

    analyses = mcp_server._Analyses(kept=4)
    samples = sorted(SAMPLE_SNAPSHOTS_DIR.glob("*.pickle"))[:3]
    for path in samples:
        with open_regular(path) as opened:
            analyses.get(opened, None)
    assert len(analyses.entries) == 3
    monkeypatch.setattr(mcp_server, "KEPT_ANALYSES_BYTES", 1)  # every analysis is over it alone
    with open_regular(samples[0]) as opened:
        analyses.get(opened, 80 << 30)
    assert [key[0] for key in analyses.entries] == [str(samples[0])]
