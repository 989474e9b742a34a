"""The sidecar's writer: a dump's facts to a checked ``Sidecar``, and its bytes and name.

``build_sidecar`` takes what the recorder (or ``memlens predict``) knew at a dump and checks it as
``memlens.sidecar.reader`` will (a value of the wrong type is a bug of the writer, raised before
anything is written); ``encode_sidecar`` gives the bytes the recorder writes atomically beside the
snapshot (``memlens.recorder.writing.write_sidecar``), at ``sidecar_path(snapshot)``.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import msgspec

from memlens._version import __version__
from memlens.sidecar.format import SIDECAR_SUFFIX, ModelInfo, OptimizerInfo, Sidecar


def build_sidecar(
    *,
    backend: str,
    reason: str,
    device: dict[str, Any],
    allocator_settings: dict[str, Any],
    rank: int,
    world_size: int,
    local_rank: int,
    steps: list[dict[str, Any]],
    steps_selected: list[int] | None,
    peak_allocated_bytes: int,
    peak_reserved_bytes: int,
    oom: dict[str, Any] | None,
    model: ModelInfo | dict[str, Any] | None,
    optimizer: OptimizerInfo | dict[str, Any] | None,
    recorder: dict[str, Any],
    tensor_roles: dict[str, Any] | None = None,
    outside_pytorch: list[dict[str, Any]] | None = None,
    leak_holders: dict[str, Any] | None = None,
) -> Sidecar:
    """The sidecar of one dump, checked as its reader will check it (a value of the wrong type
    is a bug here, raised now rather than written)."""
    import torch  # only to name its version: reading a sidecar imports no torch

    return msgspec.convert({
        "memlens_version": __version__,
        "backend": backend,
        "reason": reason,
        "torch_version": str(torch.__version__),
        "python_version": platform.python_version(),
        "device": device,
        "allocator_settings": allocator_settings,
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "steps": steps,
        "steps_selected": steps_selected,
        "peak_allocated_bytes": peak_allocated_bytes,
        "peak_reserved_bytes": peak_reserved_bytes,
        "oom": oom,
        "model": model,
        "optimizer": optimizer,
        "recorder": recorder,
        "tensor_roles": tensor_roles if tensor_roles is not None else {"version": 1, "records": []},
        "outside_pytorch": outside_pytorch,
        "leak_holders": leak_holders,
    }, Sidecar)


def encode_sidecar(sidecar: Sidecar) -> bytes:
    """The sidecar as the recorder writes it: indented JSON, one key a line, a final newline."""
    return msgspec.json.format(msgspec.json.encode(sidecar), indent=2) + b"\n"


def sidecar_path(snapshot_path: Path) -> Path:
    """Where the recorder writes the sidecar of the snapshot it writes at ``snapshot_path``
    (``run.pickle`` -> ``run.memlens.json``); the reader's ``sidecar_name`` finds it there."""
    return snapshot_path.with_name(snapshot_path.name.removesuffix(".pickle") + SIDECAR_SUFFIX)


__all__ = ["build_sidecar", "encode_sidecar", "sidecar_path"]
