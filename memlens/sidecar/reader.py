"""The sidecar's one reader: bytes, a file or the sidecar beside a snapshot, to a ``Sidecar``.

``read_sidecar(data, source)`` decodes bounded bytes, migrates an older layout into the current
one (the layouts: ``memlens.sidecar.format``) and validates every field, and says what is wrong in
one line (``SidecarError``, a ``MemlensFormatError``) instead of a traceback;
``read_sidecar_file(path)`` reads a file given on its own (an upload), ``sidecar_beside(path)`` the
sidecar of a snapshot file (``memlens.load`` does). To pair a snapshot loaded from elsewhere with
its sidecar, set ``snapshot.sidecar`` before ``memlens.analyze``.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from memlens.errors import MemlensFormatError
from memlens.files import FileRefused, OpenedFile, open_regular
from memlens.sidecar.format import SIDECAR_MAX_INT, SIDECAR_SUFFIX, SIDECAR_VERSION, Sidecar
from memlens.sidecar.leak_holders import read_leak_holders

# The recorder writes a few kilobytes, a large model's tensor roles a few megabytes.
SIDECAR_MAX_BYTES = 16 << 20
# The recorder's deepest part is a holder's lines (5 levels); free-form parts (allocator
# settings, holders) may not nest past this, so the report that carries them stays shallow.
MAX_DEPTH = 32


class SidecarError(MemlensFormatError):
    """A sidecar that cannot be read as one: one line naming the file and the first problem."""


def read_sidecar(data: bytes, source: str) -> Sidecar:
    """The sidecar in ``data`` (the bytes of a ``.memlens.json``), migrated to the current layout;
    ``SidecarError`` (one line, naming ``source``) when it is not one."""
    if len(data) > SIDECAR_MAX_BYTES:
        raise SidecarError(source, f"not a memlens sidecar: larger than {SIDECAR_MAX_BYTES:,} bytes")
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise SidecarError(source, f"not a memlens sidecar (invalid JSON: {exc})") from None
    except RecursionError:
        raise SidecarError(source, "not a memlens sidecar: nested too deeply") from None
    return sidecar_from_builtins(raw, source)


def sidecar_from_builtins(raw: Any, source: str = "<sidecar>") -> Sidecar:
    """``read_sidecar`` for JSON already parsed (a dict of builtins), e.g. by a test."""
    if not isinstance(raw, dict):
        raise SidecarError(source, f"not a memlens sidecar: a JSON {_json_kind(raw)}, not an object")
    if _nested_past(raw, MAX_DEPTH):
        raise SidecarError(source, f"not a memlens sidecar: nested more than {MAX_DEPTH} levels")
    version = raw.get("memlens_sidecar_version")
    if version is None:
        raw = _from_unversioned(raw)
        version = 1
    if isinstance(version, bool) or not isinstance(version, int):
        raise SidecarError(source, f"not a memlens sidecar: memlens_sidecar_version {_json_kind(version)}")
    if version > SIDECAR_VERSION:
        raise SidecarError(source, f"sidecar layout {version} is newer than this memlens reads "
                                   f"({SIDECAR_VERSION}): upgrade memlens")
    if version < 1:
        raise SidecarError(source, f"not a memlens sidecar: memlens_sidecar_version {version}")
    if version == 1:
        raw = _from_version_1(raw)
    # The holders are read on their own, tolerantly: a holder that does not fit is dropped, and
    # the rest of the sidecar (the budget's shapes, the steps) still counts. A section that is not
    # an object at all is a file that is not a sidecar, as for every other part.
    holders = raw.get("leak_holders")
    if holders is not None and not isinstance(holders, dict):
        raise SidecarError(source, f"not a memlens sidecar: leak_holders is a JSON {_json_kind(holders)}, "
                                   "not an object - at `$.leak_holders`")
    try:
        sidecar = msgspec.convert({k: v for k, v in raw.items() if k != "leak_holders"}, Sidecar)
    except msgspec.ValidationError as exc:
        raise SidecarError(source, f"not a memlens sidecar: {exc}") from None
    except RecursionError:
        raise SidecarError(source, "not a memlens sidecar: nested too deeply") from None
    if holders is None:
        return sidecar
    return msgspec.structs.replace(sidecar, leak_holders=read_leak_holders(holders))


def read_sidecar_file(path: str | os.PathLike[str] | OpenedFile) -> Sidecar:
    """``read_sidecar`` of a file named on its own (an upload, a path a user gave): only a
    regular file of at most ``SIDECAR_MAX_BYTES``; ``SidecarError`` saying why not."""
    name = path.name if isinstance(path, OpenedFile) else os.fspath(path)
    try:
        opened = path if isinstance(path, OpenedFile) else open_regular(name, max_bytes=SIDECAR_MAX_BYTES)
        with opened:
            data = opened.read_bytes(SIDECAR_MAX_BYTES)
    except FileRefused as refused:
        raise SidecarError(name, refused.reason) from None
    except OSError as exc:
        raise SidecarError(name, f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    return read_sidecar(data, name)


def sidecar_name(path: str) -> str:
    """The recorder's sidecar of a snapshot: ``run.pickle`` (or ``run.pickle.gz``) -> ``run.memlens.json``."""
    base = path
    for suffix in (".gz", ".pickle", ".pkl"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base + SIDECAR_SUFFIX


def sidecar_beside(path: str | OpenedFile) -> tuple[Sidecar | None, str | None]:
    """The sidecar of the snapshot at ``path`` and, when there is a file but it cannot be used,
    why not in one line: ``(None, None)`` where there is none (see ``sidecar_bytes_beside``)."""
    name = sidecar_name(path.name if isinstance(path, OpenedFile) else os.fspath(path))
    data, problem = sidecar_bytes_beside(path)
    if data is None:
        return None, problem
    try:
        return read_sidecar(data, name), None
    except SidecarError as exc:
        return None, str(exc)


def sidecar_bytes_beside(path: str | OpenedFile) -> tuple[bytes | None, str | None]:
    """The bytes of the snapshot's sidecar, or ``None`` with why it cannot be read in one line
    (``None`` too where there is no sidecar): what ``sidecar_beside`` parses, and what names a
    cached report (``memlens.report_cache``).

    Beside an ``OpenedFile`` it is opened as that file was (``sibling``: beneath the same folder
    descriptor, following no link, when the snapshot was opened beneath a root); only a regular
    file of at most ``SIDECAR_MAX_BYTES`` is read."""
    snapshot_name = path.name if isinstance(path, OpenedFile) else os.fspath(path)
    name = sidecar_name(snapshot_name)
    try:
        if isinstance(path, OpenedFile):
            opened = path.sibling(os.path.basename(name), max_bytes=SIDECAR_MAX_BYTES)
        else:
            opened = open_regular(name, max_bytes=SIDECAR_MAX_BYTES)
    except FileRefused as refused:
        return None, (None if refused.reason == "no such file" else f"{name}: {refused.reason}")
    try:
        with opened:
            return opened.read_bytes(SIDECAR_MAX_BYTES), None
    except (FileRefused, OSError) as exc:
        return None, f"{name}: {getattr(exc, 'reason', None) or exc}"


# ------------------------------------------------------------------------------ migrations
def _json_kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _nested_past(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` levels deep (no recursion)."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        below: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                below.extend(item.values())
            elif isinstance(item, list):
                below.extend(item)
        below = [item for item in below if isinstance(item, dict | list)]
        if not below:
            return False
        level = below
    return True


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < SIDECAR_MAX_INT


def _section(raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``raw[key]`` when it is an object, made one when absent; None when it is something else
    (left alone: validation says what it is)."""
    value = raw.setdefault(key, {})
    return value if isinstance(value, dict) else None


# The unversioned names of the device's memory and of the trainable parameter count, and where
# they were looked for (the first positive one wins, as it did).
_CAPACITY_KEYS = ("total_memory", "capacity_bytes", "capacity", "total_memory_bytes")
_PARAMETER_KEYS = ("parameters_trainable", "trainable_parameters", "parameters", "parameter_count",
                   "num_parameters")
_INPUT_KEYS = {"batch_size": ("batch_size", "batch", "micro_batch_size"),
               "seq_len": ("seq_len", "sequence_length", "seq_length", "seq")}


def _from_unversioned(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    device, model = raw.get("device"), raw.get("model")
    candidates: list[Any] = [raw, device, model]
    devices = raw.pop("devices", None)
    index = device.get("index") if isinstance(device, dict) else None
    index = index if isinstance(index, int) and not isinstance(index, bool) else 0
    if isinstance(devices, dict):
        candidates.append(devices.get(str(index), devices.get(index)))
    elif isinstance(devices, list) and 0 <= index < len(devices):
        candidates.append(devices[index])
    places: list[dict[str, Any]] = [place for place in candidates if isinstance(place, dict)]
    capacity = _first_positive(places, _CAPACITY_KEYS)
    parameters = _first_positive(places, _PARAMETER_KEYS)
    for key in ("total_memory", "capacity_bytes", "capacity", "trainable_parameters", "parameters",
                "parameter_count", "num_parameters"):
        raw.pop(key, None)
    if capacity is not None and (device_section := _section(raw, "device")) is not None:
        raw["device"] = device_section = {k: v for k, v in device_section.items() if k not in _CAPACITY_KEYS}
        device_section["total_memory_bytes"] = capacity
    inputs = raw.pop("inputs", None)
    if isinstance(model, dict) or parameters is not None or isinstance(inputs, dict):
        model_section = _section(raw, "model")
        if model_section is not None:
            model_section = raw["model"] = {k: v for k, v in model_section.items()
                                            if k not in _PARAMETER_KEYS and k not in _CAPACITY_KEYS}
            if parameters is not None:
                model_section["parameters_trainable"] = parameters
            _move_shapes(model_section, inputs)
    return raw


def _first_positive(places: list[dict[str, Any]], keys: tuple[str, ...]) -> int | None:
    for place in places:
        for key in keys:
            if _positive(place.get(key)):
                return int(place[key])
    return None


def _move_shapes(model: dict[str, Any], top_inputs: Any) -> None:
    """The unversioned shape names under ``model``, ``model.config``, ``model.inputs`` or a
    top-level ``inputs``, moved to ``model.config`` and ``model.inputs``."""
    config: dict[str, Any] = model["config"] if isinstance(model.get("config"), dict) else {}
    inputs: dict[str, Any] = model["inputs"] if isinstance(model.get("inputs"), dict) else {}
    places = [p for p in (model, config, inputs, top_inputs) if isinstance(p, dict)]
    moved_config = dict(config)
    aliases: dict[str, tuple[str, ...]] = {"hidden_size": ("hidden",), "num_attention_heads": ("heads",)}
    for target, names in aliases.items():
        value = _first_positive(places, (target, *names, *_V1_NAMES.get(target, ())))
        if value is not None:
            moved_config[target] = value
    if moved_config:
        model["config"] = moved_config
    moved_inputs = {k: v for k, v in inputs.items() if k not in ("batch_size", "seq_len")}
    for target, names in _INPUT_KEYS.items():
        value = _first_positive(places, names)
        if value is not None:
            moved_inputs[target] = value
    if {"batch_size", "seq_len"} <= moved_inputs.keys():
        model["inputs"] = moved_inputs
    else:
        model.pop("inputs", None)  # an input the theory cannot use (one of the two) says nothing


# Version 1 wrote a model's dimensions under the names it declared them by.
_V1_NAMES = {
    "hidden_size": ("d_model", "n_embd"),
    "num_attention_heads": ("n_heads", "n_head"),
    "num_key_value_heads": ("n_kv_heads",),
}


def _from_version_1(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    raw["memlens_sidecar_version"] = SIDECAR_VERSION
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("config"), dict):
        config = dict(model["config"])
        for name, old_names in _V1_NAMES.items():
            for old in old_names:
                value = config.pop(old, None)
                if name not in config and value is not None:
                    config[name] = value
        raw["model"] = {**model, "config": config}
    device = raw.get("device")
    capability = device.get("compute_capability") if isinstance(device, dict) else None
    if isinstance(capability, list) and all(isinstance(part, int) for part in capability):
        raw["device"] = {**device, "compute_capability": ".".join(str(part) for part in capability)}  # type: ignore[dict-item]
    return raw


__all__ = [
    "SIDECAR_MAX_BYTES",
    "SidecarError",
    "read_sidecar",
    "read_sidecar_file",
    "sidecar_beside",
    "sidecar_bytes_beside",
    "sidecar_from_builtins",
    "sidecar_name",
]
