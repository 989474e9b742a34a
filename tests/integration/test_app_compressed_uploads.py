"""A compressed upload counts against the dashboard's upload limit by what it inflates to, as the
plain file would: a small gzip is no way past ``--max-upload`` (issue 21: a 1.9 MB gzip of 4.36 M
tiny events took 2.6 GB)."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pytest

from memlens.errors import MemlensFormatError
from memlens.snapshot.reader import load
from memlens.synthetic import synthetic_snapshot
from memlens_app.main import create_app


@pytest.fixture(scope="module")
def pickled() -> bytes:
    return pickle.dumps(synthetic_snapshot(60_000, seed=1), protocol=4)


def test_load_counts_a_gzips_inflated_bytes_against_the_content_limit(tmp_path: Path, pickled: bytes) -> None:
    path = tmp_path / "run.pickle.gz"
    path.write_bytes(gzip.compress(pickled))
    with pytest.raises(MemlensFormatError, match=r"inflates to more than 1,048,576 bytes \(the largest snapshot"):
        load(path, cache=False, max_content_bytes=1 << 20)
    assert load(path, cache=False, max_content_bytes=len(pickled)).total_events >= 60_000


@pytest.mark.timeout(300)
def test_a_small_gzip_that_inflates_past_the_upload_limit_is_refused_in_one_line(pickled: bytes) -> None:
    compressed = gzip.compress(pickled)
    assert len(compressed) * 4 < len(pickled)
    app = create_app([], sample_dir=None, max_upload_bytes=2 * len(compressed))  # the gzip itself fits
    client = app.server.test_client()
    try:
        refused = client.post("/upload?name=small.pickle.gz", data=compressed)
        assert refused.status_code in (400, 422), refused.get_json()
        error = refused.get_json()["error"]
        assert "inflates to more than" in error and "the largest snapshot accepted here" in error, error
        accepted = create_app([], sample_dir=None, max_upload_bytes=2 * len(pickled))
        try:
            fits = accepted.server.test_client().post("/upload?name=fits.pickle.gz", data=compressed)
            assert fits.status_code == 200, fits.get_json()
        finally:
            accepted.server.config["MEMLENS_LIBRARY"].close()
    finally:
        app.server.config["MEMLENS_LIBRARY"].close()
