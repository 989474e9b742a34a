"""Python stacks in the shape CUDA's ``stacks="python"`` records: ``{"filename", "line", "name"}``
dicts, innermost first.

Capturing a stack is on the hot path (once per new tensor storage and once per free), so it
walks ``sys._getframe`` by hand instead of building ``traceback`` objects, and interns twice:
each distinct ``(code, line)`` becomes one frame dict, and each distinct stack one list. Shared
objects also keep the pickle small: the pickler writes a repeated object once and refers to it
afterwards, exactly as PyTorch's own snapshots share their frames.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

# CUDA's own python stacks are unbounded; 64 frames cover a deep training loop (Lightning,
# HF Trainer, nn.Module hooks) while keeping one stack's walk cheap.
DEFAULT_MAX_DEPTH = 64

Frame = dict[str, object]
_HERE = os.path.dirname(os.path.abspath(__file__))
# The dispatch-mode plumbing between the op and our handler (PyTorch wraps the handler in a
# dynamo-disable decorator) says nothing about the user's program: CUDA's stacks start where the
# allocator was called, so ours drop these frames while they are the innermost ones.
_PLUMBING_FILES = (
    "torch/utils/_python_dispatch.py",
    "torch/_ops.py",
    "torch/_compile.py",
    "torch/_dynamo/eval_frame.py",
    "/weakref.py",  # a free is reported from weakref.finalize.__call__
)


# Frames of memlens' own launcher (``memlens record``: the command, click, the memlens entry
# point) are hidden from recorded stacks: ``hide_frames_outward`` registers them before the
# script runs. runpy's frames (how the script is run as __main__) are hidden always.
_HIDDEN_CODES: set[CodeType] = set()
_HIDDEN_FILES = ("/runpy.py", "<frozen runpy>")  # runpy is frozen into Python 3.11+


def hide_frames_outward(frame: FrameType | None) -> None:
    """Hide ``frame`` and every frame outward of it from the stacks recorded from now on."""
    while frame is not None:
        _HIDDEN_CODES.add(frame.f_code)
        frame = frame.f_back


def _is_recorder_file(filename: str) -> bool:
    return filename.startswith(_HERE) or filename.endswith(_HIDDEN_FILES)


def hide_launcher_frames(snapshot: dict[str, Any]) -> None:
    """Drop hidden frames (see ``hide_frames_outward``) from the stacks of a snapshot written by
    the allocator itself (CUDA's history knows nothing of memlens): in place, each distinct
    frame list once."""
    hidden = {(code.co_filename, code.co_name) for code in _HIDDEN_CODES}
    done: dict[int, list[Any]] = {}

    def keep(frame: Any) -> bool:
        if not isinstance(frame, dict):
            return True
        filename = frame.get("filename")
        if not isinstance(filename, str):
            return True
        return (filename, frame.get("name")) not in hidden and not filename.endswith(_HIDDEN_FILES)

    def trimmed(frames: Any) -> Any:
        if not isinstance(frames, list) or not frames:
            return frames
        cached = done.get(id(frames))
        if cached is None:
            cached = done[id(frames)] = [frame for frame in frames if keep(frame)]
        return cached

    holders: list[Any] = []
    for segment in snapshot.get("segments") or []:
        if isinstance(segment, dict):
            holders.append(segment)
            holders.extend(block for block in segment.get("blocks") or [] if isinstance(block, dict))
    for entries in snapshot.get("device_traces") or []:
        holders.extend(entry for entry in entries if isinstance(entry, dict))
    for holder in holders:
        if "frames" in holder:
            holder["frames"] = trimmed(holder["frames"])


def _is_plumbing(filename: str) -> bool:
    return filename.startswith(_HERE) or filename.endswith(_PLUMBING_FILES)


class StackCapture:
    """Captures the caller's Python stack as interned CUDA-style frame dicts.

    ``filename_map`` rewrites file names once per code object (the sample generator uses it to
    make paths relative, so regenerated files do not depend on where the repo lives).
    """

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, filename_map: Callable[[str], str] | None = None) -> None:
        self.max_depth = max_depth
        self._filename_map = filename_map
        self._frames: dict[tuple[CodeType, int], Frame] = {}
        self._stacks: dict[tuple[int, ...], list[Frame]] = {}
        self._skip_code: dict[CodeType, bool] = {}
        self._plumbing_code: dict[CodeType, bool] = {}
        self._filenames: dict[str, str] = {}

    def _frame(self, code: CodeType, line: int) -> Frame:
        key = (code, line)
        frame = self._frames.get(key)
        if frame is None:
            filename = self._filenames.get(code.co_filename)
            if filename is None:
                raw = code.co_filename
                filename = self._filename_map(raw) if self._filename_map else raw
                self._filenames[raw] = filename
            frame = {"filename": filename, "line": line, "name": code.co_name}
            self._frames[key] = frame
        return frame

    def capture(self, start: FrameType | None = None) -> list[Frame]:
        """The stack from ``start`` (default: the caller) outwards, without recorder frames."""
        frame: FrameType | None = start if start is not None else sys._getframe(1)
        skip = self._skip_code
        plumbing = self._plumbing_code
        while frame is not None:
            code = frame.f_code
            is_plumbing = plumbing.get(code)
            if is_plumbing is None:
                is_plumbing = plumbing[code] = _is_plumbing(code.co_filename)
            if not is_plumbing:
                break
            frame = frame.f_back
        ids: list[int] = []
        frames: list[Frame] = []
        depth = 0
        while frame is not None and depth < self.max_depth:
            code = frame.f_code
            skipped = skip.get(code)
            if skipped is None:
                skipped = skip[code] = _is_recorder_file(code.co_filename) or code in _HIDDEN_CODES
            if not skipped:
                interned = self._frame(code, frame.f_lineno)
                frames.append(interned)
                ids.append(id(interned))
                depth += 1
            frame = frame.f_back
        key = tuple(ids)
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = frames
        return stack

    @property
    def distinct_stacks(self) -> int:
        return len(self._stacks)


def relative_filename_map(roots: dict[str, str]) -> Callable[[str], str]:
    """A ``filename_map`` that replaces the first matching prefix (``{"/abs/repo/": ""}``)."""
    ordered = sorted(roots.items(), key=lambda item: -len(item[0]))

    def rewrite(filename: str) -> str:
        for prefix, replacement in ordered:
            if filename.startswith(prefix):
                return replacement + filename[len(prefix) :]
        return filename

    return rewrite


__all__ = [
    "DEFAULT_MAX_DEPTH",
    "StackCapture",
    "hide_frames_outward",
    "hide_launcher_frames",
    "relative_filename_map",
]
