"""Uploaded sidecars: which file is one, whether it can be used, and which snapshot it belongs to.

A recorded run is two files, ``run.pickle`` and the recorder's ``run.memlens.json`` beside it.
``memlens triage run.pickle`` reads the sidecar through the loader (``memlens.snapshot.reader``:
``sidecar_name`` names it, ``read_sidecar`` reads it beside the snapshot); the dashboard pairs an
uploaded sidecar with an uploaded snapshot by the same rule and then puts it where the loader
looks (``paired_path``), so the analysis in the worker reads it exactly as the terminal does.

``read_uploaded_sidecar`` is the one place the app reads a sidecar's content (to say why one
cannot be used, before it is paired), through the sidecar's one reader (``memlens.sidecar``). It
runs only in an analysis worker (``check_uploaded_sidecars``, through
``memlens_app.worker.check_sidecars_in_worker``), under the analyses' limits: never in the
server, where one 16 MiB sidecar of empty objects took 6.7 s and 500 MiB.
"""

from __future__ import annotations

import json
import os
from typing import Any

from memlens.errors import MemlensError, one_line
from memlens.sidecar import SIDECAR_MAX_BYTES, SIDECAR_SUFFIX, SidecarError, sidecar_from_builtins, sidecar_name
from memlens.units import format_bytes

JSON_SUFFIX = ".json"


class SidecarRefused(MemlensError):
    """An uploaded sidecar that cannot be used; the message is the one-line reason."""


def is_sidecar_name(name: str) -> bool:
    """Whether an uploaded file is meant as a sidecar (any ``.json``: one not named like the
    recorder's is answered with why it cannot pair, rather than analysed as a snapshot)."""
    return name.lower().endswith(JSON_SUFFIX)


def expected_sidecar(snapshot_name: str) -> str:
    """The sidecar name the loader pairs with ``snapshot_name`` (``run.pickle.gz`` -> ``run.memlens.json``)."""
    return os.path.basename(sidecar_name(snapshot_name))


def paired_path(snapshot_path: str) -> str:
    """Where the loader looks for the sidecar of the snapshot stored at ``snapshot_path``."""
    return sidecar_name(snapshot_path)


def read_uploaded_sidecar(path: str, name: str) -> dict[str, Any]:
    """The sidecar uploaded to ``path`` (as ``name``), or ``SidecarRefused`` saying in one line
    why it cannot be used: not named like one, too large, not JSON, not the recorder's."""
    if not name.endswith(SIDECAR_SUFFIX):
        raise SidecarRefused(f"{name}: not a memlens sidecar name (the recorder writes RUN{SIDECAR_SUFFIX} "
                             "next to RUN.pickle)")
    size = os.path.getsize(path)
    if size > SIDECAR_MAX_BYTES:
        raise SidecarRefused(f"{name}: {format_bytes(size)}, larger than a sidecar may be "
                             f"({format_bytes(SIDECAR_MAX_BYTES)})")
    with open(path, "rb") as handle:
        raw = handle.read(SIDECAR_MAX_BYTES + 1)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise SidecarRefused(f"{name}: not a sidecar (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise SidecarRefused(one_line(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno}, "
                                      f"column {exc.colno})")) from None
    except RecursionError:
        raise SidecarRefused(f"{name}: not a sidecar (JSON nested too deeply)") from None
    if not isinstance(data, dict) or not isinstance(data.get("memlens_sidecar_version"), int):
        raise SidecarRefused(f"{name}: not a memlens sidecar (no memlens_sidecar_version)")
    try:  # the one reader the loader will use: what it refuses, the upload list says now
        sidecar_from_builtins(data, name)
    except SidecarError as exc:
        raise SidecarRefused(one_line(str(exc))) from None
    return data


def check_uploaded_sidecars(sidecars: list[tuple[str, str]]) -> list[str | None]:
    """What an analysis worker runs for uploaded sidecars ``(path, name)``: for each, None when it
    can be used, else why not in one line. Only the reasons come back, never the parsed content."""
    problems: list[str | None] = []
    for path, name in sidecars:
        try:
            read_uploaded_sidecar(path, name)
        except SidecarRefused as refused:
            problems.append(str(refused))
        else:
            problems.append(None)
    return problems
