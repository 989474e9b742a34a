"""Lenses: what was live at any moment, grouped any way, and per line of one source file.

Every function here is stateless and takes its inputs explicitly (``LensInputs``: the snapshot,
one device's trace, the per-allocation ``LiveIndex`` that ``analyze`` builds, the steps), so the
CLI, the dashboard and the agent interface call the same code and get plain data back.

- ``group_live(inputs, group_by, event)``: the blocks live after trace row ``event``, grouped by
  ``category``, ``annotation`` (the innermost ``record_function`` scope open when the block was
  allocated), ``compile_context``, ``module`` (the recorder's module scopes), ``file`` (file:line
  of the first user frame), ``frame`` (the innermost frame), ``stack`` (the stack as memlens shows
  it) or ``rules`` (user regular expressions over the stack's frames, first match wins). The
  groups add up exactly to ``DeviceTrace.allocated`` at that row: bytes the lifetimes cannot
  account for (a history that lost rows) are a group of their own, never dropped.
- ``resolve_moment(inputs, at=..., window=..., step=...)``: ``--at EVENT|TIMEus|stepN``,
  ``--window A:B``, ``--step N`` turned into one trace row (a window's peak).
- ``annotation_stages(inputs)``: how much each ``record_function`` scope added while it ran
  (allocated at its END minus at its START) and its peak inside.
- ``file_lines(inputs, path, event)`` and ``diff_file_lines(before, after, path)``: bytes by line
  of one source file, and their growth between two snapshots.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from memlens.analysis.context import build_context
from memlens.analysis.datatypes import CATEGORIES, Step, busiest_first
from memlens.analysis.live import BEFORE_FIRST_ROW, LiveIndex
from memlens.analysis.settings import AnalysisSettings
from memlens.analysis.stacks import _CPP_NOISE, _INTERNAL_FILE, StackFacts, is_python_frame, min_per_stack
from memlens.errors import MemlensUsageError
from memlens.files import FileRefused, OpenedFile, open_regular
from memlens.snapshot.model import Annotation, DeviceTrace, Frame, Snapshot
from memlens.units import MAX_NUMBER_CHARS, parse_whole, shown

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]

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

# The recorder's module scopes (memlens/recorder/module_scopes.py) are ``memlens.forward#<name>``
# and ``memlens.backward#<name>``, ``<name>`` from ``named_modules()``; PyTorch's profiler spells
# its own ``nn.Module: <Class>_<n>``. A module's forward and backward are one group: its name.
MODULE_SCOPE = re.compile(r"^(?:memlens\.(?:forward|backward)#|nn\.Module: )(?P<module>.+)$")

TIME_UNITS_US = {"us": 1, "ms": 1_000, "s": 1_000_000}
MAX_MOMENT = (1 << 62) - 1  # an event index, a step or µs: beyond it, no trace (int64 columns) reaches


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class LensInputs:
    """What every lens reads: one device of a loaded snapshot and its per-allocation index."""

    snapshot: Snapshot
    trace: DeviceTrace
    index: LiveIndex
    steps: tuple[Step, ...] = ()

    @property
    def facts(self) -> StackFacts:
        return self.index.facts

    @property
    def device(self) -> int:
        return self.trace.device


class _HasSteps(Protocol):
    @property
    def steps(self) -> list[Step]: ...


class AnalysisLike(Protocol):
    """What the lenses read of a ``memlens.analysis.Analysis`` (snapshot, trace, index, steps)."""

    @property
    def snapshot(self) -> Snapshot: ...

    def trace(self, device: int | None = None) -> DeviceTrace: ...

    def live_index(self, device: int | None = None) -> LiveIndex: ...

    def device(self, device: int | None = None) -> _HasSteps: ...


def lens_inputs_of(analysis: AnalysisLike, device: int | None = None) -> LensInputs:
    """The lens inputs of one device of an ``Analysis`` (what ``analyze`` already built)."""
    return LensInputs(analysis.snapshot, analysis.trace(device), analysis.live_index(device),
                      tuple(analysis.device(device).steps))


def busiest_device(snapshot: Snapshot) -> int | None:
    """The device a report details by default (``Report.device(None)``): the highest allocated
    peak, then reserved peak, then the most events. ``None`` when the snapshot has no device."""
    def weight(trace: DeviceTrace) -> tuple[int, int, int, int]:
        allocated = max(trace.baseline_allocated, int(trace.allocated.max()) if len(trace) else 0)
        reserved = max(trace.baseline_reserved, int(trace.reserved.max()) if len(trace) else 0)
        return busiest_first(allocated, reserved, len(trace), trace.device)

    traces = list(snapshot.devices.values())
    return max(traces, key=weight).device if traces else None


def lens_inputs(snapshot: Snapshot, device: int | None = None, top_stacks: int | None = None) -> LensInputs:
    """Build the lens inputs for ``device`` (default: the one a report details, ``busiest_device``)
    from a loaded snapshot, with the lifetimes, categories and steps ``analyze`` computes (no
    finders run)."""
    settings = AnalysisSettings.from_kwargs(device=device, top_stacks=top_stacks)
    trace = snapshot.device(busiest_device(snapshot) if device is None else device)
    ctx = build_context(snapshot, trace, settings)
    index = LiveIndex.build(ctx.lifetimes, ctx.category, ctx.facts, settings.top_stacks)
    return LensInputs(snapshot, trace, index, tuple(ctx.steps))


# --------------------------------------------------------------------------- exact sums


def exact_bincount(codes: npt.NDArray[np.integer[Any]], sizes: I64, length: int) -> I64:
    """Bytes summed per code, exactly, as int64.

    ``np.bincount`` sums weights in float64, which rounds above 2**53 bytes in all. Splitting each
    size into its high and low 26 bits keeps both partial sums exact (the reader refuses files
    holding more than 2**56 bytes, and the low parts stay exact below 2**27 blocks).
    """
    low = np.bincount(codes, weights=(sizes & ((1 << 26) - 1)).astype(np.float64), minlength=length)
    high = np.bincount(codes, weights=(sizes >> 26).astype(np.float64), minlength=length)
    return (high.astype(np.int64) << 26) + low.astype(np.int64)


def allocated_at(trace: DeviceTrace, event: int | None) -> int:
    """``torch.cuda.memory_allocated`` after row ``event`` (-1: when the history began; None: a
    trace without rows, i.e. the dump)."""
    if event is None or event < 0:
        return trace.baseline_allocated
    return int(trace.allocated[event])


# --------------------------------------------------------------------------- labels


@dataclass(frozen=True)
class Labels:
    """A label per lifetime: ``codes[i]`` indexes ``names`` for lifetime ``i``."""

    names: tuple[str, ...]
    codes: I32


def _label_table(values: Sequence[str]) -> tuple[list[str], I32]:
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
    return _label_table(values)


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
    return _label_table(values)


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
    change_us, change_label = _innermost_scope_timeline(_device_annotations(inputs), name_of_scope)
    names = [BEFORE_HISTORY, outside, *dict.fromkeys(label for label in change_label if label)]
    code_of = {name: code for code, name in enumerate(names)}
    label_codes = np.array([1] + [code_of[label] if label else 1 for label in change_label], dtype=np.int32)
    alloc_us = trace.time_us[rows]
    # An edge at the same microsecond as the row applies to it (side="right").
    position = np.searchsorted(np.asarray(change_us, dtype=np.int64), alloc_us, side="right")
    codes = np.where(made, label_codes[position], 0).astype(np.int32)
    return Labels(tuple(names), codes)


def _device_annotations(inputs: LensInputs) -> list[Annotation]:
    device = inputs.device
    return sorted((a for a in inputs.snapshot.annotations if a.device == device or a.device < 0),
                  key=lambda a: a.time_us)


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
    names, code_of_slot = _label_table([BEFORE_HISTORY, NO_COMPILE_CONTEXT, *trace.compile_context])
    if not len(trace.context_id):
        return Labels(tuple(names), code_of_slot[np.where(made, 1, 0)])
    slot = np.where(made, trace.context_id[rows].astype(np.int64) + 2, 0)
    return Labels(tuple(names), code_of_slot[slot])


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
            raise MemlensUsageError("--group-by rules needs a rules file (--rules FILE)")
        return _rule_labels(inputs.facts, rules, index)
    raise MemlensUsageError(f"unknown grouping {group_by!r} (use {', '.join(GROUP_BYS)})")


# --------------------------------------------------------------------------- rules

# Rules are a stranger's input too (``--rules``, the MCP server's ``rules`` argument): they are
# matched with RE2, whose time is linear in the text (``(a+)+$`` cannot backtrack), all rules
# at once through an ``re2.Set``, so 5,000 rules cost one pass over each distinct frame. What
# RE2 cannot do (backreferences, lookaround) is refused, never handed to Python's ``re``.
MAX_RULES_FILE_BYTES = 1 << 20
MAX_RULES = 10_000
MAX_PATTERN_CHARS = 10_000
# RE2's memory for one compiled pattern and for the set of all of them (its default is 8 MiB).
_RE2_PATTERN_MEMORY = 8 << 20
_RE2_SET_MEMORY = 256 << 20


class RulePattern(Protocol):
    def search(self, text: str | bytes) -> Any: ...


@dataclass(frozen=True)
class Rule:
    """A user rule: a stack any of whose frames (``name (file:line)``) matches ``pattern`` is ``name``."""

    name: str
    pattern: RulePattern  # an RE2 pattern (``re2.compile``)
    source: str = ""  # the pattern's text, as the rules file wrote it


def _re2() -> Any:
    try:
        import re2
    except ImportError:  # pragma: no cover - google-re2 is a dependency; a broken install lands here
        raise MemlensUsageError("rules need the google-re2 package (pip install google-re2): memlens matches "
                                "rules with RE2 so that no pattern can take exponential time") from None
    return re2


def _re2_options(memory: int) -> Any:
    options = _re2().Options()
    options.log_errors = False  # RE2 would print its own line to stderr for every bad pattern
    options.max_mem = memory
    return options


# A counted repetition (not after a backslash). RE2 refuses counts over 1,000 but reads one too
# large for an int (``a{4294967295}``) as literal text, where Python's re would mean a count.
_REPETITION = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_MAX_REPEAT = 1000


def _compile_rule(pattern: str, source: str, position: int, name: str) -> RulePattern:
    re2 = _re2()
    where = f"{source}: rule {position} ({name[:80]})"
    if len(pattern) > MAX_PATTERN_CHARS:
        raise MemlensUsageError(f"{where}: the pattern is {len(pattern):,} characters (at most "
                                f"{MAX_PATTERN_CHARS:,})")
    for repeat in _REPETITION.finditer(pattern):
        if any((count and len(count) > 4) or (count and int(count) > _MAX_REPEAT) for count in repeat.groups()):
            raise MemlensUsageError(f"{where}: bad regular expression {shorten_pattern(pattern)}: the "
                                    f"repetition {repeat.group()[:40]} counts over {_MAX_REPEAT:,} (RE2's limit)")
    try:
        compiled: RulePattern = re2.compile(pattern, _re2_options(_RE2_PATTERN_MEMORY))
        return compiled
    except (re2.error, ValueError, OverflowError, TypeError) as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise MemlensUsageError(f"{where}: bad regular expression {shorten_pattern(pattern)}: {reason} "
                                "(rules are RE2 syntax: no backreferences or lookaround)") from None


def shorten_pattern(pattern: str, limit: int = 120) -> str:
    shown = repr(pattern)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def parse_rules(data: Any, source: str = "rules") -> list[Rule]:
    """Rules from parsed JSON or TOML, in file order (at most ``MAX_RULES``, each an RE2 pattern).

    Accepted shapes: ``{"rules": [{"name": ..., "pattern": ...}, ...]}`` (TOML: ``[[rules]]``
    tables), a bare JSON list of such objects, or ``{"rules": {"name": "pattern", ...}}``.
    """
    entries: Any = data.get("rules") if isinstance(data, dict) else data
    if isinstance(entries, dict):
        entries = [{"name": k, "pattern": v} for k, v in entries.items()]
    if not isinstance(entries, list) or not entries:
        raise MemlensUsageError(f"{source}: expected a non-empty list of rules under 'rules', "
                                "each with a 'name' and a 'pattern'")
    if len(entries) > MAX_RULES:
        raise MemlensUsageError(f"{source}: {len(entries):,} rules (at most {MAX_RULES:,})")
    rules = []
    for position, entry in enumerate(entries, 1):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not isinstance(entry.get("pattern"), str) or not entry["name"].strip():
            raise MemlensUsageError(f"{source}: rule {position} needs a 'name' and a 'pattern', both text")
        name = entry["name"].strip()
        rules.append(Rule(name, _compile_rule(entry["pattern"], source, position, name), entry["pattern"]))
    return rules


def _read_rules_file(path: Path) -> str:
    """The text of a rules file: a regular file of at most MAX_RULES_FILE_BYTES, opened once
    without blocking (a FIFO would wait for a writer forever) and checked on the descriptor."""
    try:
        with open_regular(path, max_bytes=MAX_RULES_FILE_BYTES) as opened:
            return rules_text(opened)
    except FileRefused as refused:
        raise MemlensUsageError(f"{path}: cannot read the rules file: {refused.reason}") from None


def rules_text(opened: OpenedFile) -> str:
    """The text of a rules file already opened and checked (the CLI's path, or ``memlens mcp``'s
    file beneath its root)."""
    try:
        return opened.read_bytes(MAX_RULES_FILE_BYTES).decode("utf-8")
    except FileRefused as refused:  # it grew past the limit after it was opened
        raise MemlensUsageError(f"{opened.name}: cannot read the rules file: {refused.reason}") from None
    except UnicodeDecodeError as exc:
        raise MemlensUsageError(f"{opened.name}: cannot read the rules file: not UTF-8 ({exc.reason})") from None


def load_rules(path: str | Path) -> list[Rule]:
    """Rules from a ``.json`` or ``.toml`` file (by suffix; anything else is tried as JSON, then TOML)."""
    path = Path(path)
    return rules_from_text(_read_rules_file(path), str(path))


def rules_from_text(text: str, name: str) -> list[Rule]:
    """Rules from the text of a rules file called ``name`` (JSON or TOML by its suffix; anything
    else is tried as JSON, then TOML): for a file already read, such as one ``memlens mcp``
    opened beneath its root."""
    path = Path(name)
    parsers = {".json": ("json",), ".toml": ("toml",)}.get(path.suffix.lower(), ("json", "toml"))
    errors = []
    for kind in parsers:
        try:
            data = json.loads(text) if kind == "json" else _toml_loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            errors.append(f"not {kind.upper()} ({str(exc)[:200]})")
            continue
        return parse_rules(data, str(path))
    raise MemlensUsageError(f"{path}: {'; '.join(errors)}")


def _toml_loads(text: str) -> Any:
    import importlib

    # tomllib is Python 3.11+; on 3.10 tomli (the same parser) serves, when installed.
    for name in ("tomllib", "tomli"):
        try:
            return importlib.import_module(name).loads(text)
        except ImportError:
            continue
    raise MemlensUsageError("TOML rules files need Python 3.11 or the tomli package; write the rules as JSON")


def first_rule_per_frame(rules: Sequence[Rule], texts: Sequence[str]) -> I32:
    """For each text, the index of the first rule whose pattern it matches (``len(rules)``: none).

    One ``re2.Set`` holds every pattern: each text is scanned once, whatever the number of rules.
    The set's last pattern is empty, so it matches every text: a text it does not report was not
    matched (RE2's DFA ran out of memory and said nothing), and is searched rule by rule instead,
    each still in linear time."""
    re2 = _re2()
    patterns = re2.Set.SearchSet(_re2_options(_RE2_SET_MEMORY))
    for rule in rules:
        patterns.Add(rule.source)
    always = patterns.Add("")
    try:
        patterns.Compile()
    except re2.error:
        raise MemlensUsageError(f"the {len(rules):,} rules together are too large for RE2 to match at once "
                                "(fewer or simpler patterns)") from None
    none = len(rules)
    out = np.full(len(texts), none, dtype=np.int32)
    match = patterns.Match
    for k, text in enumerate(texts):
        # A pickle's str may hold a lone surrogate, which UTF-8 cannot: it is matched as its bytes.
        encoded = text.encode("utf-8", "surrogatepass")
        hits = match(encoded) or ()
        if always not in hits:  # the set failed on this text: one rule at a time, in order
            out[k] = next((i for i, rule in enumerate(rules) if rule.pattern.search(encoded)), none)
            continue
        out[k] = min(hits)  # ``always`` is len(rules): "none" when it is the only hit
    return out


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


# --------------------------------------------------------------------------- group at a moment


@dataclass(frozen=True)
class Group:
    name: str
    bytes: int
    blocks: int

    def to_json(self, total: int) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "share": self.bytes / total if total else 0.0,
                "blocks": self.blocks}


@dataclass(frozen=True)
class Moment:
    """One trace row to look at, and how it was chosen (for labels and the JSON)."""

    event: int | None  # -1: when the history began; None: a trace without rows (the dump)
    how: str  # "peak", "event", "time", "step", "window"
    text: str  # as people read it: "the peak", "event 1,234", "the peak of step 3", ...
    window: tuple[int, int] | None = None  # [first, last] rows searched for a peak

    def to_json(self, time_us: int | None) -> dict[str, Any]:
        return {"event": self.event, "how": self.how, "text": self.text,
                "window": list(self.window) if self.window else None, "time_us": time_us}


@dataclass(frozen=True)
class GroupBreakdown:
    """The blocks live at one moment of one device, grouped; ``sum(g.bytes) == allocated_bytes``."""

    group_by: str
    device: int
    moment: Moment
    time_us: int | None
    allocated_bytes: int
    groups: list[Group]

    def to_json(self) -> dict[str, Any]:
        return {
            "group_by": self.group_by,
            "device": self.device,
            "moment": self.moment.to_json(self.time_us),
            "allocated_bytes": self.allocated_bytes,
            "groups": [g.to_json(self.allocated_bytes) for g in self.groups],
        }


def time_of(trace: DeviceTrace, event: int | None) -> int | None:
    if event is None or event < 0 or not trace.has_time or not len(trace):
        return None
    return int(trace.time_us[event])


def group_labels_at(inputs: LensInputs, labels: Labels, event: int | None, group_by: str,
                    moment: Moment | None = None) -> GroupBreakdown:
    """Sum the lifetimes live after ``event`` by ``labels`` (reuse one ``Labels`` for many moments).

    ``event=None`` is the allocated peak (as ``live_at``): on a trace with rows the peak row, on
    one without rows the dump."""
    index, trace = inputs.index, inputs.trace
    if event is None:
        event = whole_peak(trace)
    live = index.live_mask(event)
    codes = labels.codes[live]
    sizes = index.size[live]
    length = len(labels.names)
    totals = exact_bincount(codes, sizes, length)
    counts = np.bincount(codes, minlength=length)
    allocated = allocated_at(trace, event)
    groups = [Group(labels.names[c], int(totals[c]), int(counts[c])) for c in np.flatnonzero(counts)]
    residual = allocated - int(totals.sum())
    if residual:
        # Categories already have a name for bytes no one can place: ``breakdown`` puts a positive
        # gap in "unknown", and so does this (so group_by="category" is categories_at_peak).
        if group_by == "category" and residual > 0:
            groups = [Group(g.name, g.bytes + residual, g.blocks) if g.name == "unknown" else g for g in groups]
            if not any(g.name == "unknown" for g in groups):
                groups.append(Group("unknown", residual, 0))
        else:
            groups.append(Group(UNACCOUNTED, residual, 0))
    groups.sort(key=lambda g: (-g.bytes, g.name))
    moment = moment or Moment(event, "event", _event_text(event))
    return GroupBreakdown(group_by, trace.device, moment, time_of(trace, event), allocated, groups)


def group_live(inputs: LensInputs, group_by: str, event: int | None = None, rules: Sequence[Rule] = (),
               moment: Moment | None = None) -> GroupBreakdown:
    """The blocks live after row ``event`` (``None``: the peak) grouped by ``group_by`` (see the
    module docstring)."""
    return group_labels_at(inputs, labels_for(inputs, group_by, rules), event, group_by, moment)


# --------------------------------------------------------------------------- moments


@dataclass(frozen=True)
class Point:
    """One end of a moment as typed: an event index, a time in µs, or a step."""

    kind: str  # "event", "time", "step"
    value: int
    relative: bool = False  # a time counted from the first row ("+1.5s")

    @property
    def text(self) -> str:
        if self.kind == "event":
            return f"event {self.value:,}"
        if self.kind == "step":
            return f"step {self.value}"
        return f"{'+' if self.relative else ''}{self.value:,} µs"


_TIME = re.compile(r"^(?P<plus>\+)?(?P<number>\d+(?:\.\d*)?)(?P<unit>us|µs|ms|s)$")


def parse_point(text: str) -> Point:
    """``1234`` (an event), ``1234567us`` (the trace's own clock; ``ms``/``s`` too), ``+1.5s``
    (since the first row), ``step3``."""
    raw = text.strip().lower().replace(" ", "")
    what = f"the moment {shown(text)}"
    if len(raw) > MAX_NUMBER_CHARS:  # no moment is a 5,000-digit number
        raise MemlensUsageError(f"{what} is {len(raw):,} characters long: not an event, a time or a step")
    if re.fullmatch(r"\d+", raw):
        return Point("event", parse_whole(raw, what, 0, MAX_MOMENT))
    step = re.fullmatch(r"step#?(\d+)", raw)
    if step:
        return Point("step", parse_whole(step.group(1), what, 0, MAX_MOMENT))
    time = _TIME.match(raw)
    if time:
        unit = time.group("unit").replace("µs", "us")
        micros = Decimal(time.group("number")) * TIME_UNITS_US[unit]  # exact: no float overflow
        if micros > MAX_MOMENT:
            raise MemlensUsageError(f"{what} is later than any trace's clock (at most {MAX_MOMENT:,} µs)")
        value = int(micros.to_integral_value(rounding=ROUND_HALF_EVEN))
        return Point("time", value, relative=bool(time.group("plus")))
    raise MemlensUsageError(f"cannot read the moment {text!r}: use an event index (1234), a time "
                            "(1234567us, +1.5s since the first row) or a step (step3)")


def _event_text(event: int | None) -> str:
    if event is None:
        return "the dump (no trace rows)"
    if event < 0:
        return "when the history began"
    return f"event {event:,}"


def _times(trace: DeviceTrace) -> I64:
    if not trace.has_time:
        raise MemlensUsageError(f"device {trace.device}'s trace has no times: give an event index or a step")
    # Clocks of different streams can step back a little; searches need a sorted array.
    return np.maximum.accumulate(trace.time_us)


def _absolute_us(trace: DeviceTrace, point: Point) -> int:
    return point.value + int(_times(trace)[0]) if point.relative else point.value


def _step(inputs: LensInputs, number: int) -> Step:
    for step in inputs.steps:
        if step.index == number:
            if step.end_event <= step.start_event:
                raise MemlensUsageError(f"step {number} has no trace rows")
            return step
    known = ", ".join(str(s.index) for s in inputs.steps[:20])
    more = ", …" if len(inputs.steps) > 20 else ""
    raise MemlensUsageError(f"no step {number} on device {inputs.device} "
                            f"({'steps: ' + known + more if known else 'no steps were found'})")


def _check_event(trace: DeviceTrace, event: int) -> int:
    if not 0 <= event < len(trace):
        span = f"0..{len(trace) - 1}" if len(trace) else "it has no rows"
        raise MemlensUsageError(f"event {event:,} is outside the trace of device {trace.device} ({span})")
    return event


def _first_row(inputs: LensInputs, point: Point) -> int:
    """The first row a window starting at ``point`` covers."""
    trace = inputs.trace
    if point.kind == "event":
        return _check_event(trace, point.value)
    if point.kind == "step":
        return _step(inputs, point.value).start_event
    return int(np.searchsorted(_times(trace), _absolute_us(trace, point), side="left"))


def _last_row(inputs: LensInputs, point: Point) -> int:
    """The last row a window ending at ``point`` covers (-1: before the first row)."""
    trace = inputs.trace
    if point.kind == "event":
        return _check_event(trace, point.value)
    if point.kind == "step":
        return _step(inputs, point.value).end_event - 1
    return int(np.searchsorted(_times(trace), _absolute_us(trace, point), side="right")) - 1


def peak_in(trace: DeviceTrace, first: int, last: int) -> int:
    """The row with the most allocated in ``[first, last]`` (the first such row on ties)."""
    return first + int(np.argmax(trace.allocated[first:last + 1]))


def whole_peak(trace: DeviceTrace) -> int | None:
    """The allocated peak as ``analyze`` finds it (-1 when the history began at it; None: no rows)."""
    if not len(trace):
        return None
    event = int(np.argmax(trace.allocated))
    return event if int(trace.allocated[event]) >= trace.baseline_allocated else BEFORE_FIRST_ROW


def resolve_moment(inputs: LensInputs, at: str | None = None, window: str | None = None,
                   step: int | None = None) -> Moment:
    """The row ``--at``, ``--window`` or ``--step`` names (at most one of them; none: the peak)."""
    given = [name for name, value in (("--at", at), ("--window", window), ("--step", step)) if value is not None]
    if len(given) > 1:
        raise MemlensUsageError(f"give one of --at, --window and --step, not {' and '.join(given)}")
    trace = inputs.trace
    if at is not None:
        point = parse_point(at)
        if point.kind == "event":
            return Moment(_check_event(trace, point.value), "event", point.text)
        if point.kind == "step":
            chosen = _step(inputs, point.value)
            first, last = chosen.start_event, chosen.end_event - 1
            return Moment(peak_in(trace, first, last), "step", f"the peak of step {point.value}", (first, last))
        # A time: what was live then, i.e. after the last row at or before it.
        event = _last_row(inputs, point)
        return Moment(event, "time", f"{point.text} ({_event_text(event)})")
    if step is not None:
        chosen = _step(inputs, step)
        first, last = chosen.start_event, chosen.end_event - 1
        return Moment(peak_in(trace, first, last), "step", f"the peak of step {step}", (first, last))
    if window is not None:
        start_text, sep, end_text = window.partition(":")
        if not sep:
            raise MemlensUsageError(f"cannot read the window {window!r}: use A:B (events, times or steps; "
                                    "either side may be left out)")
        if not len(trace):
            raise MemlensUsageError(f"device {trace.device} has no trace rows to take a window of")
        first = _first_row(inputs, parse_point(start_text)) if start_text.strip() else 0
        last = _last_row(inputs, parse_point(end_text)) if end_text.strip() else len(trace) - 1
        if last < first:
            raise MemlensUsageError(f"the window {window!r} holds no trace rows")
        return Moment(peak_in(trace, first, last), "window", f"the peak of the window {window.strip()}",
                      (first, last))
    return Moment(whole_peak(trace), "peak", "the peak")


# --------------------------------------------------------------------------- annotation stages


@dataclass(frozen=True)
class Stage:
    """One run of a ``record_function`` scope: what was allocated when it began and ended."""

    name: str
    start_us: int
    end_us: int
    start_event: int  # the last row before the scope began (-1: before the first row)
    end_event: int  # the last row at or before its END
    bytes_at_start: int
    bytes_at_end: int
    peak_bytes: int
    peak_event: int

    @property
    def added_bytes(self) -> int:
        return self.bytes_at_end - self.bytes_at_start

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "start_us": self.start_us, "end_us": self.end_us,
                "start_event": self.start_event, "end_event": self.end_event,
                "bytes_at_start": self.bytes_at_start, "bytes_at_end": self.bytes_at_end,
                "added_bytes": self.added_bytes, "peak_bytes": self.peak_bytes, "peak_event": self.peak_event}


@dataclass(frozen=True)
class StageRuns:
    """Every run of every scope on one device, as columns (module scopes make hundreds of
    thousands of runs: objects are made only for the runs someone reads). Oldest first."""

    names: tuple[str, ...]  # distinct scope names
    name_code: I64  # per run: index into names
    start_us: I64
    end_us: I64
    start_event: I64
    end_event: I64
    bytes_at_start: I64
    bytes_at_end: I64
    peak_bytes: I64
    peak_event: I64

    def __len__(self) -> int:
        return int(self.name_code.size)

    def __getitem__(self, i: int) -> Stage:
        return Stage(self.names[int(self.name_code[i])], int(self.start_us[i]), int(self.end_us[i]),
                     int(self.start_event[i]), int(self.end_event[i]), int(self.bytes_at_start[i]),
                     int(self.bytes_at_end[i]), int(self.peak_bytes[i]), int(self.peak_event[i]))

    def __iter__(self) -> Iterator[Stage]:
        return (self[i] for i in range(len(self)))

    def to_json(self) -> list[dict[str, Any]]:
        return [stage.to_json() for stage in self]

    @classmethod
    def empty(cls) -> StageRuns:
        none = np.zeros(0, dtype=np.int64)
        return cls((), none, none, none, none, none, none, none, none, none)


@dataclass(frozen=True)
class StageSummary:
    """Every run of one scope name together."""

    name: str
    runs: int
    added_bytes: int  # summed over the runs
    max_added_bytes: int
    peak_bytes: int  # the highest peak inside any run

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "runs": self.runs, "added_bytes": self.added_bytes,
                "max_added_bytes": self.max_added_bytes, "peak_bytes": self.peak_bytes}


def _levels(trace: DeviceTrace, rows: I64) -> I64:
    """``allocated_at`` for many rows at once (-1: when the history began)."""
    return np.where(rows >= 0, trace.allocated[np.maximum(rows, 0)], trace.baseline_allocated)


def interval_peaks(values: I64, first: I64, last: I64) -> tuple[I64, I64]:
    """For many row ranges ``[first[i], last[i]]`` at once: the largest value in each, and the
    first row holding it. Empty ranges (``last < first``) give the int64 minimum and row -1.

    Module scopes make hundreds of thousands of ranges, nested, and a hostile file can make every
    one of them span the whole trace, so neither a loop of ``argmax`` nor a sum over the ranges'
    rows will do: a segment tree of each node's first maximal row (built level by level) answers
    every range in about 2 log2(n) vectorised steps, O((n + ranges) log n) in all.
    """
    count = first.size
    peak = np.full(count, np.iinfo(np.int64).min, dtype=np.int64)
    row = np.full(count, -1, dtype=np.int64)
    n = values.size
    if not count or not n:
        return peak, row
    size = 1 << max(int(n - 1).bit_length(), 0)
    lowest = np.iinfo(np.int64).min
    padded = np.full(size + 1, lowest, dtype=np.int64)  # slot ``size``: the padding leaves' row
    padded[:n] = values
    # best[node]: the first row holding the maximum under that node; leaves are their own rows.
    best = np.full(2 * size, size, dtype=np.int64)
    best[size:size + n] = np.arange(n, dtype=np.int64)
    for level_start in (1 << k for k in range(max(size.bit_length() - 2, -1), -1, -1)):
        nodes = np.arange(level_start, 2 * level_start)
        left, right = best[2 * nodes], best[2 * nodes + 1]
        best[nodes] = np.where(padded[left] >= padded[right], left, right)  # ties: the left (earlier)
    # Ranges as half-open node bounds; each step takes the odd left node / even right node.
    lo = np.where(last >= first, first, 0).astype(np.int64) + size
    hi = np.where(last >= first, last + 1, first).astype(np.int64) + size
    hi[last < first] = lo[last < first]  # empty: no node is ever taken
    found = np.full(count, size, dtype=np.int64)  # the padding row: value lowest

    def take(candidate_nodes: I64, where: npt.NDArray[np.bool_]) -> None:
        candidate = best[candidate_nodes[where]]
        current = found[where]
        better = (padded[candidate] > padded[current]) | (
            (padded[candidate] == padded[current]) & (candidate < current))
        found[where] = np.where(better, candidate, current)

    while True:
        active = lo < hi
        if not active.any():
            break
        from_left = active & (lo & 1 == 1)
        take(lo, from_left)
        lo = lo + from_left
        from_right = active & (hi & 1 == 1)
        hi = hi - from_right
        take(hi, from_right)
        lo >>= 1
        hi >>= 1
    nonempty = last >= first
    row[nonempty] = found[nonempty]
    peak[nonempty] = padded[found[nonempty]]
    return peak, row


def _scope_pairs(annotations: list[Annotation]) -> tuple[list[str], list[int], list[int]]:
    """(name, start, end) of each START/END pair: an END closes the latest open scope of its name."""
    open_scopes: dict[str, list[int]] = {}
    names: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    for ann in annotations:
        if ann.stage == "START":
            opened = open_scopes.get(ann.name)
            if opened is None:
                open_scopes[ann.name] = [ann.time_us]
            else:
                opened.append(ann.time_us)
        elif ann.stage == "END":
            opened = open_scopes.get(ann.name)
            if opened:
                names.append(ann.name)
                starts.append(opened.pop())
                ends.append(ann.time_us)
    return names, starts, ends


def annotation_stages(inputs: LensInputs) -> StageRuns:
    """Each complete START/END pair of ``external_annotations`` on this device, oldest first:
    allocated when it began and ended, and the peak inside (the level it began at included)."""
    trace = inputs.trace
    if not trace.has_time or not len(trace):
        return StageRuns.empty()
    pair_names, pair_starts, pair_ends = _scope_pairs(_device_annotations(inputs))
    if not pair_names:
        return StageRuns.empty()
    names, codes = _label_table(pair_names)
    starts = np.array(pair_starts, dtype=np.int64)
    ends = np.array(pair_ends, dtype=np.int64)
    order = np.lexsort((ends, starts))
    name_code, starts, ends = codes[order].astype(np.int64), starts[order], ends[order]
    times = _times(trace)
    before = np.searchsorted(times, starts, side="left") - 1  # the state the scope began in
    last = np.maximum(np.searchsorted(times, ends, side="right") - 1, before)  # an END before its START: empty
    at_start, at_end = _levels(trace, before), _levels(trace, last)
    inside_peak, inside_row = interval_peaks(trace.allocated, before + 1, last)
    from_start = at_start >= inside_peak
    return StageRuns(tuple(names), name_code, starts, ends, before, last, at_start, at_end,
                     np.where(from_start, at_start, inside_peak), np.where(from_start, before, inside_row))


# Step markers carry the step's number (``memlens.step#3``, ``ProfilerStep#3``): one stage name for
# all steps. Only these: a module scope's number is part of its name (``memlens.forward#0``).
_NUMBERED_STEP = re.compile(r"^(memlens\.step|ProfilerStep)#\d+$")


def stage_name(name: str) -> str:
    """The name a stage is summarised under: step markers lose their number (``memlens.step#N``)."""
    match = _NUMBERED_STEP.match(name)
    return f"{match.group(1)}#N" if match else name


def summarize_stages(runs: StageRuns) -> list[StageSummary]:
    """Per scope name (steps together: ``stage_name``): runs, bytes added in all and at most, and
    the highest peak; most added first."""
    if not len(runs):
        return []
    summary_names, summary_of_name = _label_table([stage_name(n) for n in runs.names])
    code = summary_of_name[runs.name_code]
    count = len(summary_names)
    added = runs.bytes_at_end - runs.bytes_at_start
    total = exact_bincount(code, added, count)
    most = np.full(count, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(most, code, added)
    peak = np.full(count, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(peak, code, runs.peak_bytes)
    times = np.bincount(code, minlength=count)
    out = [StageSummary(name, int(times[i]), int(total[i]), int(most[i]), int(peak[i]))
           for i, name in enumerate(summary_names)]
    out.sort(key=lambda s: (-s.added_bytes, -s.peak_bytes, s.name))
    return out


# --------------------------------------------------------------------------- per source file


def _normalise(path: str) -> str:
    return path.replace("\\", "/")


def file_matches(filename: str, path: str) -> bool:
    """Does ``filename`` (a frame's) name the file ``path``? A suffix match on whole path parts:
    ``model.py`` matches ``/src/model.py``, not ``/src/mymodel.py``."""
    name, wanted = _normalise(filename), _normalise(path)
    wanted = wanted.removeprefix("./")
    return name == wanted or name.endswith("/" + wanted.lstrip("/"))


@dataclass(frozen=True)
class LineBytes:
    line: int
    function: str  # the frame's function at that line
    bytes: int
    blocks: int

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "function": self.function, "bytes": self.bytes, "blocks": self.blocks}


@dataclass(frozen=True)
class FileBreakdown:
    """Bytes live at one moment whose stack passes through ``path``, by that file's line.

    Each block counts once, at the innermost frame of the file in its stack. ``file_bytes +
    elsewhere_bytes == allocated_bytes``.
    """

    path: str
    files: list[str]  # the frames' filenames that matched
    device: int
    moment: Moment
    time_us: int | None
    allocated_bytes: int
    file_bytes: int
    lines: list[LineBytes]
    # When this file's lines held the most (the whole history): for "--file" without a moment.
    file_peak_event: int | None = None
    file_peak_bytes: int = 0

    @property
    def elsewhere_bytes(self) -> int:
        return self.allocated_bytes - self.file_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "files": list(self.files), "device": self.device,
            "moment": self.moment.to_json(self.time_us),
            "allocated_bytes": self.allocated_bytes, "file_bytes": self.file_bytes,
            "elsewhere_bytes": self.elsewhere_bytes,
            "file_peak_event": self.file_peak_event, "file_peak_bytes": self.file_peak_bytes,
            "lines": [line.to_json() for line in self.lines],
        }


@dataclass(frozen=True)
class FileLines:
    """Per stack: the line of ``path`` it passes through (-1: none), and the function there."""

    files: list[str]
    line_of_stack: I64  # one slot per stack id, plus the -1 slot (always -1) at the end
    function_of_line: dict[int, str]


def file_lines_of_stacks(facts: StackFacts, path: str) -> FileLines:
    table = facts.table
    matching = {i for i, f in enumerate(table.frames) if file_matches(f.filename, path)}
    files = sorted({table.frames[i].filename for i in matching})
    line_of_stack = np.full(len(table.stacks) + 1, -1, dtype=np.int64)
    functions: dict[int, str] = {}
    if matching:
        for sid, stack in enumerate(table.stacks):
            for frame_id in stack:  # innermost first: the first frame of the file is where it allocated
                if frame_id in matching:
                    frame = table.frames[frame_id]
                    line_of_stack[sid] = frame.line
                    functions.setdefault(frame.line, frame.name)
                    break
    return FileLines(files, line_of_stack, functions)


def _no_such_file(facts: StackFacts, path: str) -> MemlensUsageError:
    base = _normalise(path).rsplit("/", 1)[-1]
    stem = base.rsplit(".", 1)[0].lower()
    known = sorted({_normalise(f.filename) for f in facts.table.frames if is_python_frame(f)})
    close = [k for k in known if stem and stem in k.rsplit("/", 1)[-1].lower()][:5]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return MemlensUsageError(f"no frame of any recorded stack is in a file named {path!r}{hint}")


def file_lines(inputs: LensInputs, path: str, moment: Moment | None = None) -> FileBreakdown:
    """Bytes by line of ``path`` at ``moment`` (default: the peak). Raises ``MemlensUsageError``
    when no recorded frame is in that file."""
    trace, index = inputs.trace, inputs.index
    located = file_lines_of_stacks(inputs.facts, path)
    if not located.files:
        raise _no_such_file(inputs.facts, path)
    moment = moment or Moment(whole_peak(trace), "peak", "the peak")
    line = located.line_of_stack[index.stack_id]
    in_file = line >= 0
    live = index.live_mask(moment.event) & in_file
    lines_here = line[live]
    sizes = index.size[live]
    per_line: dict[int, list[int]] = {}
    if lines_here.size:
        distinct, codes = np.unique(lines_here, return_inverse=True)
        totals = exact_bincount(codes, sizes, distinct.size)
        counts = np.bincount(codes, minlength=distinct.size)
        per_line = {int(v): [int(totals[i]), int(counts[i])] for i, v in enumerate(distinct)}
    rows = [LineBytes(n, located.function_of_line.get(n, ""), b, c) for n, (b, c) in per_line.items()]
    rows.sort(key=lambda r: (-r.bytes, r.line))
    peak_event, peak_bytes = _file_peak(trace, index, in_file)
    return FileBreakdown(path, located.files, trace.device, moment, time_of(trace, moment.event),
                         allocated_at(trace, moment.event), sum(r.bytes for r in rows), rows,
                         peak_event, peak_bytes)


def _file_peak(trace: DeviceTrace, index: LiveIndex, in_file: npt.NDArray[np.bool_]) -> tuple[int | None, int]:
    """The row after which the file's blocks held the most (a cumulative sum over the rows)."""
    n = len(trace)
    if not n:
        return None, int(index.size[in_file].sum())
    change = np.zeros(n + 1, dtype=np.int64)  # change[k + 1]: at row k
    alloc, free, size = index.alloc_event[in_file], index.free_event[in_file], index.size[in_file]
    np.add.at(change, alloc + 1, size)  # alloc -1 (before the history) lands on slot 0
    ended = free < n
    np.subtract.at(change, free[ended] + 1, size[ended])
    level = np.cumsum(change)
    event = int(np.argmax(level[1:]))
    if int(level[0]) > int(level[event + 1]):
        return BEFORE_FIRST_ROW, int(level[0])
    return event, int(level[event + 1])


@dataclass(frozen=True)
class LineChange:
    line: int
    function: str
    before_bytes: int
    after_bytes: int

    @property
    def delta_bytes(self) -> int:
        return self.after_bytes - self.before_bytes

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "function": self.function, "before": self.before_bytes,
                "after": self.after_bytes, "delta": self.delta_bytes}


@dataclass(frozen=True)
class FileDiff:
    """Per line of one file: bytes live at each snapshot's moment, and the change."""

    path: str
    before: FileBreakdown | None  # None: the file is in no stack of that snapshot
    after: FileBreakdown | None
    lines: list[LineChange] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def side(b: FileBreakdown | None) -> dict[str, Any] | None:
            if b is None:
                return None
            return {"files": list(b.files), "event": b.moment.event, "moment": b.moment.text,
                    "allocated_bytes": b.allocated_bytes, "file_bytes": b.file_bytes}

        before = self.before.file_bytes if self.before else 0
        after = self.after.file_bytes if self.after else 0
        return {"path": self.path, "before": side(self.before), "after": side(self.after),
                "file_bytes": {"before": before, "after": after, "delta": after - before},
                "lines": [c.to_json() for c in self.lines]}


def diff_file_lines(before: LensInputs, after: LensInputs, path: str, before_moment: Moment | None = None,
                    after_moment: Moment | None = None) -> FileDiff:
    """Which lines of ``path`` grew between two snapshots (each at its moment, default its peak).

    A file present in only one snapshot diffs against nothing; in neither is a usage error.
    """
    sides: list[FileBreakdown | None] = []
    for inputs, moment in ((before, before_moment), (after, after_moment)):
        try:
            sides.append(file_lines(inputs, path, moment))
        except MemlensUsageError:
            sides.append(None)
    if sides[0] is None and sides[1] is None:
        raise _no_such_file(after.facts, path)
    by_line: dict[int, list[Any]] = {}
    for position, side in enumerate(sides):
        for row in side.lines if side else []:
            entry = by_line.setdefault(row.line, [row.function, 0, 0])
            entry[1 + position] = row.bytes
    changes = [LineChange(n, fn, b, a) for n, (fn, b, a) in by_line.items()]
    changes.sort(key=lambda c: (-abs(c.delta_bytes), c.line))
    return FileDiff(path, sides[0], sides[1], changes)
