"""The documentation site builds with warnings as errors: a broken link, a missing anchor or a
page left out of the navigation fails the run, so the docs cannot drift from each other."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT


def test_the_docs_build_strict(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # material's notice of its successor: not ours
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def test_the_readme_is_a_front_page() -> None:
    """At most 250 lines, and every page of the site it links to exists."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    linked = set(re.findall(r"\]\((docs/[^)#]+)", text))
    assert linked, "the README links to the documentation"
    missing = sorted(path for path in linked if not (REPO_ROOT / path).is_file())
    assert not missing, f"README links to missing pages: {missing}"
