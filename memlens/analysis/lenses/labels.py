"""Labels: a group name for every lifetime, by one of the groupings ``GROUP_BYS``.

``category`` (what the analysis says), ``annotation`` (the innermost ``record_function`` scope
open when the block was allocated), ``compile_context``, ``module`` (the recorder's module
scopes), ``file`` (file:line of the first user frame), ``frame`` (the innermost frame),
``stack`` (the stack as memlens shows it) or ``rules`` (user rules over the stack's frames,
first match wins: ``memlens.analysis.lenses.rules``). The names of the groups that are not code
(no stack, before the history, ...) are spelled once, here, for every lens and face.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memlens.analysis.datatypes import CATEGORIES
from memlens.analysis.lenses.inputs import I32, I64, LensInputs
from memlens.analysis.lenses.rules import Rule, first_rule_per_frame
from memlens.analysis.live import LiveIndex
from memlens.analysis.stacks import _CPP_NOISE, _INTERNAL_FILE, StackFacts, is_python_frame, min_per_stack
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import Annotation, Frame

GROUP_BYS = ("category", "annotation", "compile_context", "module", "file", "frame", "stack", "rules")

# Labels of the groups that are not code: one spelling each, shared by every lens.
NO_STACK = "(no stack recorded)"
BEFORE_HISTORY = "(allocated before the history)"
NO_ANNOTATION = "(no annotation)"
NO_TIMES = "(no times recorded)"
NO_COMPILE_CONTEXT = "(no compile context)"
NO_MODULE = "(no module scope)"
UNMATCHED_RULE = "other"
# Bytes the trace's allocated curve counts that no paired lifetime holds (rows lost from a
# wrapped ring buffer); negative when the lifetimes hold more than the curve. Zero on every real
# snapshot we have, but never silently dropped, so groups always sum to the allocated bytes.
UNACCOUNTED = "(unaccounted: rows missing from the history)"
# The groups that name no code: a lens whose every group is one of these found nothing of its kind.
PLACEHOLDER_GROUPS = frozenset({BEFORE_HISTORY, NO_ANNOTATION, NO_COMPILE_CONTEXT, NO_MODULE, NO_TIMES,
                                UNACCOUNTED})

# The recorder's module scopes (memlens/recorder/module_scopes.py) are ``memlens.forward#<name>``
# and ``memlens.backward#<name>``, ``<name>`` from ``named_modules()``; PyTorch's profiler spells
# its own ``nn.Module: <Class>_<n>``. A module's forward and backward are one group: its name.
MODULE_SCOPE = re.compile(r"^(?:memlens\.(?:forward|backward)#|nn\.Module: )(?P<module>.+)$")


@dataclass(frozen=True)
class Labels:
    """A label per lifetime: ``codes[i]`` indexes ``names`` for lifetime ``i``."""

    names: tuple[str, ...]
    codes: I32


def label_table(values: Sequence[str]) -> tuple[list[str], I32]:
    """Intern ``values``: the distinct names in first-seen order and each value's code."""
    seen: dict[str, int] = {}
    codes = np.fromiter((seen.setdefault(v, len(seen)) for v in values), dtype=np.int32, count=len(values))
    return list(seen), codes


def _per_stack(facts: StackFacts, label_of_stack: Callable[[list[Frame]], str]) -> tuple[list[str], I32]:
    """One label per stack id (``label_of_stack(frames)``), plus the slot for stack id -1 (no
    stack) at the end."""
    table = facts.table
    values = [label_of_stack(table.innermost(sid)) for sid in range(len(table.stacks))]
    values.append(NO_STACK)
    return label_table(values)


def _from_stacks(index: LiveIndex, names: list[str], per_stack: I32) -> Labels:
    # stack_id -1 reads the last slot: the "no stack" label.
    return Labels(tuple(names), per_stack[index.stack_id])


def user_frames(frames: list[Frame]) -> list[Frame]:
    """The frames memlens shows for a stack, innermost first, uncut: the user's Python frames
    (torch and site-packages dropped) when there are any, else every Python frame, else the
    C++ frames that are not allocator or interpreter plumbing."""
    python = [f for f in frames if is_python_frame(f)]
    user = [f for f in python if not _INTERNAL_FILE.search(f.filename)]
    return user or python or [f for f in frames if f.filename not in ("??", "") and not _CPP_NOISE.search(f.name)]


def _file_label(frames: list[Frame]) -> str:
    chosen = user_frames(frames)
    if not chosen:
        return NO_STACK
    first = chosen[0]
    return f"{first.filename}:{first.line}" if first.filename not in ("??", "") else first.name


def _frame_label(frames: list[Frame]) -> str:
    python = [f for f in frames if is_python_frame(f)]
    chosen = python or user_frames(frames)
    return str(chosen[0]) if chosen else NO_STACK


def _stack_labels(facts: StackFacts) -> tuple[list[str], I32]:
    """The stack as memlens shows it everywhere else (``frames_for_display``: the innermost user
    frames), so a group here is the same stack ``top_stacks`` and ``memlens diff`` name."""
    values = [" ← ".join(facts.frames_for_display(sid)) or NO_STACK for sid in range(len(facts.table.stacks))]
    values.append(NO_STACK)
    return label_table(values)


def _alloc_rows(index: LiveIndex) -> tuple[npt.NDArray[np.bool_], I64]:
    """Which lifetimes the history allocated, and their alloc rows (0 for the others)."""
    made = index.alloc_event >= 0
    return made, np.where(made, index.alloc_event, 0)


