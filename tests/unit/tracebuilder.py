"""Tiny hand-built snapshots in PyTorch's raw schema, for the analysis unit tests.

``TraceBuilder`` records alloc/free/annotation/oom entries with a fake clock (10 us a row) and
emits a raw dict whose segments agree with the trace, which ``reader.parse`` turns into a
``Snapshot``. Frames are shared dicts, as PyTorch's pickler shares them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from memlens.sidecar import sidecar_from_builtins
from memlens.snapshot.model import Snapshot
from memlens.snapshot.reader import parse

MiB = 1 << 20


def frame(name: str, filename: str, line: int = 1) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


MODEL = [frame("forward", "/work/proj/model.py", 10), frame("train", "/work/proj/train.py", 5)]
LOSS = [frame("cross_entropy", "/work/proj/train.py", 20), frame("train", "/work/proj/train.py", 21)]
BACKWARD = [
    frame("_engine_run_backward", "/venv/site-packages/torch/autograd/graph.py", 824),
    frame("backward", "/venv/site-packages/torch/autograd/__init__.py", 289),
    frame("backward", "/venv/site-packages/torch/_tensor.py", 581),
    frame("train", "/work/proj/train.py", 30),
]
OPTIM = [
    frame("_multi_tensor_adamw", "/venv/site-packages/torch/optim/adamw.py", 500),
    frame("step", "/venv/site-packages/torch/optim/adamw.py", 200),
    frame("train", "/work/proj/train.py", 40),
]
OPTIM_WINDOWS = [
    frame("_single_tensor_adam", "C:\\venv\\Lib\\site-packages\\torch\\optim\\adam.py", 300),
    frame("train", "C:\\proj\\train.py", 40),
]
LEAKY = [frame("train", "/work/proj/train.py", 50)]
TEMP = [frame("softmax", "/work/proj/model.py", 30), frame("train", "/work/proj/train.py", 5)]


def _round(size: int) -> int:
    return max(512, (size + 511) // 512 * 512)


class TraceBuilder:
    def __init__(self, start_us: int = 1_000_000, with_time: bool = True) -> None:
        self.trace: list[dict[str, Any]] = []
        self.annotations: list[dict[str, Any]] = []
        self.live: dict[int, tuple[int, list[dict[str, Any]] | None]] = {}
        self.free_pieces: list[int] = []
        self.clock = start_us
        self.with_time = with_time
        self.next_address = 0x7F00_0000_0000
        self.metadata = ""

    # ------------------------------------------------------------------ rows
    def _tick(self) -> int:
        self.clock += 10
        return self.clock

    def _entry(self, action: str, address: int, size: int, frames: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {"action": action, "addr": address, "size": size, "stream": 0}
        if self.with_time:
            entry["time_us"] = self._tick()
        if frames:
            entry["frames"] = frames
        if self.metadata:
            entry["user_metadata"] = self.metadata
        return entry

    def _address(self, size: int) -> int:
        address = self.next_address
        self.next_address += _round(size) + (2 * MiB)
        return address

    def ghost(self, size: int, frames: list[dict[str, Any]] | None = None) -> int:
        """A block allocated before the window began: live, with no alloc row."""
        address = self._address(size)
        self.live[address] = (size, frames)
        return address

    def alloc(self, size: int, frames: list[dict[str, Any]] | None = None) -> int:
        address = self._address(size)
        self.live[address] = (size, frames)
        self.trace.append(self._entry("alloc", address, size, frames))
        return address

    def free(self, address: int) -> None:
        size, frames = self.live.pop(address)
        self.trace.append(self._entry("free_requested", address, size, frames))
        self.trace.append(self._entry("free_completed", address, size, frames))

    def oom(self, size: int, device_free: int) -> None:
        entry = self._entry("oom", 0, size, None)
        entry["device_free"] = device_free
        self.trace.append(entry)

    def annotate(self, name: str, stage: str) -> None:
        self.annotations.append({"name": name, "stage": stage, "device": 0, "time_us": self._tick()})

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self.annotate(name, "START")
        yield
        self.annotate(name, "END")

    # ------------------------------------------------------------------ loops
    def train_step(
        self,
        activations: list[int],
        params: list[int] | None = None,
        grads: list[int] | None = None,
        state: list[int] | None = None,
        optimizer_temps: int = 0,
        leak: int = 0,
        optimizer_frames: list[dict[str, Any]] | None = None,
        annotate_optimizer: bool = True,
    ) -> list[int]:
        """forward (activations rise) -> backward (they fall, grads appear) -> optimizer.step.

        ``grads`` holds the gradient addresses kept between steps (created on the first call);
        ``state`` likewise for optimizer state. Returns the new grads list.
        """
        params = params or []
        acts = []
        for size in activations:
            acts.append(self.alloc(size, MODEL))
            tmp = self.alloc(64 * 1024, TEMP)
            self.free(tmp)
        if leak:
            self.alloc(leak, LEAKY)
        for address in reversed(acts):
            tmp = self.alloc(128 * 1024, BACKWARD)
            self.free(address)
            self.free(tmp)
        if grads is not None and not grads:
            grads.extend(self.alloc(self.live[p][0], BACKWARD) for p in params)
        frames = optimizer_frames or OPTIM
        if annotate_optimizer:
            self.annotate("Optimizer.step#AdamW.step", "START")
        if state is not None and not state:
            state.extend(self.alloc(self.live[p][0], frames) for p in params for _ in range(2))
        temps = [self.alloc(optimizer_temps, frames) for _ in range(2)] if optimizer_temps else []
        for address in temps:
            self.free(address)
        if annotate_optimizer:
            self.annotate("Optimizer.step#AdamW.step", "END")
        return grads or []

    # ------------------------------------------------------------------ output
    def add_free_space(self, *pieces: int) -> None:
        """Cached free blocks (inactive) in their own segments: reserved but not allocated."""
        self.free_pieces.extend(pieces)

    def raw(self) -> dict[str, Any]:
        segments = []
        for address, (size, frames) in sorted(self.live.items()):
            rounded = _round(size)
            block = {"address": address, "size": rounded, "requested_size": size,
                     "state": "active_allocated", "frames": frames or []}
            segments.append(self._segment(address, rounded, [block]))
        for piece in self.free_pieces:
            address = self._address(piece)
            block = {"address": address, "size": piece, "requested_size": 0, "state": "inactive", "frames": []}
            segments.append(self._segment(address, piece, [block]))
        raw: dict[str, Any] = {
            "segments": segments,
            "device_traces": [self.trace],
            "allocator_settings": {"expandable_segments": False, "max_split_size": -1},
        }
        if self.annotations:
            raw["external_annotations"] = self.annotations
        return raw

    @staticmethod
    def _segment(address: int, total: int, blocks: list[dict[str, Any]]) -> dict[str, Any]:
        return {"device": 0, "address": address, "total_size": total, "stream": 0,
                "segment_type": "large" if total > MiB else "small", "segment_pool_id": (0, 0),
                "is_expandable": False, "frames": [], "blocks": blocks}

    def snapshot(self, sidecar: dict[str, Any] | None = None) -> Snapshot:
        snap = parse(self.raw())
        if sidecar:  # as the reader would have read it beside the file (older layouts migrated)
            snap.sidecar = sidecar_from_builtins(sidecar)
        return snap


def training_run(
    steps: int,
    *,
    markers: str = "memlens",
    leak: int = 0,
    activations: tuple[int, ...] = (64 * MiB,) * 8,
    params: tuple[int, ...] = (32 * MiB,) * 4,
    optimizer_temps: int = 16 * MiB,
    optimizer_frames: list[dict[str, Any]] | None = None,
    annotate_optimizer: bool = True,
) -> TraceBuilder:
    """A loop of ``steps`` training steps with ghost parameters, marked as ``markers`` says
    (memlens | profiler | metadata | none)."""
    b = TraceBuilder()
    param_addresses = [b.ghost(size, MODEL) for size in params]
    grads: list[int] = []
    state: list[int] = []
    for step in range(1, steps + 1):
        name = {"memlens": f"memlens.step#{step}", "profiler": f"ProfilerStep#{step}"}.get(markers)
        if markers == "metadata":
            b.metadata = f"memlens.step#{step}"
        if name:
            b.annotate(name, "START")
        b.train_step(list(activations), param_addresses, grads, state, optimizer_temps, leak,
                     optimizer_frames, annotate_optimizer)
        if name:
            b.annotate(name, "END")
    return b
