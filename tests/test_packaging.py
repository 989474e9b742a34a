"""What a fresh install gets: every package of the source tree is listed in setup.cfg.

setup.cfg names its packages one by one (``memlens_app`` is the ``app/`` folder, which ``find:``
cannot map); a new subpackage that is not listed works in an editable checkout and is missing
from a wheel. This test is the guard.
"""

from __future__ import annotations

import configparser

from tests.conftest import REPO_ROOT


def _listed_packages() -> set[str]:
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    return {line.strip() for line in config["options"]["packages"].splitlines() if line.strip()}


def _source_packages() -> set[str]:
    found = set()
    for top, name in (("memlens", "memlens"), ("app", "memlens_app")):
        for init in sorted((REPO_ROOT / top).rglob("__init__.py")):
            parts = init.parent.relative_to(REPO_ROOT / top).parts
            found.add(".".join((name, *parts)))
    return found


def test_every_package_is_listed_in_setup_cfg() -> None:
    source, listed = _source_packages(), _listed_packages()
    assert {"memlens", "memlens.analysis", "memlens_app"} <= source  # the walk found the tree
    assert source - listed == set(), "add these to [options] packages in setup.cfg"
    assert listed - source == set(), "setup.cfg lists packages that do not exist"
