"""What the recorder writes next to each snapshot, and how it writes files.

Files are written atomically: a temporary name in the same directory, ``fsync``, then
``os.replace``. A crash (or an OOM kill) mid-write leaves the previous file or none, never a
0-byte or half-written pickle. Snapshots use pickle protocol 4, which PyTorch's web viewer reads.

Names are reserved: a run holds an exclusive ``flock`` on ``.NAME.pickle.reserved`` from its
start to its last write, so two runs started at once into one folder never pick the same name
(the second sees the lock, or the first's finished file, and takes ``NAME-2.pickle``). The kernel
drops the lock when its process dies, however it dies. Temporary files are named
``.NAME.pickle.HOST.PID.XXXXXXXX.tmp``; ``remove_stale_files`` deletes those whose process (on this
host) is gone and reservation files nobody holds: what a ``kill -9`` leaves behind.

The sidecar, ``<name>.memlens.json`` next to ``<name>.pickle`` (keys, all always present):

``memlens_sidecar_version``  1.
``memlens_version``          the recorder that wrote it.
``backend``                  ``"cuda"`` (real allocator history) or ``"cpu"`` (storages tracked on
                             the CPU and replayed through memlens' caching-allocator simulator).
``reason``                   why this dump happened: ``"exit"``, ``"exception"``, ``"oom"``,
                             ``"periodic"`` (``dump_every``), ``"steps_done"`` (last selected step),
                             ``"terminated"`` (SIGTERM) or ``"interrupted"`` (SIGINT, Ctrl-C).
``torch_version``, ``python_version``.
``device``                   ``{type, index, name, total_memory_bytes, simulated}``; CUDA adds
                             ``compute_capability``. ``total_memory_bytes`` is the simulated
                             capacity on the CPU (``null`` = unlimited).
``allocator_settings``       the settings in force (the snapshot's own key on CUDA >= 2.3).
``rank``, ``world_size``, ``local_rank``   from torch.distributed or the torchrun environment.
``steps``                    ``[{index, start_us, end_us}]``: the recorded steps, on the trace's
                             clock (``end_us`` null for a step still open at the dump).
``steps_selected``           the ``steps=`` filter as a list of ints, or ``null`` (all steps).
``peak_allocated_bytes``, ``peak_reserved_bytes``   over the recording.
``oom``                      ``null``, or ``{requested_bytes, device_free_bytes}`` of the OOM that
                             ended the recording.
``model``                    ``null``, or ``{parameters_total, parameters_trainable,
                             parameter_bytes_total, parameter_bytes_by_dtype: {"torch.float32": n},
                             buffer_bytes_total, source}`` for a watched model (``source``
                             ``"model"``); ``memlens record`` finds the model owning the hooked
                             optimizer's parameters, and where no single module owns them counts
                             the optimizer's parameters (``source`` ``"optimizer"``,
                             ``buffer_bytes_total`` null). Two optional keys feed the activation
                             plateau's per-layer theory (``model_dimensions``, ``input_dimensions``):
``model.config``             the dimensions the model declares, positive ints only:
                             ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``
                             (GPT-2: ``n_embd``, ``n_head``) copied from a Hugging Face model's
                             ``config``, else ``d_model``, ``hidden_size``, ``n_heads``, ... set as
                             plain attributes on the root module. Absent when it declares none;
                             never inferred from weight shapes.
``model.inputs``             ``{batch_size, seq_len, shape, dtype}`` of the model's first forward
                             call: a 2-D integer tensor (token ids, ``input_ids=`` first), else a
                             3-D float ``(batch, seq, hidden)`` whose last dimension is the
                             declared hidden size. Absent when no input tells both.
``optimizer``                ``null``, or ``{class: "AdamW", param_groups: n}``.
``recorder``                 ``{stacks, context, max_entries, max_stack_depth, dump_every,
                             module_scopes}``.
``tensor_roles``             ``{version: 1, records: [{time_us, at, device, parameters, buffers,
                             gradients, optimizer_state, inputs, outputs, graph}]}``: storages by
                             role, each role a flat list ``[address, nbytes, address, nbytes, ...]``
                             of the storages first seen at that moment (``at``: ``"step#N.start"``,
                             ``"step#N.end"``, ``"optimizer.pre"``/``"optimizer.post"`` (around
                             each optimizer.step()), ``"forward"``/``"forward.end"`` (the model's
                             inputs/outputs) or ``"dump"``, whose ``time_us`` is null: the end of
                             the trace). See
                             ``memlens.recorder.roles``.
``outside_pytorch``          ``null`` (CPU), or ``[{at, time_us, device, device_used_bytes,
                             reserved_bytes, outside_pytorch_bytes}]`` per step boundary on CUDA:
                             ``mem_get_info``'s total - free against PyTorch's reserved bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import platform
import re
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlens import files
from memlens._version import __version__

if TYPE_CHECKING:  # torch is imported where tensors are looked at: reading a sidecar needs none
    import torch

SIDECAR_VERSION = 1
PICKLE_PROTOCOL = 4  # protocol 5 (the default) is not readable by the pytorch.org viewer


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part;
    the temporary file names this host and process, for ``remove_stale_files``."""
    files.write_atomic(path, data, temp_prefix=f".{path.name}.{_host_tag()}.{os.getpid()}.")


