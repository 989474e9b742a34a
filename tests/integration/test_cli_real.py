"""``memlens triage`` on every real CUDA snapshot: exit 0, a report, valid JSON."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from memlens.analysis.schema import REPORT_SCHEMA
from memlens.cli.main import cli
from tests.conftest import needs_real_snapshots, real_snapshot_paths

pytestmark = [needs_real_snapshots, pytest.mark.slow]


@pytest.mark.parametrize("path", real_snapshot_paths(), ids=lambda p: p.name[:40])
def test_triage_real_snapshot(path: Path) -> None:
    result = CliRunner().invoke(cli, ["triage", str(path), "--width", "120"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "memlens triage" in result.output and "Live at the peak" in result.output


@pytest.mark.parametrize("path", real_snapshot_paths(), ids=lambda p: p.name[:40])
def test_triage_json_validates_against_the_schema(path: Path) -> None:
    result = CliRunner().invoke(cli, ["triage", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0
    jsonschema.validate(json.loads(result.output), REPORT_SCHEMA)
