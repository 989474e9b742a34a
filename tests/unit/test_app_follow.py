"""memlens_app.follow without a browser: a followed folder's names as sources pointed at their newest
snapshot, and the timeline's band for the steps that arrived since the page's last look."""

from __future__ import annotations

import os
from pathlib import Path

import plotly.graph_objects as go
import pytest

from memlens_app.follow import FolderFollow, follow_components, mark_new_steps
from memlens_app.inputs import BadInput
from memlens_app.library import Library


def touch(path: Path, mtime_ns: int, data: bytes = b"x") -> None:
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_each_name_is_one_source_pointed_at_its_newest_snapshot(tmp_path: Path) -> None:
    library = Library()
    try:
        touch(tmp_path / "rank0.step000001.pickle", 1_000)
        follow = FolderFollow(tmp_path, library)
        _, followed = follow.refresh()
        assert [series for series, _ in followed] == ["rank0"]
        (source,) = library.sources()
        assert (source.kind, source.name, Path(source.path).name) == ("follow", "rank0", "rank0.step000001.pickle")
        touch(tmp_path / "rank0.step000003.pickle", 3_000)
        touch(tmp_path / "rank1.step000003.pickle", 2_000)
        _, followed = follow.refresh()
        assert [series for series, _ in followed] == ["rank1", "rank0"]  # the name written to last, last
        by_name = {s.name: Path(s.path).name for s in library.sources()}
        assert by_name == {"rank0": "rank0.step000003.pickle", "rank1": "rank1.step000003.pickle"}
        assert not library.point(followed[1][1], "rank0", tmp_path / "rank0.step000003.pickle", (1, 3_000))
        assert len(follow_components(follow)) == 3 and follow_components(None) == []
    finally:
        library.close()
    with pytest.raises(Exception, match="no such folder to follow"):
        FolderFollow(tmp_path / "gone", Library())


def figure() -> go.Figure:
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(x=[0.0, 10.0, 20.0, 30.0], y=[0, 1, 2, 3], name="allocated", customdata=[0, 100, 200, 300])
    )
    fig.layout.meta = {"x_axis": "event"}
    return fig


def test_the_new_steps_are_shaded_where_drawn_and_named_in_the_meta() -> None:
    tick = {"source": "f-1", "band": [100, 300], "new_steps": [4, 5]}
    shaded = mark_new_steps(figure(), tick, "f-1")
    (shape,) = shaded.layout.shapes
    assert (shape.x0, shape.x1) == (10.0, 30.0)  # rows placed by the curve's own points (seconds here)
    assert shaded.layout.meta["new_steps"] == [4, 5] and shaded.layout.meta["x_axis"] == "event"
    outside = mark_new_steps(figure(), {**tick, "band": [400, 500]}, "f-1")  # a window before them
    assert not outside.layout.shapes and outside.layout.meta["new_steps"] == [4, 5]
    assert not mark_new_steps(figure(), tick, "another").layout.shapes  # not the snapshot shown
    with pytest.raises(BadInput):
        mark_new_steps(figure(), {**tick, "band": ["a", 1]}, "f-1")
    with pytest.raises(BadInput):
        mark_new_steps(figure(), "forged", "f-1")
