"""Leak: allocations that outlive their step, from the same stack, step after step, and pile up.

The evidence is in the lifetimes, not in the slope of a curve. For every comparable step (whole
steps after the warm-up step, which creates gradients and optimizer state) an allocation made
in it and still alive at its end *survives* the step. Gradients and handed-over tensors
(``prev = out``) survive one step and are freed in the next; a leak's survivors are kept, so
survivors of one stack from several steps are alive *at the same time*. A stack leaks when
survivors from at least ``LEAK_MIN_KEPT_STEPS`` of its steps are alive together (its *depth*)
and it recurs in most comparable steps. No absolute floor: a 512-byte ``losses.append(loss)``
is as certain as a 5 MiB one. Bytes per step is the leaking stacks' surviving bytes averaged
over the steps they span (a leak made every other step grows half as fast), counted as the
caching allocator holds them: each request's block (``Lifetimes.size``), so a kept 0-d loss
costs 512 bytes, not 4. The requested bytes are in the evidence too, and so is the allocated
level at the step ends, which counts the same blocks and corroborates the rise
(``level_rise_per_step_bytes``). Severity is how many steps until the device is full (or, with
the capacity unknown, until the leak adds another peak's worth).

State made inside optimizer.step and kept (``optimizer_state``) is never a candidate: it is
bounded by the parameters, even when it appears over several steps.

Allocations that grow a buffer by replacing it (``buf = torch.cat([buf, x])``) leave one
survivor at a time: the level rises but the lifetimes show no pile, and no finding is made.

Evidence (typed items, by meaning): the amount ``bytes_per_step`` (512-byte blocks) and
``held_bytes``; the pattern ``kept_steps``, ``level_rise_per_step_bytes``, ``leaking_stacks``;
then the moment, who holds it, and the context. Every item: ``requested_bytes_per_step``,
``kept_steps`` (the pile's depth), ``held_bytes`` (the leaking stacks' survivors alive at the end
of ``last_step``; also the finding's ``bytes``), ``level_rise_per_step_bytes``, the moment:
``first_step``/``last_step`` (indices), ``first_step_end_event``/``last_step_end_event`` (rows),
``first_step_end_us``/``last_step_end_us``, ``level_at_first_step_end_bytes``/
``level_at_last_step_end_bytes``; ``comparable_steps``, ``leaking_stacks``,
``warmup_steps_skipped``, ``steps_until_full`` (with ``capacity_bytes``) or
``steps_until_peak_doubles``, and ``severity_basis`` (capacity | peak).

Who holds it: when the recorder's sidecar has ``leak_holders`` (memlens.recorder.holders: the
names holding blocks that outlived a step at the dump, each with its block addresses), the
leak's survivors still alive at the dump are matched to them by address. Every other block
made in a step (the warm-up step's too) that such a holder keeps alive belongs to the leak as
well: the warm-up step's kept tensor is left out of the comparison, and its first forward may
run before the recorder's hooks, under another stack, but clearing the holder frees it. The
finding then says "Held by list `kept` (global in train.py), appended at train.py:40" and its
recommendation starts at that line. Of several lines that can store into the holder, the one
named is the one whose function and value lines (``values_from``) the leaked blocks' own
allocation stacks pass through; several when different blocks came through different lines;
where the stacks cannot tell, all the lines they match (or all), saying so. Keys: ``held_by``,
``held_by_line`` and ``held_by_code`` (one line named), ``held_by_lines`` (several),
``held_by_line_match`` (``only line`` | ``allocation stacks`` | ``undecided``),
``held_by_blocks`` and ``held_by_bytes`` (the leak's blocks that holder holds, 512-byte blocks),
``leak_blocks_at_dump``/``leak_bytes_at_dump`` (all the leak's blocks alive at the dump),
``holders_matched`` and ``also_held_by``.

Category: the leak's blocks that no recorded role and no inference named (``unknown``) get the
category ``leaked`` (``ctx.category`` is updated; the leak finder runs first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from memlens.analysis.categories import LEAKED, OPTIMIZER_STATE, UNKNOWN
from memlens.analysis.context import DeviceContext
from memlens.analysis.datatypes import Evidence, EvidenceItem, Finding, Step, amount, fact
from memlens.analysis.settings import (
    LEAK_HIGH_SEVERITY_STEPS_LEFT,
    LEAK_MEDIUM_SEVERITY_STEPS_LEFT,
    LEAK_MIN_KEPT_STEPS,
    LEAK_MIN_KEPT_STEPS_SHORT_RUN,
    LEAK_MIN_RECURRING_SHARE,
    LEAK_SHORT_RUN_STEPS,
    LEAK_WARMUP_STEPS,
)
from memlens.sidecar.leak_holders import Holder, LeakHolders, StoreLine
from memlens.snapshot.model import Frame
from memlens.units import counted, format_bytes

I64 = npt.NDArray[np.int64]


@dataclass
class Survivors:
    """Allocations made in a comparable step and alive at its end (one row each)."""

    lifetime: I64  # index into ctx.lifetimes
    stack: I64  # stack id (-1: no stack)
    step: I64  # position in the comparable steps where it was made
    last_step_alive: I64  # last comparable step at whose end it is still alive


def comparable_steps(steps: list[Step]) -> list[Step]:
    """Whole steps after the warm-up: the ones whose survivors can be compared."""
    complete = sorted((s for s in steps if not s.partial), key=lambda s: s.start_event)
    return complete[LEAK_WARMUP_STEPS:]


def survivors(ctx: DeviceContext, steps: list[Step]) -> Survivors:
    lt = ctx.lifetimes
    starts = np.array([s.start_event for s in steps], dtype=np.int64)
    # Non-decreasing, so the searches below stay valid even if a writer's scopes overlap.
    ends = np.maximum.accumulate(np.array([s.end_event for s in steps], dtype=np.int64))
    position = np.searchsorted(starts, lt.alloc_event, side="right") - 1
    safe = np.maximum(position, 0)
    # Made inside a comparable step (gaps between steps belong to none) and alive at its end:
    # DeviceTrace.allocated counts a block after row e while alloc <= e < free.
    made_in_step = (lt.alloc_event >= 0) & (position >= 0) & (lt.alloc_event < ends[safe])
    # State an optimizer creates inside optimizer.step (on the first step, or later for parameters
    # that get their first gradient late, e.g. MoE experts) is bounded by the parameters: not a leak.
    optimizer_state = ctx.category == OPTIMIZER_STATE
    survived = made_in_step & (lt.free_event >= ends[safe]) & ~optimizer_state
    rows = np.flatnonzero(survived).astype(np.int64)
    last_alive = np.searchsorted(ends, lt.free_event[rows], side="right") - 1
    return Survivors(rows, lt.stack_id[rows].astype(np.int64), position[rows], last_alive.astype(np.int64))


def kept_depth_per_stack(found: Survivors, steps: int) -> tuple[I64, I64, I64]:
    """(stacks, depth, recurring): for each stack with survivors, the most steps whose survivors
    are alive together at one step's end, and in how many steps it left survivors."""
    if found.lifetime.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    # One interval [made, last alive] per (stack, step): the longest-lived survivor of that step.
    key = found.stack * (steps + 1) + found.step
    order = np.lexsort((-found.last_step_alive, key))
    first_of_key = np.ones(order.size, dtype=bool)
    first_of_key[1:] = key[order][1:] != key[order][:-1]
    pick = order[first_of_key]
    stack, made, last = found.stack[pick], found.step[pick], found.last_step_alive[pick]
    # Coverage counting per stack: +1 where an interval starts, -1 one past where it ends. Each
    # stack's deltas sum to zero, so one running sum over all stacks resets between them.
    positions = np.concatenate([made, last + 1])
    deltas = np.concatenate([np.ones(made.size, dtype=np.int64), -np.ones(made.size, dtype=np.int64)])
    owners = np.concatenate([stack, stack])
    order = np.lexsort((deltas, positions, owners))  # at one position, ends before starts
    running = np.cumsum(deltas[order])
    owners = owners[order]
    group_start = np.flatnonzero(np.concatenate([[True], owners[1:] != owners[:-1]]))
    depth = np.maximum.reduceat(running, group_start)
    stacks = owners[group_start]
    recurring = np.bincount(np.searchsorted(stacks, stack), minlength=stacks.size).astype(np.int64)
    return stacks, depth.astype(np.int64), recurring


