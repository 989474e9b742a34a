"""memlens's version, written once: in ``pyproject.toml``'s ``[project]`` table, read here.

An installed memlens (wheel or editable) answers from its package metadata. A bare checkout run
with ``PYTHONPATH`` (no metadata) reads ``pyproject.toml`` beside the package, and anything else gets
``0+unknown`` rather than failing: the version only labels outputs (the recorder's sidecar).
A leaf: it imports nothing from memlens, so the recorder can use it without importing the
package root.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: no tomllib; the version is read without a TOML library (below)
    tomllib = None

UNKNOWN_VERSION = "0+unknown"


def _version_from_pyproject(pyproject: Path) -> str | None:
    try:
        text = pyproject.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if tomllib is None:
        return _version_without_tomllib(text)
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None
    project = data.get("project")
    version = project.get("version") if isinstance(project, dict) else None
    return version.strip() or None if isinstance(version, str) else None


def _version_without_tomllib(text: str) -> str | None:
    """``version = "X"`` in the ``[project]`` table, for Python 3.10 (a static one-line string)."""
    in_project = False
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            in_project = line == "[project]"
        elif in_project and line.startswith("version") and "=" in line:
            value = line.split("=", 1)[1].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                return value[1:-1].strip() or None
    return None


def find_version(distribution: str = "memlens", pyproject: Path | None = None) -> str:
    """The installed distribution's version, else the checkout's ``pyproject.toml``, else ``0+unknown``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        pass
    if pyproject is None:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    return _version_from_pyproject(pyproject) or UNKNOWN_VERSION


__version__ = find_version()
