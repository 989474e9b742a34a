"""Per-stack facts (is it inside optimizer.step? backward?) and how stacks are shown.

Flags are computed once per frame and reduced per stack with numpy, so a table of 100k
stacks costs milliseconds; rows then look their flags up by ``stack_id``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from memlens.analysis.datatypes import StackBytes
from memlens.analysis.settings import MAX_FRAMES_PER_STACK
from memlens.snapshot.model import Frame, StackTable

# torch's optimizers, on POSIX and Windows paths (real files have both).
_OPTIM_FILE = re.compile(r"torch[/\\]optim[/\\]")
# Third-party optimizers that subclass nothing torch-side still live in an "optim*" file as `step`.
_OPTIM_STEP_FILE = re.compile(r"(^|[/\\])(optim|optimizer|optimizers)[^/\\]*\.py$")
_AUTOGRAD_FILE = re.compile(r"torch[/\\](autograd[/\\]|_tensor\.py)")
_BACKWARD_NAMES = frozenset({"backward", "_engine_run_backward", "run_backward"})
# C++ frames of PyTorch's cuBLAS handle pool (aten/src/ATen/cuda/CublasHandlePool.cpp) that take
# a workspace from the caching allocator, once per handle (per thread that runs matmuls) and kept
# for the process's life; memlens predict gives its modelled workspaces the same frame.
# cuDNN's convolution workspace (aten/src/ATen/native/cudnn/Conv_v8.cpp): run_conv_plan takes the
# plan's workspace from the caching allocator and frees it when the convolution returns; on an H200
# the backward-weight ones reached 250 MiB, and nothing else is allocated under that frame.
_CPP_WORKSPACE = re.compile(
    r"at::cuda::(getNewWorkspace|getCUDABlasLtWorkspace|getCurrentCUDABlasHandle)\b"
    r"|at::native::run_conv_plan(_fused)?\b"
)
# torch's Python files whose innermost frame calls into cuBLAS (F.linear, the attention and
# einsum wrappers): in a recording without C++ frames, the frame a cuBLAS workspace shows.
_CUBLAS_CALLER_FILE = re.compile(
    r"torch[/\\](nn[/\\]modules[/\\](linear|activation)\.py|nn[/\\]functional\.py|functional\.py)$"
)
# C++ frames (stacks="all") of autograd's engine thread: backward even without Python frames.
_CPP_BACKWARD = re.compile(r"torch::autograd::(Engine::|generated::\w+Backward)")
# C++ frames that every allocation shares (the unwinder, the allocator, empty-tensor helpers).
_CPP_NOISE = re.compile(
    r"(unwind|CapturedTraceback|gather_with_cpp|CUDACachingAllocator|_empty_generic|empty_cuda|"
    r"intrusive_ptr|^_start$|__libc|^clone$|_PyEval|_PyObject|PyRun|Py_BytesMain|pymain)"
)
# Frames inside torch, its compiler output and common wrappers: hidden when user frames exist.
_INTERNAL_FILE = re.compile(
    r"([/\\]site-packages[/\\]|[/\\]dist-packages[/\\]|[/\\]torch[/\\]|torchinductor_|^<frozen )"
)


def is_python_frame(frame: Frame) -> bool:
    """Python frames have a ``.py`` file (or ``<string>``-style names); C++ frames do not.

    ``Frame.is_python`` treats any named file as Python, which lets C++ frames such as
    ``gather_with_cpp() (memory_snapshot.cpp:0)`` through, so the analysis uses this instead.
    """
    name = frame.filename
    return name.endswith(".py") or (name.startswith("<") and name != "<unknown>")


def is_optimizer_frame(frame: Frame) -> bool:
    if _OPTIM_FILE.search(frame.filename):
        return True
    return frame.name == "step" and bool(_OPTIM_STEP_FILE.search(frame.filename))


def is_workspace_frame(frame: Frame) -> bool:
    """A C++ frame of the library code that allocates a cuBLAS or cuDNN workspace."""
    return not frame.filename.endswith(".py") and bool(_CPP_WORKSPACE.search(frame.name))


def calls_cublas_from_python(frames: list[Frame]) -> bool:
    """A stack of Python frames only whose innermost frame is one of torch's cuBLAS callers: what
    a cuBLAS workspace taken in a forward looks like in a ``stacks="python"`` recording."""
    return bool(frames) and all(is_python_frame(f) for f in frames) \
        and bool(_CUBLAS_CALLER_FILE.search(frames[0].filename))


def is_backward_frame(frame: Frame) -> bool:
    if frame.name in _BACKWARD_NAMES and _AUTOGRAD_FILE.search(frame.filename):
        return True
    return not frame.filename.endswith(".py") and bool(_CPP_BACKWARD.search(frame.name))


def reduce_per_stack(table: StackTable, frame_flag: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """Per stack: does any of its frames have the flag? (+1 slot so stack id -1 reads False.)"""
    out = np.zeros(len(table.stacks) + 1, dtype=bool)
    if not table.stacks or not frame_flag.any():
        return out
    lengths = np.fromiter(map(len, table.stacks), dtype=np.int64, count=len(table.stacks))
    flat = np.fromiter(itertools.chain.from_iterable(table.stacks), dtype=np.int64, count=int(lengths.sum()))
    hits = frame_flag[flat].astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    if not flat.size:
        return out
    starts = np.minimum(bounds[:-1], flat.size - 1)  # reduceat needs in-range starts
    counts = np.add.reduceat(hits, starts)
    counts[lengths == 0] = 0
    out[:-1] = counts > 0
    return out


def min_per_stack(table: StackTable, frame_value: npt.NDArray[np.int32], empty: int) -> npt.NDArray[np.int32]:
    """Per stack: the smallest value of its frames (``empty`` for a stack without frames), +1
    slot (for stack id -1) holding ``empty``. One pass over the frames of the distinct stacks."""
    out = np.full(len(table.stacks) + 1, empty, dtype=np.int32)
    if not table.stacks:
        return out
    lengths = np.fromiter(map(len, table.stacks), dtype=np.int64, count=len(table.stacks))
    flat = np.fromiter(itertools.chain.from_iterable(table.stacks), dtype=np.int64, count=int(lengths.sum()))
    if not flat.size:
        return out
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    filled = lengths > 0  # (the reader never makes an empty stack; reduceat needs distinct starts)
    out[:-1][filled] = np.minimum.reduceat(frame_value[flat], starts[filled])
    return out


@dataclass
class StackFacts:
    """Lookup arrays indexed by ``stack_id`` (index -1 is the "no stack" slot)."""

    table: StackTable
    optimizer: npt.NDArray[np.bool_]
    backward: npt.NDArray[np.bool_]
    # Any frame called "backward" (custom autograd.Function, Lightning, ...): weaker evidence.
    backward_named: npt.NDArray[np.bool_]
    # A library workspace's allocation (is_workspace_frame): its own category, never guessed.
    workspace: npt.NDArray[np.bool_]
    # frames_for_display per stack id: top_stacks, diff and the lenses ask for the same stacks
    # again and again (per step, per finding), and a stack's frames are read once.
    _display: dict[int, list[str]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, table: StackTable) -> StackFacts:
        frames = table.frames
        optim = np.fromiter((is_optimizer_frame(f) for f in frames), dtype=bool, count=len(frames))
        backward = np.fromiter((is_backward_frame(f) for f in frames), dtype=bool, count=len(frames))
        named = np.fromiter((f.name in _BACKWARD_NAMES for f in frames), dtype=bool, count=len(frames))
        workspace = np.fromiter((is_workspace_frame(f) for f in frames), dtype=bool, count=len(frames))
        return cls(
            table,
            reduce_per_stack(table, optim),
            reduce_per_stack(table, backward),
            reduce_per_stack(table, named | backward),
            reduce_per_stack(table, workspace),
        )

    def frames_for_display(self, stack_id: int) -> list[str]:
        """Python frames, innermost first; torch-internal ones dropped when user frames exist
        (among the stack's innermost ``MAX_FRAMES_EXAMINED``). A new list each call."""
        shown = self._display.get(stack_id)
        if shown is None:
            frames = self.table.innermost(stack_id)
            python = [f for f in frames if is_python_frame(f)]
            user = [f for f in python if not _INTERNAL_FILE.search(f.filename)]
            chosen = user or python or [
                f for f in frames if f.filename not in ("??", "") and not _CPP_NOISE.search(f.name)
            ]
            shown = self._display[stack_id] = [str(f) for f in chosen[:MAX_FRAMES_PER_STACK]]
        return list(shown)

    def top_stacks(
        self, stack_ids: npt.NDArray[np.int32], sizes: npt.NDArray[np.int64], limit: int
    ) -> list[StackBytes]:
        """The stacks holding most bytes among the given allocations (same display merged)."""
        if stack_ids.size == 0:
            return []
        slots = stack_ids.astype(np.int64) + 1  # -1 (no stack) -> slot 0
        total = np.bincount(slots, weights=sizes.astype(np.float64))
        count = np.bincount(slots)
        merged: dict[tuple[str, ...], list[int]] = {}
        # Only the heaviest few hundred stacks can reach the top after merging equal displays.
        for slot in np.argsort(-total)[: max(limit * 40, 200)]:
            if count[slot] == 0:
                continue
            key = tuple(self.frames_for_display(int(slot) - 1))
            entry = merged.setdefault(key, [0, 0])
            entry[0] += round(total[slot])
            entry[1] += int(count[slot])
        ranked = sorted(merged.items(), key=lambda kv: -kv[1][0])[:limit]
        return [StackBytes(frames=list(k), bytes=v[0], count=v[1]) for k, v in ranked if v[0] > 0]