def held_with(ctx: DeviceContext, holders: list[HolderMatch], rows: I64) -> I64:
    """Lifetimes alive at the dump, made inside a whole step (the warm-up included), that a
    holder of some of ``rows`` keeps: what clearing that holder frees along with them."""
    lt = ctx.lifetimes
    whole = [s for s in ctx.steps if not s.partial]
    at_dump = rows[lt.free_event[rows] >= ctx.events]
    if not holders or not whole or at_dump.size == 0:
        return np.zeros(0, dtype=np.int64)
    leaked = set(lt.address[at_dump].tolist())
    addresses = frozenset().union(*(h.addresses for h in holders if not leaked.isdisjoint(h.addresses)))
    if not addresses:
        return np.zeros(0, dtype=np.int64)
    wanted = np.fromiter(addresses, dtype=np.int64, count=len(addresses))
    first_start = min(s.start_event for s in whole)
    alive = (lt.free_event >= ctx.events) & (lt.alloc_event >= first_start) & np.isin(lt.address, wanted)
    alive &= ctx.phases.step_of(np.where(alive, lt.alloc_event, -1)) >= 0
    return np.flatnonzero(alive).astype(np.int64)


def find(ctx: DeviceContext) -> list[Finding]:
    comparable = comparable_steps(ctx.steps)
    m = len(comparable)
    # Short windows cannot show a pile of three: two steps' survivors alive together is the most
    # they can show (a tensor handed over two steps would pass too, which is why longer runs need three).
    min_depth = LEAK_MIN_KEPT_STEPS if m >= LEAK_SHORT_RUN_STEPS else LEAK_MIN_KEPT_STEPS_SHORT_RUN
    if m < min_depth:
        return []
    found = survivors(ctx, comparable)
    stacks, depth, recurring = kept_depth_per_stack(found, m)
    leaking = stacks[(depth >= min_depth) & (recurring >= LEAK_MIN_RECURRING_SHARE * m)]
    if leaking.size == 0:
        return []
    is_leaking = np.isin(found.stack, leaking)
    lt = ctx.lifetimes
    rows = found.lifetime[is_leaking]
    made_at = found.step[is_leaking]
    requested = lt.requested[rows]
    blocks = lt.size[rows]
    first, last = int(made_at.min()), int(made_at.max())
    span = last - first + 1
    per_step = np.bincount(made_at - first, weights=blocks.astype(np.float64), minlength=span)
    requested_per_step = np.bincount(made_at - first, weights=requested.astype(np.float64), minlength=span)
    bytes_per_step = round(float(per_step.mean()))
    if bytes_per_step <= 0:
        return []
    # What the leak holds: the survivors of the leaking stacks, and every other block made in a
    # step that a holder of theirs keeps alive at the dump. The warm-up step is left out of the
    # comparison (it makes gradients and optimizer state) and its first forward can run before
    # the recorder's hooks, under another stack: its kept tensor is still in the pile.
    holders = read_holders(ctx.snapshot.sidecar.leak_holders if ctx.snapshot.sidecar is not None else None)
    kept = np.union1d(rows, held_with(ctx, holders, rows))
    end_row = comparable[last].end_event
    held = kept[(lt.alloc_event[kept] < end_row) & (lt.free_event[kept] >= end_row)]
    held_bytes = int(lt.size[held].sum())
    leak_mask = np.zeros(len(lt), dtype=bool)
    leak_mask[kept] = True
    # The leak's blocks that no recorded role and no inference named are what the leak keeps.
    unnamed = kept[ctx.category[kept] == UNKNOWN]
    ctx.category[unnamed] = LEAKED

    allocated = ctx.trace.allocated
    first_step, last_step = comparable[first], comparable[last]
    level_first = int(allocated[first_step.end_event - 1])
    level_last = int(allocated[last_step.end_event - 1])
    step_end_levels = allocated[np.array([s.end_event - 1 for s in comparable[first : last + 1]])]
    level_rise = round(float(np.diff(step_end_levels).mean())) if last > first else 0

    if ctx.capacity:
        headroom, basis = max(ctx.capacity - ctx.peak_allocated, 0), "capacity"
    else:
        headroom, basis = ctx.peak_allocated, "peak"
    steps_left = headroom // bytes_per_step
    severity: Literal["high", "medium", "low"] = "low"
    if steps_left < LEAK_HIGH_SEVERITY_STEPS_LEFT:
        severity = "high"
    elif steps_left < LEAK_MEDIUM_SEVERITY_STEPS_LEFT:
        severity = "medium"

    kept_steps = int(depth[np.isin(stacks, leaking)].max())
    evidence: list[EvidenceItem] = [
        amount("bytes_per_step", bytes_per_step),
        amount("held_bytes", held_bytes),
        fact("kept_steps", kept_steps, "count", "pattern"),
        fact("level_rise_per_step_bytes", level_rise, "bytes", "pattern"),
        fact("leaking_stacks", int(leaking.size), "count", "pattern"),
        fact("last_step", last_step.index, "step", "moment"),
        fact("last_step_end_event", last_step.end_event - 1, "event", "moment"),
        fact("first_step", first_step.index, "step", "moment"),
        fact("first_step_end_event", first_step.end_event - 1, "event", "moment"),
    ]
    first_us, last_us = ctx.time_at(first_step.end_event - 1), ctx.time_at(last_step.end_event - 1)
    if first_us is not None and last_us is not None:
        evidence += [fact("first_step_end_us", first_us, "us", "moment"),
                     fact("last_step_end_us", last_us, "us", "moment")]
    evidence += [
        fact("level_at_first_step_end_bytes", level_first, "bytes", "context"),
        fact("level_at_last_step_end_bytes", level_last, "bytes", "context"),
        fact("requested_bytes_per_step", round(float(requested_per_step.mean())), "bytes", "context"),
        fact("steps_until_full" if basis == "capacity" else "steps_until_peak_doubles", int(steps_left), "count",
             "context"),
        fact("severity_basis", basis, "text", "context"),
        fact("comparable_steps", m, "count", "context"),
        fact("warmup_steps_skipped", LEAK_WARMUP_STEPS, "count", "context"),
    ]
    if ctx.capacity:
        evidence.append(fact("capacity_bytes", ctx.capacity, "bytes", "context"))
    fills = (
        f"; the device is full in about {counted(steps_left, 'more step')}"
        if basis == "capacity"
        else f"; it adds another peak's worth in about {counted(steps_left, 'step')}"
    )
    summary = (
        f"Allocations from {leaking.size} stack(s) outlive their step and pile up: "
        f"{format_bytes(bytes_per_step)} per step, kept from {counted(kept_steps, 'step')} at once "
        f"({format_bytes(held_bytes)} held at the end of step {last_step.index}){fills}."
    )
    recommendation = (
        "Find what keeps tensors from each step alive (the stacks below): store loss.item() or "
        "tensor.detach() instead of tensors with grad_fn, and clear caches and lists of outputs."
    )
    # Survivors still alive when the snapshot was written: what the recorder's holders can name.
    at_dump = kept[lt.free_event[kept] >= ctx.events]
    holding = match_holders(holders, lt.address[at_dump], lt.size[at_dump],
                            lt.stack_id[at_dump].astype(np.int64), ctx.snapshot.stacks.frames_of)
    if holding:
        evidence += holder_evidence(holding, int(at_dump.size), int(lt.size[at_dump].sum()))
        summary += " " + holder_sentence(holding, int(at_dump.size))
        # The named line is the fix; the general advice stays only where no line could be named.
        recommendation = holder_recommendation(holding[0]) + (" " + recommendation if not holding[0].named else "")
    return [
        Finding(
            kind="leak",
            device=ctx.device,
            severity=severity,
            bytes=held_bytes,
            start_event=first_step.start_event,
            end_event=last_step.end_event,
            start_us=ctx.time_at(first_step.start_event),
            end_us=ctx.time_at(last_step.end_event - 1),
            step=first_step.index,
            top_stacks=ctx.top_stacks(leak_mask),
            evidence=Evidence(evidence),
            summary=summary,
            recommendation=recommendation,
            estimated_saving_bytes=held_bytes,
        )
    ]


