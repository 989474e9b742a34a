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

The sidecar, ``<name>.memlens.json`` next to ``<name>.pickle``, is a
``memlens.sidecar.Sidecar`` (its fields and layouts are documented there, where its one
reader is): ``build_sidecar`` builds it and ``write_sidecar`` writes it. Gathered here: the
model's parameter counts (``model_stats``), the dimensions it declares and its layer count
(``model_dimensions``), its first forward's batch, sequence length and autocast dtype
(``input_dimensions``, ``autocast_dtype``), the vocabulary its logits show (``output_vocab``),
and the optimizer's class and state dtype (``optimizer_stats``, ``optimizer_state_dtype``).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import pickle
import platform
import re
import socket
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from memlens import files
from memlens._version import __version__
from memlens.sidecar import ModelConfig, ModelInfo, ModelInputs, OptimizerInfo, Sidecar, encode_sidecar

if TYPE_CHECKING:  # torch is imported where tensors are looked at: reading a sidecar needs none
    import torch

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


def write_sidecar(path: Path, sidecar: Sidecar) -> None:
    write_atomic(path, encode_sidecar(sidecar))


def sidecar_path(snapshot_path: Path) -> Path:
    return snapshot_path.with_name(snapshot_path.name.removesuffix(".pickle") + ".memlens.json")


def model_stats(model: Any) -> ModelInfo | None:
    """Parameter counts and bytes by dtype of an ``nn.Module`` (shared parameters counted once),
    and the dimensions it declares (``model_dimensions``)."""
    if model is None:
        return None
    stats = _count_parameters(model.parameters())  # parameters() already skips duplicates
    stats.buffer_bytes_total = sum(buf.numel() * buf.element_size() for buf in model.buffers())
    stats.source = "model"
    stats.config = model_dimensions(model)
    return stats


class ModelInspector:
    """What the sidecar says of one model, for ``memlens record`` and ``memlens predict`` alike:
    its counts and declared dimensions (``model_stats``), then, from its forward calls, the
    autocast dtype of the first, the batch and sequence length of the first that tells them
    (``input_dimensions``) and the vocabulary its logits show (``output_vocab``). One inspector,
    so a recording and a prediction of the same script describe the same model."""

    def __init__(self, model: Any) -> None:
        self.stats: ModelInfo | None = model_stats(model)
        self._model = weakref.ref(model)  # the inspector must not keep the user's model alive
        self._first_forward_seen = False
        self._vocab_pending = False

    def inspects(self, module: Any) -> bool:
        return module is not None and module is self._model()

    def on_inputs(self, module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> None:
        """A forward pre-hook's view of ``module``'s inputs (ignored for another module)."""
        stats = self.stats
        if stats is None or stats.inputs is not None or not self.inspects(module):
            return
        if not self._first_forward_seen:
            self._first_forward_seen = True
            stats.autocast_dtype = autocast_dtype(args, kwargs, module)
        stats.inputs = input_dimensions(module, args, kwargs, stats.config)
        self._vocab_pending = stats.inputs is not None and stats.config.vocab_size is None

    def on_outputs(self, module: Any, output: Any) -> None:
        """A forward hook's view of what ``module`` returned: its logits show the vocabulary."""
        stats = self.stats
        if not self._vocab_pending or stats is None or stats.inputs is None or not self.inspects(module):
            return
        self._vocab_pending = False
        stats.config.vocab_size = output_vocab(output, stats.inputs, stats.config)


def parameter_stats(params: Any) -> ModelInfo:
    """``model_stats`` for parameters known without their module (an optimizer's)."""
    unique = list({id(param): param for param in params}.values())
    stats = _count_parameters(unique)
    stats.source = "optimizer"
    return stats


def _count_parameters(params: Any) -> ModelInfo:
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
    return ModelInfo(parameters_total=total, parameters_trainable=trainable, parameter_bytes_total=total_bytes,
                     parameter_bytes_by_dtype=dict(sorted(by_dtype.items())))


def optimizer_stats(optimizer: Any) -> dict[str, Any] | None:
    """The optimizer's class and groups (and SGD's momentum), as the sidecar's ``optimizer``."""
    if optimizer is None:
        return None
    stats: dict[str, Any] = {"class": type(optimizer).__name__,
                             "param_groups": len(getattr(optimizer, "param_groups", []))}
    momentum = (getattr(optimizer, "defaults", None) or {}).get("momentum")
    if isinstance(momentum, int | float) and not isinstance(momentum, bool) and momentum >= 0:
        stats["momentum"] = float(momentum)
    return stats


def optimizer_state_dtype(optimizers: Any) -> str | None:
    """The dtype holding most of the optimizers' state tensors now (``"torch.float32"``), None
    before their first step; scalar entries (Adam's ``step``) do not count."""
    import torch

    by_dtype: dict[str, int] = {}
    for optimizer in optimizers:
        state = getattr(optimizer, "state", None)
        for entry in state.values() if isinstance(state, Mapping) else ():
            for value in entry.values() if isinstance(entry, Mapping) else ():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    key = str(value.dtype)
                    by_dtype[key] = by_dtype.get(key, 0) + value.numel() * value.element_size()
    return max(sorted(by_dtype), key=lambda name: by_dtype[name]) if by_dtype else None


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
    import torch

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


# ---------------------------------------------------------------- the model's shapes
# What the activation plateau's per-layer theory and the budget need (hidden size, layers, heads,
# vocabulary, batch, sequence length, precision): ``model.config``, ``model.inputs`` and
# ``model.autocast_dtype``. Only what is known for certain is written: ints a model declares, the
# length of its stack of blocks, and shapes seen at run time; never a width inferred from weight
# shapes (an embedding's width is not always the hidden size: ALBERT factorises it).

# The names a model declares each dimension by, the Hugging Face name first (the one written).
DIMENSION_NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads", "n_kv_heads"),
    "num_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "vocab_size": ("vocab_size", "n_vocab"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
}
# Inputs handed to a forward are searched this deep into tuples, lists and dicts.
_MAX_DEPTH = 2


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_dimensions(model: Any) -> ModelConfig:
    """The dimensions ``model`` declares (a Hugging Face ``config``, else plain attributes of the
    root module), and its layer count: declared, else the length of its stack of blocks."""
    model = _unwrapped(model)
    found: dict[str, int] = {}
    config = getattr(model, "config", None)
    if config is not None:
        found = _dimensions_of(config)
    if not found:
        attributes = getattr(model, "__dict__", None)  # plain attributes only, not properties
        found = _dimensions_of(attributes) if isinstance(attributes, Mapping) else {}
    dimensions = msgspec.convert(found, ModelConfig)
    if dimensions.num_layers is None:
        stack = layer_stack(model)
        if stack is not None:
            dimensions.layers_module, dimensions.num_layers = stack
    return dimensions


