"""Realistic synthetic snapshots in PyTorch's exact schema, for benchmarks and tests.

A training loop is played out step by step: parameters that were live before the window
(ghost blocks), forward activations that rise and fall through backward, gradients created in
the first backward, AdamW state created in the first ``optimizer.step`` and foreach
temporaries after it. Stacks are 10-60 frames drawn from a shared pool of frame dicts, as
PyTorch's own pickler shares them. Memory is laid out in slabs per size class (addresses are
reused like a caching allocator's), so segments, blocks and the trace agree exactly.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
from typing import Any

ROUND = 512
SEGMENT = 20 << 20


def _round(size: int) -> int:
    return max(ROUND, (size + ROUND - 1) // ROUND * ROUND)


class _SlabHeap:
    """Hands out reusable addresses per rounded size; carves new ones from 20 MiB segments."""

    def __init__(self, base: int, trace: list[dict[str, Any]], clock: list[int]) -> None:
        self.base = base
        self.trace = trace
        self.clock = clock
        self.free: dict[int, list[int]] = {}
        self.segments: list[list[int]] = []  # [address, size, used]
        self.slots: dict[int, int] = {}  # address -> rounded size
        self.in_window = True

    def take(self, size: int) -> int:
        rounded = _round(size)
        pool = self.free.get(rounded)
        if pool:
            return pool.pop()
        seg = self.segments[-1] if self.segments else None
        if seg is None or seg[2] + rounded > seg[1]:
            seg_size = max(SEGMENT, (rounded + (2 << 20) - 1) // (2 << 20) * (2 << 20))
            address = self.base
            self.base += seg_size + (2 << 20)
            seg = [address, seg_size, 0]
            self.segments.append(seg)
            if self.in_window:
                self.clock[0] += 3
                self.trace.append({"action": "segment_alloc", "addr": address, "size": seg_size, "stream": 0,
                                   "time_us": self.clock[0], "compile_context": "N/A", "user_metadata": ""})
        address = seg[0] + seg[2]
        seg[2] += rounded
        self.slots[address] = rounded
        return address

    def give_back(self, address: int) -> None:
        self.free.setdefault(self.slots[address], []).append(address)


def synthetic_snapshot(
    events: int = 100_000,
    *,
    seed: int = 0,
    layers: int = 24,
    param_tensors: int = 96,
    leak_bytes_per_step: int = 0,
) -> dict[str, Any]:
    """A raw snapshot dict of about ``events`` trace entries (alloc + free pairs, segments)."""
    rng = random.Random(seed)
    files = [f"/workspace/project/model/{name}.py" for name in ("model", "attention", "mlp", "train", "data")]
    torch_files = [f"/usr/lib/python3.11/site-packages/torch/{n}.py" for n in
                   ("nn/modules/module", "nn/functional", "autograd/__init__", "optim/adamw", "_tensor")]
    frame_pool = [
        {"filename": rng.choice(files + torch_files), "line": rng.randint(1, 900),
         "name": rng.choice(["forward", "_call_impl", "attention", "mlp", "step", "backward", "_wrapped_call",
                             "linear", "softmax", "layer_norm", "train_step", "main", "<module>"])}
        for _ in range(400)
    ]

    def make_stack(tag: str) -> list[dict[str, Any]]:
        depth = rng.randint(10, 60)
        inner = {"filename": files[0] if tag != "optim" else torch_files[3], "line": rng.randint(1, 500),
                 "name": tag}
        return [inner, *rng.sample(frame_pool, depth - 1)]

    stacks = {tag: [make_stack(tag) for _ in range(60)] for tag in ("forward", "backward", "optim", "temp")}
    # A leak is one line keeping something every step (``kept.append(x)`` in the training loop):
    # one stack, built without the generator so snapshots without a leak stay as they were.
    leak_stack = [{"filename": files[3], "line": 88, "name": "train_step"}, *stacks["forward"][0][1:]]
    trace: list[dict[str, Any]] = []
    clock = [1_700_000_000_000_000]
    heap = _SlabHeap(0x7F0000000000, trace, clock)
    live: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    annotations: list[dict[str, Any]] = []
    step_label = [""]

    def alloc(size: int, tag: str) -> int:
        address = heap.take(size)
        frames = leak_stack if tag == "leak" else rng.choice(stacks[tag])
        live[address] = (size, frames)
        if heap.in_window:
            clock[0] += rng.randint(1, 20)
            trace.append({"action": "alloc", "addr": address, "size": size, "stream": 0, "time_us": clock[0],
                          "compile_context": "N/A", "user_metadata": step_label[0], "frames": frames})
        return address

    def free(address: int) -> None:
        size, frames = live.pop(address)
        heap.give_back(address)
        for action in ("free_requested", "free_completed"):
            clock[0] += rng.randint(1, 5)
            trace.append({"action": action, "addr": address, "size": size, "stream": 0, "time_us": clock[0],
                          "compile_context": "N/A", "user_metadata": step_label[0], "frames": frames})

    # Before the window: the model's parameters (ghost blocks with no alloc event).
    heap.in_window = False
    params = [alloc(rng.choice([4, 8, 16, 32]) << 20, "forward") for _ in range(param_tensors)]
    heap.in_window = True
    act_sizes = [rng.choice([1, 2, 4, 6, 8, 12]) << 20 for _ in range(layers * 6)]
    grads: list[int] = []
    state: list[int] = []
    leaked: list[int] = []
    step = 0
    while len(trace) < events:
        step += 1
        step_label[0] = f"memlens.step#{step}"
        annotations.append({"name": step_label[0], "stage": "START", "device": 0, "time_us": clock[0] + 1})
        acts = []
        for size in act_sizes:  # forward: activations pile up
            acts.append(alloc(size, "forward"))
            tmp = alloc(rng.choice([64 << 10, 512 << 10, 2 << 20]), "temp")
            free(tmp)
        if leak_bytes_per_step:
            leaked.append(alloc(leak_bytes_per_step, "leak"))
        for address in reversed(acts):  # backward: they fall, gradients appear
            tmp = alloc(rng.choice([256 << 10, 1 << 20]), "backward")
            free(address)
            free(tmp)
        if not grads:
            grads = [alloc(live[p][0], "backward") for p in params]
        annotations.append({"name": "Optimizer.step#AdamW.step", "stage": "START", "device": 0,
                            "time_us": clock[0] + 1})
        if not state:
            state = [alloc(live[p][0], "optim") for p in params for _ in range(2)]
        temps = [alloc(live[p][0] // 4, "optim") for p in params[: len(params) // 2]]
        for address in temps:
            free(address)
        annotations.append({"name": "Optimizer.step#AdamW.step", "stage": "END", "device": 0,
                            "time_us": clock[0] + 1})
        annotations.append({"name": step_label[0], "stage": "END", "device": 0, "time_us": clock[0] + 2})

    segments = []
    for address, size, used in heap.segments:
        blocks: list[dict[str, Any]] = []
        cursor = address
        for slot in sorted(a for a in heap.slots if address <= a < address + used):
            slot_size = heap.slots[slot]
            if slot in live:
                requested, frames = live[slot]
                blocks.append({"address": slot, "size": slot_size, "requested_size": requested,
                               "state": "active_allocated", "frames": frames})
            else:
                blocks.append({"address": slot, "size": slot_size, "requested_size": slot_size,
                               "state": "inactive", "frames": []})
            cursor = slot + slot_size
        if cursor < address + size:
            blocks.append({"address": cursor, "size": address + size - cursor, "requested_size": 0,
                           "state": "inactive", "frames": []})
        segments.append({
            "device": 0, "address": address, "total_size": size,
            "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
            "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
            "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": blocks,
        })
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                               "garbage_collection_threshold": 0.0, "expandable_segments": False},
        "external_annotations": annotations,
    }


def write_pickle(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write atomically with protocol 4 (what pytorch.org/memory_viz can read)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".memlens-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            pickle.dump(obj, handle, protocol=4)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> None:
    """``python -m memlens.synthetic EVENTS PATH [--seed N]``: write one snapshot. The benchmarks
    run it in a child process so the parent's peak RSS never inflates what they measure."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("events", type=int)
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    write_pickle(synthetic_snapshot(args.events, seed=args.seed), args.path)


if __name__ == "__main__":
    main()