# ----------------------------------------------------------------------------- who holds it
def stored_by(line: StoreLine, frames: list[Frame]) -> bool:
    """Whether a block allocated under ``frames`` can have been stored by ``line``: the stack
    passes through the line's function at a line its stored value comes from."""
    if not line.function or not line.values_from:
        return False
    return any(
        frame.name == line.function and line.first_line <= frame.line <= line.last_line
        and frame.line in line.values_from and _same_file(frame.filename, line.file)
        for frame in frames
    )


def _same_file(frame_file: str, display: str) -> bool:
    """A frame's file (absolute on CUDA, as the recorder displays it on the CPU) against the
    file the recorder displays (relative, or the base name)."""
    if not display:
        return False
    normal, shown = frame_file.replace("\\", "/"), display.replace("\\", "/")
    return normal == shown or normal.endswith("/" + shown)


# How a holder's lines were narrowed to the ones named (evidence ``held_by_line_match``).
ONLY_LINE = "only line"  # one line can store into the holder
FROM_STACKS = "allocation stacks"  # the leaked blocks' own stacks name the line(s) that ran
UNDECIDED = "undecided"  # several lines can and the stacks cannot tell: all are named


@dataclass
class HolderMatch:
    """A holder the recorder named (``memlens.sidecar.leak_holders.Holder``) and the leak's
    blocks it holds at the dump, with the lines the finding names."""

    holder: Holder
    addresses: frozenset[int]
    matched_blocks: int = 0
    matched_bytes: int = 0
    named: tuple[StoreLine, ...] = ()  # the lines the finding names (set by match_holders)
    line_match: str = ONLY_LINE

    @property
    def text(self) -> str:
        return self.holder.holder

    @property
    def lines(self) -> tuple[StoreLine, ...]:
        """Every line that can have stored into it (the first ``MAX_HOLDER_LINES``); a sidecar
        that gives only ``line`` ("train.py:40") gives that one."""
        if self.holder.lines:
            return self.holder.lines[:MAX_HOLDER_LINES]
        file, _, number = (self.holder.line or "").rpartition(":")
        return (StoreLine(file, int(number)),) if file and number.isdigit() else ()

    @property
    def line(self) -> str | None:
        """The line to edit, when exactly one is named."""
        return self.named[0].where if len(self.named) == 1 else None