def layer_stack(model: Any) -> tuple[str, int] | None:
    """The dotted name and length of the model's stack of blocks: the ``nn.ModuleList`` (or an
    ``nn.Sequential`` of one class) of at least two modules of one class holding the most
    parameters. None when it has none (an MLP of different layers is no stack)."""
    from torch import nn

    named = getattr(model, "named_modules", None)
    if named is None:
        return None
    best: tuple[tuple[int, int], str, int] | None = None
    for name, module in named():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module)
        if len(children) < 2 or len({type(child) for child in children}) != 1:
            continue
        size = sum(param.numel() for param in module.parameters())
        if size and (best is None or (size, len(children)) > best[0]):
            best = ((size, len(children)), name, len(children))
    return (best[1] or "(root)", best[2]) if best is not None else None


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
    for field_name, names in DIMENSION_NAMES.items():
        for key in names:
            try:
                value = source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)
            except Exception:  # a config's property may raise; it then declares nothing under that name
                continue
            number = _positive_int(value)
            if number is not None:
                found[field_name] = number
                break
    return found


def input_dimensions(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None,
                     dimensions: ModelConfig) -> ModelInputs | None:
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
    hidden = dimensions.hidden_size
    if hidden is None or getattr(module, "batch_first", True) is False:
        return None
    for tensor in candidates:
        if tensor.dim() == 3 and tensor.is_floating_point() and tensor.shape[-1] == hidden:
            return _described(tensor)
    return None


def output_vocab(output: Any, inputs: ModelInputs, dimensions: ModelConfig) -> int | None:
    """The vocabulary a language model's logits show: the last dimension of a float
    ``(batch, seq, V)`` output (``logits`` first) of the first forward whose inputs were token
    ids, when V is not the hidden size (a hidden state is no logits). None otherwise."""
    import torch

    if inputs.dtype is None or "float" in inputs.dtype or len(inputs.shape) != 2:
        return None  # only token ids say that the model reads a vocabulary
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    candidates = [logits] if isinstance(logits, torch.Tensor) else []
    candidates += list(_tensors(output if isinstance(output, tuple | list) else (output,), 0))
    leading = (inputs.batch_size, inputs.seq_len)
    for tensor in candidates:
        if (tensor.dim() == 3 and tensor.is_floating_point() and tuple(tensor.shape[:2]) == leading
                and tensor.shape[-1] != dimensions.hidden_size and tensor.shape[-1] > 1):
            return int(tensor.shape[-1])
    return None


def autocast_dtype(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None, model: Any) -> str | None:
    """The dtype autocast casts to now on the device of the model's inputs (else its parameters),
    ``"torch.bfloat16"``; None when autocast is off there."""
    import torch

    tensors = list(_tensors(args, 0)) + list(_tensors(tuple((kwargs or {}).values()), 0))
    if not tensors:
        parameters = getattr(model, "parameters", None)
        tensors = list(itertools.islice(parameters(), 1)) if parameters is not None else []
    device_type = tensors[0].device.type if tensors else "cpu"
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return str(torch.get_autocast_dtype(device_type))
    except (TypeError, RuntimeError, AttributeError):  # a torch before 2.4, or a device type without autocast
        return None


def _described(tensor: torch.Tensor) -> ModelInputs | None:
    batch, seq = int(tensor.shape[0]), int(tensor.shape[1])
    if batch < 1 or seq < 1:
        return None
    return ModelInputs(batch_size=batch, seq_len=seq, shape=[int(n) for n in tensor.shape], dtype=str(tensor.dtype))


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
    "ModelInspector",
    "Reservation",
    "autocast_dtype",
    "build_sidecar",
    "input_dimensions",
    "layer_stack",
    "model_dimensions",
    "model_stats",
    "optimizer_state_dtype",
    "optimizer_stats",
    "output_vocab",
    "parameter_stats",
    "remove_stale_files",
    "reservation_path",
    "reserve",
    "sidecar_path",
    "write_atomic",
    "write_json",
    "write_sidecar",
    "write_snapshot",
]