def _host_tag() -> str:
    """This host's name as it appears in temporary file names (no dots, no odd characters)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


RESERVATION_SUFFIX = ".reserved"


def reservation_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{RESERVATION_SUFFIX}")


class Reservation:
    """A claim on one snapshot name, held until ``release`` (or until the process dies)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the name up: its snapshot, if any, is written and stands for itself from now on."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(reservation_path(self.path))
        os.close(self._fd)  # closing drops the lock
        self._fd = None


def reserve(path: Path) -> Reservation | None:
    """Claim ``path`` for this run: None when another run holds it or its files exist already.

    The lock is taken on ``.NAME.reserved`` (never on the snapshot itself, which stays absent
    until its first complete write). Raises ``OSError`` when the folder cannot be written.
    """
    marker = reservation_path(path)
    while True:
        fd = os.open(marker, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # a running recorder has this name
        except BaseException:
            os.close(fd)
            raise
        if not _still_named(fd, marker):
            os.close(fd)  # its holder released (unlinked) it between our open and our lock: again
            continue
        if path.exists() or sidecar_path(path).exists():
            os.unlink(marker)
            os.close(fd)
            return None  # an earlier run's files
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        return Reservation(path, fd)


def _still_named(fd: int, marker: Path) -> bool:
    try:
        return os.stat(marker).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


_TEMP_NAME = re.compile(r"^\..+\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")


def remove_stale_files(directory: Path) -> list[Path]:
    """Delete what killed recorders left in ``directory``; returns what was removed.

    A temporary file goes when its writer, a process of this host, no longer exists (a writer
    on another host sharing the folder cannot be checked and is left alone). A reservation goes
    when nobody holds its lock.
    """
    removed: list[Path] = []
    host = _host_tag()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        candidate = directory / name
        temp = _TEMP_NAME.match(name)
        if temp is not None and temp["host"] == host and not files.process_alive(int(temp["pid"])):
            with contextlib.suppress(FileNotFoundError):
                candidate.unlink()
                removed.append(candidate)
        elif name.startswith(".") and name.endswith(RESERVATION_SUFFIX) and _unheld(candidate):
            removed.append(candidate)
    return removed


def _unheld(marker: Path) -> bool:
    """Remove ``marker`` if no process holds its lock; True if it was removed."""
    try:
        fd = os.open(marker, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _still_named(fd, marker):
            return False
        os.unlink(marker)
        return True
    except OSError:
        return False  # held by a running recorder
    finally:
        os.close(fd)


def write_snapshot(path: Path, snapshot: dict[str, Any]) -> None:
    write_atomic(path, pickle.dumps(snapshot, protocol=PICKLE_PROTOCOL))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_atomic(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def sidecar_path(snapshot_path: Path) -> Path:
    return snapshot_path.with_name(snapshot_path.name.removesuffix(".pickle") + ".memlens.json")


def model_stats(model: Any) -> dict[str, Any] | None:
    """Parameter counts and bytes by dtype of an ``nn.Module`` (shared parameters counted once)."""
    if model is None:
        return None
    stats = _count_parameters(model.parameters())  # parameters() already skips duplicates
    stats["buffer_bytes_total"] = sum(buf.numel() * buf.element_size() for buf in model.buffers())
    stats["source"] = "model"
    return stats


def parameter_stats(params: Any) -> dict[str, Any]:
    """``model_stats`` for parameters known without their module (an optimizer's)."""
    unique = list({id(param): param for param in params}.values())
    stats = _count_parameters(unique)
    stats["buffer_bytes_total"] = None
    stats["source"] = "optimizer"
    return stats


def _count_parameters(params: Any) -> dict[str, Any]:
    total = trainable = total_bytes = 0
    by_dtype: dict[str, int] = {}
    for param in params:
        count = param.numel()
        size = count * param.element_size()
        total += count
        if param.requires_grad:
            trainable += count
        total_bytes += size
        by_dtype[str(param.dtype)] = by_dtype.get(str(param.dtype), 0) + size
    return {
        "parameters_total": total,
        "parameters_trainable": trainable,
        "parameter_bytes_total": total_bytes,
        "parameter_bytes_by_dtype": dict(sorted(by_dtype.items())),
    }


def optimizer_stats(optimizer: Any) -> dict[str, Any] | None:
    if optimizer is None:
        return None
    return {"class": type(optimizer).__name__, "param_groups": len(getattr(optimizer, "param_groups", []))}


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
    model: dict[str, Any] | None,
    optimizer: dict[str, Any] | None,
    recorder: dict[str, Any],
    tensor_roles: dict[str, Any] | None = None,
    outside_pytorch: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    import torch

    return {
        "memlens_sidecar_version": SIDECAR_VERSION,
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
    }



# ---------------------------------------------------------------- the model's shapes
# What the activation plateau's per-layer theory needs (memlens.analysis.activations.layer_theory
# sets each block's measured activation bytes against Megatron-LM's count: hidden size, batch,
# sequence length; heads and key/value heads refine it): ``model.config`` and ``model.inputs``
# in the table above. Only what is known for certain is written: ints a model declares, never a
# width inferred from weight shapes (an embedding's width is not always the hidden size: ALBERT
# factorises it).

# The names memlens.analysis.activations reads (its _THEORY_KEYS), less its generic fallbacks
# ("hidden", "heads"), which are too vague to copy from an arbitrary module's attributes.
DIMENSION_KEYS = (
    "hidden_size", "d_model", "n_embd",
    "num_attention_heads", "n_heads", "n_head",
    "num_key_value_heads", "n_kv_heads",
)
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd")
# Inputs handed to a forward are searched this deep into tuples, lists and dicts.
_MAX_DEPTH = 2


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_dimensions(model: Any) -> dict[str, int]:
    """The dimensions ``model`` declares (``model.config`` in the module docstring); {} when none."""
    model = _unwrapped(model)
    config = getattr(model, "config", None)
    if config is not None:
        found = _dimensions_of(config)
        if found:
            return found
    attributes = getattr(model, "__dict__", None)  # plain attributes only, not properties
    return _dimensions_of(attributes) if isinstance(attributes, Mapping) else {}


def _unwrapped(model: Any) -> Any:
    """The model inside DistributedDataParallel / DataParallel (``.module``) or ``torch.compile``
    (``._orig_mod``): the wrapper declares nothing itself."""
    for _ in range(4):  # a compiled DDP model: two wrappers; a few more levels cost nothing
        kind = type(model).__name__
        if kind in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module"):
            model = model.module
        elif kind == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            break
    return model


def _dimensions_of(source: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for key in DIMENSION_KEYS:
        try:
            value = source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)
        except Exception:  # a config's property may raise; it then declares nothing under that name
            continue
        number = _positive_int(value)
        if number is not None:
            found[key] = number
    return found


def input_dimensions(
    module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None, dimensions: Mapping[str, int]
) -> dict[str, Any] | None:
    """``{batch_size, seq_len, shape, dtype}`` from the tensors handed to ``module``'s forward, or
    None when none of them tells both for certain."""
    import torch

    kwargs = kwargs or {}
    token_ids = kwargs.get("input_ids")
    candidates = [token_ids] if isinstance(token_ids, torch.Tensor) else []
    candidates += list(_tensors(args, 0)) + list(_tensors(tuple(kwargs.values()), 0))
    for tensor in candidates:
        if tensor.dim() == 2 and not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool):
            return _described(tensor)
    hidden = next((dimensions[key] for key in _HIDDEN_KEYS if key in dimensions), None)
    if hidden is None or getattr(module, "batch_first", True) is False:
        return None
    for tensor in candidates:
        if tensor.dim() == 3 and tensor.is_floating_point() and tensor.shape[-1] == hidden:
            return _described(tensor)
    return None


def _described(tensor: torch.Tensor) -> dict[str, Any] | None:
    batch, seq = int(tensor.shape[0]), int(tensor.shape[1])
    if batch < 1 or seq < 1:
        return None
    return {"batch_size": batch, "seq_len": seq, "shape": [int(n) for n in tensor.shape], "dtype": str(tensor.dtype)}


def _tensors(values: tuple[Any, ...] | list[Any], depth: int) -> Iterator[torch.Tensor]:
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif depth < _MAX_DEPTH and isinstance(value, tuple | list):
            yield from _tensors(value, depth + 1)
        elif depth < _MAX_DEPTH and isinstance(value, Mapping):
            yield from _tensors(tuple(value.values()), depth + 1)


__all__ = [
    "PICKLE_PROTOCOL",
    "Reservation",
    "build_sidecar",
    "input_dimensions",
    "model_dimensions",
    "model_stats",
    "optimizer_stats",
    "parameter_stats",
    "remove_stale_files",
    "reservation_path",
    "reserve",
    "sidecar_path",
    "write_atomic",
    "write_json",
    "write_snapshot",
]
