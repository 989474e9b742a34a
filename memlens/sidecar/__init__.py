"""The recorder's sidecar (``run.memlens.json`` beside ``run.pickle``): its format, its one reader
and its writer, in one package that imports nothing of the snapshot, the analysis or the recorder.

``format`` holds the typed, versioned struct (``Sidecar`` and its parts, the layouts it migrates
from), ``leak_holders`` the part naming who holds a leak, ``reader`` the one way in
(``read_sidecar``, ``sidecar_beside``, ...) and ``writer`` the one way out (``build_sidecar``,
``encode_sidecar``). The names below, the format's and the reader's, are what the rest of memlens
imports from here; the writer (which names memlens' version, read from the package metadata at
import: 30 ms a cached ``memlens triage`` does not spend) is imported from its module by the two
that write, the recorder and ``memlens predict``.
"""

from __future__ import annotations

from memlens.sidecar.format import (
    SIDECAR_SUFFIX,
    SIDECAR_VERSION,
    DeviceInfo,
    ModelConfig,
    ModelInfo,
    ModelInputs,
    OptimizerInfo,
    OutOfMemory,
    OutsideReading,
    RecordedStep,
    RecorderSettings,
    RoleRecord,
    Sidecar,
    TensorRoles,
)
from memlens.sidecar.reader import (
    SIDECAR_MAX_BYTES,
    SidecarError,
    read_sidecar,
    read_sidecar_file,
    sidecar_beside,
    sidecar_bytes_beside,
    sidecar_from_builtins,
    sidecar_name,
)

__all__ = [
    "SIDECAR_MAX_BYTES",
    "SIDECAR_SUFFIX",
    "SIDECAR_VERSION",
    "DeviceInfo",
    "ModelConfig",
    "ModelInfo",
    "ModelInputs",
    "OptimizerInfo",
    "OutOfMemory",
    "OutsideReading",
    "RecordedStep",
    "RecorderSettings",
    "RoleRecord",
    "Sidecar",
    "SidecarError",
    "TensorRoles",
    "read_sidecar",
    "read_sidecar_file",
    "sidecar_beside",
    "sidecar_bytes_beside",
    "sidecar_from_builtins",
    "sidecar_name",
]
