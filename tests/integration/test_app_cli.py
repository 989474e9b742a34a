"""``memlens serve``: argument errors are one line and exit 2; the app factory lists what it was given."""

from __future__ import annotations

from pathlib import Path

import pytest

from memlens.cli.main import main
from memlens_app.main import create_app


def test_missing_snapshot_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path / "nope.pickle"), "--port", "0"])
    assert exit_info.value.code == 2
    assert "no such file" in capsys.readouterr().err


def test_a_file_that_is_not_a_snapshot_is_refused_before_serving(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("remember to buy milk\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(notes), "--port", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "notes.txt: not a pickle" in err, err


def test_bad_upload_limit_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--max-upload", "lots"])
    assert exit_info.value.code == 2
    assert "not a byte size" in capsys.readouterr().err


def test_app_lists_command_line_files_and_samples(tmp_path: Path) -> None:
    given = tmp_path / "run.pickle"
    given.write_bytes(b"")
    samples = tmp_path / "samples"
    samples.mkdir()
    (samples / "a.pickle").write_bytes(b"")
    (samples / "notes.txt").write_text("ignored")
    app = create_app([given], sample_dir=samples)
    library = app.server.config["MEMLENS_LIBRARY"]
    assert [(s.name, s.kind) for s in library.sources()] == [("run.pickle", "cli"), ("a.pickle", "sample")]
    client = app.server.test_client()
    assert client.get("/").status_code == 200
    response = client.post("/upload?name=../../etc/evil.pickle", data=b"not a pickle")
    assert response.status_code == 400
    assert response.get_json()["error"].startswith("evil.pickle: ")