def read_holders(section: LeakHolders | None) -> list[HolderMatch]:
    """The holders the recorder found at the dump (the sidecar's ``leak_holders``, already read
    by the one reader of ``memlens.sidecar.leak_holders`` with the sidecar), not yet matched to
    a leak."""
    holders = section.holders if section is not None else []
    return [HolderMatch(holder, holder.addresses) for holder in holders]


# Lines read per holder (the recorder lists up to 20) and distinct stacks compared with them: an
# untrusted sidecar cannot make the match quadratic in its size.
MAX_HOLDER_LINES = 20
MAX_STACKS_COMPARED = 1_000


def match_holders(holders: list[HolderMatch], addresses: I64, blocks: I64, stack_ids: I64 | None = None,
                  frames_of: Callable[[int], list[Frame]] | None = None) -> list[HolderMatch]:
    """The holders that hold some of the leak's blocks alive at the dump, most bytes first, each
    with the lines it names (``named``): of the lines that can store into it, the ones the blocks'
    allocation stacks (``stack_ids``, aligned with ``addresses``) say stored them.

    A block two holders share counts for both (it stays alive until both let go)."""
    matched = []
    for holder in holders:
        if not holder.addresses:
            continue
        mask = np.isin(addresses, np.fromiter(holder.addresses, dtype=np.int64, count=len(holder.addresses)))
        if mask.any():
            holder.matched_blocks = int(mask.sum())
            holder.matched_bytes = int(blocks[mask].sum())
            stacks = ([] if stack_ids is None or frames_of is None
                      else [frames_of(int(s)) for s in np.unique(stack_ids[mask])[:MAX_STACKS_COMPARED]])
            holder.named, holder.line_match = lines_that_ran(holder.lines, stacks)
            matched.append(holder)
    matched.sort(key=lambda h: (-h.matched_bytes, h.text))
    return matched


