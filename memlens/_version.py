"""memlens's version, written once: in ``setup.cfg``, read here.

An installed memlens (wheel or editable) answers from its package metadata. A bare checkout run
with ``PYTHONPATH`` (no metadata) reads ``setup.cfg`` beside the package, and anything else gets
``0+unknown`` rather than failing: the version only labels outputs (the recorder's sidecar).
A leaf: it imports nothing from memlens, so the recorder can use it without importing the
package root.
"""

from __future__ import annotations

import configparser
from importlib import metadata
from pathlib import Path

UNKNOWN_VERSION = "0+unknown"


def _version_from_setup_cfg(setup_cfg: Path) -> str | None:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(setup_cfg, encoding="utf-8")
    except (OSError, configparser.Error):
        return None
    version = parser.get("metadata", "version", fallback="").strip()
    return version or None


def find_version(distribution: str = "memlens", setup_cfg: Path | None = None) -> str:
    """The installed distribution's version, else the checkout's ``setup.cfg``, else ``0+unknown``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        pass
    if setup_cfg is None:
        setup_cfg = Path(__file__).resolve().parent.parent / "setup.cfg"
    return _version_from_setup_cfg(setup_cfg) or UNKNOWN_VERSION


__version__ = find_version()