def _scope_labels(inputs: LensInputs, name_of_scope: Callable[[str], str | None], outside: str) -> Labels:
    """The innermost open scope (as ``name_of_scope`` names it; None: not a scope of this lens)
    at each lifetime's allocation, from ``external_annotations`` edges and the rows' times."""
    trace, index = inputs.trace, inputs.index
    made, rows = _alloc_rows(index)
    if not trace.has_time or not len(trace):
        names = [BEFORE_HISTORY, NO_TIMES]
        return Labels(tuple(names), np.where(made, 1, 0).astype(np.int32))
    change_us, change_label = _innermost_scope_timeline(inputs.annotations(), name_of_scope)
    names = [BEFORE_HISTORY, outside, *dict.fromkeys(label for label in change_label if label)]
    code_of = {name: code for code, name in enumerate(names)}
    label_codes = np.array([1] + [code_of[label] if label else 1 for label in change_label], dtype=np.int32)
    alloc_us = trace.time_us[rows]
    # An edge at the same microsecond as the row applies to it (side="right").
    position = np.searchsorted(np.asarray(change_us, dtype=np.int64), alloc_us, side="right")
    codes = np.where(made, label_codes[position], 0).astype(np.int32)
    return Labels(tuple(names), codes)


def _innermost_scope_timeline(annotations: list[Annotation],
                              name_of_scope: Callable[[str], str | None]) -> tuple[list[int], list[str]]:
    """After each START/END edge: the innermost scope still open ("" when none), as change points.

    An END closes the most recent open scope of its name, so interleaved scopes from two threads
    (or a missing END) never close the wrong one. Closing is O(1): the scope is marked closed and
    dropped once nothing opened after it is still open (a file of 250,000 unclosed STARTs followed
    by 250,000 unmatched ENDs must not cost a scan per END).
    """
    stack: list[str] = []  # scopes in the order they opened; closed ones linger until on top
    closed: list[bool] = []
    open_of_name: dict[str, list[int]] = {}  # positions in ``stack`` still open, per name
    times: list[int] = []
    labels: list[str] = []
    for ann in annotations:
        scope = name_of_scope(ann.name)
        if scope is None:
            continue
        if ann.stage == "START":
            open_of_name.setdefault(scope, []).append(len(stack))
            stack.append(scope)
            closed.append(False)
        elif ann.stage == "END":
            positions = open_of_name.get(scope)
            if positions:
                closed[positions.pop()] = True
                while stack and closed[-1]:
                    stack.pop()
                    closed.pop()
        else:
            continue
        times.append(ann.time_us)
        labels.append(stack[-1] if stack else "")
    return times, labels


def _module_of_scope(name: str) -> str | None:
    match = MODULE_SCOPE.match(name)
    return match.group("module") if match else None


def _compile_context_labels(inputs: LensInputs) -> Labels:
    """The alloc row's ``compile_context`` (torch.compile's frame and graph, where recorded)."""
    trace, index = inputs.trace, inputs.index
    made, rows = _alloc_rows(index)
    # Slot 0: allocated before the history; 1: a row without context (id -1); 2 + id: the text.
    # Interned again because the reader shortens long texts, so two ids can read the same.
    names, code_of_slot = label_table([BEFORE_HISTORY, NO_COMPILE_CONTEXT, *trace.compile_context])
    if not len(trace.context_id):
        return Labels(tuple(names), code_of_slot[np.where(made, 1, 0)])
    slot = np.where(made, trace.context_id[rows].astype(np.int64) + 2, 0)
    return Labels(tuple(names), code_of_slot[slot])


def _rule_labels(facts: StackFacts, rules: Sequence[Rule], index: LiveIndex) -> Labels:
    table = facts.table
    # A rule may itself be called "other": its stacks and the unmatched ones are then one group.
    names = list(dict.fromkeys([*(r.name for r in rules), UNMATCHED_RULE]))
    position = {name: k for k, name in enumerate(names)}
    # Rule index -> group; "no rule" (len(rules)) -> other.
    group_of_rule = np.array([position[r.name] for r in rules] + [position[UNMATCHED_RULE]], dtype=np.int32)
    first_rule = first_rule_per_frame(rules, [str(f) for f in table.frames])
    # Earlier rules win: per stack, the smallest rule index any of its frames matches.
    per_stack = group_of_rule[min_per_stack(table, first_rule, len(rules))]
    return Labels(tuple(names), per_stack[index.stack_id])


def labels_for(inputs: LensInputs, group_by: str, rules: Sequence[Rule] = ()) -> Labels:
    """A group label for every lifetime of ``inputs.index``, by ``group_by`` (one of GROUP_BYS)."""
    index = inputs.index
    if group_by == "category":
        return Labels(CATEGORIES, index.category.astype(np.int32))
    if group_by == "annotation":
        return _scope_labels(inputs, lambda name: name, NO_ANNOTATION)
    if group_by == "module":
        return _scope_labels(inputs, _module_of_scope, NO_MODULE)
    if group_by == "compile_context":
        return _compile_context_labels(inputs)
    if group_by == "file":
        return _from_stacks(index, *_per_stack(inputs.facts, _file_label))
    if group_by == "frame":
        return _from_stacks(index, *_per_stack(inputs.facts, _frame_label))
    if group_by == "stack":
        return _from_stacks(index, *_stack_labels(inputs.facts))
    if group_by == "rules":
        if not rules:
            raise MemlensUsageError("grouping by rules needs at least one rule (a rules file)")
        return _rule_labels(inputs.facts, rules, index)
    raise MemlensUsageError(f"unknown grouping {group_by!r} (use {', '.join(GROUP_BYS)})")