def lines_that_ran(lines: tuple[StoreLine, ...], stacks: list[list[Frame]]) -> tuple[tuple[StoreLine, ...], str]:
    """The lines to name and how they were chosen: the only line; else the lines the blocks'
    allocation stacks match, when each stack matches exactly one (several lines named when
    several ran, in different steps); else, undecided, the lines the stacks match when each
    matches some, or every line."""
    if len(lines) <= 1:
        return lines, ONLY_LINE
    stored = [[line for line in lines if stored_by(line, frames)] for frames in stacks]
    matched = {line for hits in stored for line in hits}
    if stored and all(len(hits) == 1 for hits in stored):
        return tuple(line for line in lines if line in matched), FROM_STACKS
    if stored and all(stored):
        return tuple(line for line in lines if line in matched), UNDECIDED
    return lines, UNDECIDED


_VERBS = {"append": "appended", "appendleft": "appended", "extend": "appended", "extendleft": "appended",
          "insert": "inserted", "assignment": "assigned"}


# Lines written out in a sentence; the rest are counted.
MAX_LINES_SHOWN = 5


def _listed(lines: tuple[StoreLine, ...]) -> str:
    shown = ", ".join(_quoted(line) for line in lines[:MAX_LINES_SHOWN])
    return shown + (f" and {len(lines) - MAX_LINES_SHOWN} more" if len(lines) > MAX_LINES_SHOWN else "")


