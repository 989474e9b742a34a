"""``memlens serve``: argument errors are one line and exit 2; the app factory lists what it was given."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from memlens.cli.main import main
from memlens_app.main import create_app
from tests.integration.app_server import ServeProcess, wait_for


def test_missing_snapshot_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path / "nope.pickle"), "--port", "0"])
    assert exit_info.value.code == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_the_url_comes_first_and_a_file_that_is_not_a_snapshot_is_one_line_after(tmp_path: Path) -> None:
    """The URL is printed before any file is checked (issue 37); a bad file is then one line on
    the terminal (and on the page), and the server goes on serving."""
    notes = tmp_path / "notes.txt"
    notes.write_text("remember to buy milk\n")
    server = ServeProcess(tmp_path, str(notes))
    try:
        wait_for(lambda: "memlens: error:" in server.text(), "the bad file's line")
        lines = server.text().splitlines()
        url_line = next(i for i, line in enumerate(lines) if "dashboard on http://" in line)
        errors = [i for i, line in enumerate(lines) if line.startswith("memlens: error:")]
        assert len(errors) == 1 and errors[0] > url_line, lines
        assert "notes.txt: not a pickle" in lines[errors[0]] and "Traceback" not in server.text()
        assert requests.get(server.url + "/", timeout=30).status_code == 200  # still serving
    finally:
        server.stop()


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