def _quoted(line: StoreLine) -> str:
    """"train.py:40 (`kept.append(logits)`)"."""
    return f"{line.where} (`{line.code}`)" if line.code else line.where


def _placed(holder: HolderMatch) -> str:
    """", appended at train.py:40 (`kept.append(logits)`)", the lines it could be when memlens
    could not tell which ran, or "" without a line."""
    if not holder.named:
        return ""
    if holder.line_match == UNDECIDED:
        return (f", stored by one of {len(holder.named)} lines (memlens could not tell which one ran): "
                + _listed(holder.named))
    return ", " + " and ".join(f"{_VERBS.get(line.how, 'stored')} at {_quoted(line)}" for line in holder.named)


def holder_evidence(holding: list[HolderMatch], blocks_at_dump: int, bytes_at_dump: int) -> list[EvidenceItem]:
    top = holding[0]
    evidence = [fact("held_by", top.text, "text", "cause")]
    if top.line is not None:
        evidence.append(fact("held_by_line", top.line, "text", "cause"))
        if top.named[0].code:
            evidence.append(fact("held_by_code", top.named[0].code, "text", "cause"))
    if len(top.named) > 1:
        evidence.append(fact("held_by_lines", "; ".join(line.where for line in top.named), "text", "cause"))
    if top.named:
        evidence.append(fact("held_by_line_match", top.line_match, "text", "cause"))
    evidence += [
        fact("held_by_blocks", top.matched_blocks, "count", "cause"),
        fact("held_by_bytes", top.matched_bytes, "bytes", "cause"),
    ]
    if len(holding) > 1:
        evidence.append(fact("also_held_by", "; ".join(h.text for h in holding[1:4]), "text", "cause"))
    evidence += [
        fact("holders_matched", len(holding), "count", "cause"),
        fact("leak_blocks_at_dump", blocks_at_dump, "count", "context"),
        fact("leak_bytes_at_dump", bytes_at_dump, "bytes", "context"),
    ]
    return evidence


def holder_sentence(holding: list[HolderMatch], blocks_at_dump: int) -> str:
    top = holding[0]
    others = "; ".join(
        f"{h.text}: {h.matched_blocks} block{'s' if h.matched_blocks != 1 else ''}" for h in holding[1:3])
    others = f" Also held by {others}." if others else ""
    return (f"Held by {top.text}{_placed(top)}: {top.matched_blocks} of the {blocks_at_dump} leaked blocks "
            f"alive at the dump ({format_bytes(top.matched_bytes)}).{others}")


def holder_recommendation(top: HolderMatch) -> str:
    advice = ("Keep only what you need there (loss.item(), a detached CPU copy), bound it, or clear it "
              "every step.")
    if not top.named:
        return f"Stop {top.text} from keeping each step's tensors (no line could be named)."
    lines = _listed(top.named)
    if top.line_match == UNDECIDED:
        return (f"Edit the one of these lines that runs (memlens could not tell which): {lines}. It keeps "
                f"each step's tensors alive through {top.text}. {advice}")
    if len(top.named) > 1:
        lines = " and ".join(_quoted(line) for line in top.named)
        return f"Edit {lines}: they keep each step's tensors alive through {top.text}. {advice}"
    return f"Edit {lines}: it keeps each step's tensors alive through {top.text}. {advice}"
