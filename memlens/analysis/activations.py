"""Activation plateau: memory rises through forward and falls through backward.

Height = bytes made in the forward part of a step (outside optimizer.step, not under autograd's
frames) that are still live at the end of forward and freed later in the same step, in the step
where they are highest. The end of forward is the step-local peak (``Phases.forward_peak``),
moved back to the step's first autograd row when one comes before it: the engine's gradients and
temporaries can make backward the step's highest point, and what forward left for backward is
what stands when backward begins. Any plateau of at least ``ACTIVATION_MIN_BYTES`` and
``ACTIVATION_MIN_FRACTION_OF_PEAK`` is reported; severity follows its share of the peak.
Savings follow memory-budget.md and are estimates: full checkpointing keeps only the block
inputs (~1/12 of the rule-of-thumb activations); selective checkpointing keeps ~60%.

Evidence keys: ``height_bytes``, ``share_of_peak``, the moment: ``forward_end_event`` (row),
``step``, ``forward_end_us``, ``allocated_at_forward_end_bytes``, ``peak_allocated_bytes``,
``forward_end_source`` (step-local peak | first autograd row); ``rise_bytes``/``fall_bytes``
with ``rise_start_event``/``fall_end_event``, ``duration_events``/``duration_us``,
``activation_allocations``, the two checkpointing savings with their ``saving_basis``,
``steps_with_plateau`` and ``backward_rows_share``.

By module: when the recorder's module scopes (``memlens.forward#<module>`` annotations) cover
the step, each activation of the plateau belongs to the innermost module whose forward allocated
it, counted for that module and its parents. The repeated blocks (the numbered children
``P.0``, ``P.1``, ... of the parent whose numbered children hold the most) are named:
``blocks``, ``block_parent``, ``block_bytes_mean``/``_min``/``_max``, ``largest_block``,
``blocks_share_of_plateau``, ``per_block`` (text), ``other_modules`` (the other top-level
modules, text), ``module_scopes``, ``activation_bytes_in_modules`` and
``activation_bytes_outside_modules`` (the loss, code outside the model). When the sidecar gives
the batch, the sequence length and the hidden size (``model``, ``model.config`` or ``inputs``,
Hugging Face names first), Megatron's per-layer count from ``memlens.budget.formulas`` is set
beside them: ``theory_per_layer_bytes`` (34*B*T*d, no T x T scores kept, as with SDPA or
FlashAttention), ``theory_per_layer_with_scores_bytes`` (with the number of heads),
``theory_basis`` and ``theory_layers``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from memlens.analysis.categories import Phases
from memlens.analysis.context import DeviceContext
from memlens.analysis.datatypes import Evidence, EvidenceItem, Finding, Severity, amount, fact
from memlens.analysis.lifetimes import byte_counts, lifetime_ranges
from memlens.analysis.settings import (
    ACTIVATION_HIGH_SEVERITY_FRACTION,
    ACTIVATION_MEDIUM_SEVERITY_FRACTION,
    ACTIVATION_MIN_BYTES,
    ACTIVATION_MIN_FRACTION_OF_PEAK,
    FULL_CHECKPOINT_KEEP_FRACTION,
    SELECTIVE_CHECKPOINT_KEEP_FRACTION,
)
from memlens.analysis.steps import _rows_of_scopes, _scopes, _search_times, device_annotations
from memlens.sidecar import Sidecar
from memlens.units import format_bytes

# Rows without Python frames must be this much more common after the peak than before it to
# count as autograd's engine thread at work (it records no Python frames).
BACKWARD_FRAMELESS_SHIFT = 0.3


def forward_ends(ctx: DeviceContext) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Last forward row of each phase-step, and whether the first autograd row moved it."""
    phases = ctx.phases
    peaks = phases.forward_peak.copy()
    stack_ids = ctx.trace.stack_id
    backward_rows = np.flatnonzero(ctx.facts.backward[stack_ids] & (stack_ids >= 0)).astype(np.int64)
    if backward_rows.size == 0:
        return peaks, np.zeros(peaks.size, dtype=bool)
    first = np.searchsorted(backward_rows, phases.start, side="left")
    has = first < backward_rows.size
    first_row = backward_rows[np.minimum(first, backward_rows.size - 1)]
    moved = has & (first_row > phases.start) & (first_row <= peaks)
    return np.where(moved, first_row - 1, peaks), moved


def _plateau_rows(a: npt.NDArray[np.int64], f: npt.NDArray[np.int64], backward_stack: npt.NDArray[np.bool_], n: int,
                  phases: Phases, ends: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """For lifetimes allocated at rows ``a`` and freed at ``f``: the phase-step each belongs to,
    and whether it is held across that step's forward end (an activation)."""
    # Made in forward and left for backward: per step, made by the end of forward outside
    # optimizer.step and autograd, freed after it inside the step.
    made = a >= 0
    k_made = phases.step_of(np.where(made, a, -1))
    km = np.maximum(k_made, 0)
    outside_optimizer = phases.optimizer_window_of(np.where(made, a, -1)) < 0
    act = made & (k_made >= 0) & outside_optimizer & ~backward_stack
    act &= (a <= ends[km]) & (f > ends[km]) & (f < phases.end[km])
    # Live before the window began and freed in a step's backward: activations of a step the
    # window cut (as ``categories`` counts them).
    ghost = ~made & (f < n)
    k_freed = phases.step_of(np.where(ghost, f, -1))
    kf = np.maximum(k_freed, 0)
    ghost_act = ghost & (k_freed >= 0) & (f > ends[kf]) & (f <= phases.backward_end[kf])
    return np.where(act, k_made, k_freed), act | ghost_act


def find(ctx: DeviceContext) -> list[Finding]:
    n = ctx.events
    phases = ctx.phases
    if n == 0 or phases.start.size == 0:
        return []
    lt = ctx.lifetimes
    ends, moved = forward_ends(ctx)
    # Each lifetime's step and whether it counts, a range of lifetimes at a time (each is decided
    # on its own; a dozen temporaries over millions of lifetimes would be the analysis's peak).
    owner = np.empty(len(lt), dtype=np.int64)
    chosen = np.empty(len(lt), dtype=bool)
    for at in lifetime_ranges(len(lt)):
        owner[at], chosen[at] = _plateau_rows(lt.alloc_event[at], lt.free_event[at],
                                              ctx.facts.backward[lt.stack_id[at]], n, phases, ends)
    heights = byte_counts(owner[chosen], lt.size[chosen], phases.start.size)
    # Prefer whole steps: a partial head step is often setup (model copies), not a forward pass.
    complete = np.array([not s.partial for s in ctx.steps], dtype=bool)
    candidates = heights.copy()
    if complete.size == heights.size and complete.any():
        candidates[~complete] = -1.0
    k = int(np.argmax(candidates))
    height = round(heights[k])
    peak = int(ends[k])
    share = height / ctx.peak_allocated if ctx.peak_allocated else 0.0
    if height < ACTIVATION_MIN_BYTES or share < ACTIVATION_MIN_FRACTION_OF_PEAK:
        return []
    start, backward_end = int(phases.start[k]), int(phases.backward_end[k])
    # Backward must be seen after the peak: autograd frames, or rows without Python frames (the
    # engine's thread has none) where the forward had them. Without it (inference, zeroth-order
    # training) a rise and fall is not an activation plateau.
    after = ctx.trace.stack_id[peak + 1 : max(backward_end, peak + 1)]
    before = ctx.trace.stack_id[start : peak + 1]
    backward_rows = float(ctx.facts.backward_named[after].mean()) if after.size else 0.0
    frameless_after = float((after < 0).mean()) if after.size else 0.0
    frameless_before = float((before < 0).mean()) if before.size else 0.0
    backward_seen = backward_rows > 0 or (frameless_after - frameless_before) >= BACKWARD_FRAMELESS_SHIFT
    if not backward_seen:
        return []
    allocated = ctx.trace.allocated
    rise_start = start + int(np.argmin(allocated[start : peak + 1]))
    fall_end = peak + int(np.argmin(allocated[peak : max(backward_end, peak + 1)]))
    live = chosen & (owner == k)
    full_saving = int(height * (1 - FULL_CHECKPOINT_KEEP_FRACTION))
    selective_saving = int(height * (1 - SELECTIVE_CHECKPOINT_KEEP_FRACTION))
    step_index = ctx.step_at(peak)
    # The height and its share, the rise and fall that make it a plateau, then its moment.
    evidence: list[EvidenceItem] = [
        amount("height_bytes", height),
        fact("share_of_peak", round(share, 3), "ratio", "pattern"),
        fact("rise_bytes", int(allocated[peak] - allocated[rise_start]), "bytes", "pattern"),
        fact("fall_bytes", int(allocated[peak] - allocated[fall_end]), "bytes", "pattern"),
        fact("steps_with_plateau", int((heights >= ACTIVATION_MIN_BYTES).sum()), "count", "pattern"),
        fact("forward_end_event", peak, "event", "moment"),
    ]
    if step_index is not None:
        evidence.append(fact("step", step_index, "step", "moment"))
    if ctx.trace.has_time:
        evidence.append(fact("forward_end_us", int(ctx.trace.time_us[peak]), "us", "moment"))
    evidence += [
        fact("rise_start_event", rise_start, "event", "moment"),
        fact("fall_end_event", fall_end, "event", "moment"),
        fact("duration_events", fall_end - rise_start, "count", "moment"),
    ]
    if ctx.trace.has_time:
        evidence.append(fact("duration_us", int(ctx.trace.time_us[fall_end] - ctx.trace.time_us[rise_start]), "us",
                             "moment"))
    evidence += [
        fact("full_checkpointing_saving_bytes", full_saving, "bytes", "remedy"),
        fact("selective_checkpointing_saving_bytes", selective_saving, "bytes", "remedy"),
        fact("saving_basis", "estimate: full keeps ~1/12 (block inputs only), selective keeps ~60%", "text",
             "remedy"),
        fact("allocated_at_forward_end_bytes", int(allocated[peak]), "bytes", "context"),
        fact("peak_allocated_bytes", ctx.peak_allocated, "bytes", "context"),
        fact("forward_end_source", "first autograd row" if moved[k] else "step-local peak", "text", "context"),
        fact("activation_allocations", int(live.sum()), "count", "context"),
        fact("backward_rows_share", round(max(backward_rows, frameless_after - frameless_before), 3), "ratio",
             "context"),
    ]
    summary = (
        f"Activations reach {format_bytes(height)} ({share:.0%} of the peak) at the end of forward "
        "and are freed through backward."
    )
    by_module = activations_by_module(ctx, live, int(phases.start[k]), peak)
    if by_module is not None:
        evidence += by_module.evidence(height)
        summary += " " + by_module.sentence(height)
    severity: Severity = "low"
    if share >= ACTIVATION_HIGH_SEVERITY_FRACTION:
        severity = "high"
    elif share >= ACTIVATION_MEDIUM_SEVERITY_FRACTION:
        severity = "medium"
    return [
        Finding(
            kind="activation_plateau",
            device=ctx.device,
            severity=severity,
            bytes=height,
            start_event=rise_start,
            end_event=fall_end + 1,
            start_us=ctx.time_at(rise_start),
            end_us=ctx.time_at(fall_end),
            step=step_index,
            top_stacks=ctx.top_stacks(live),
            evidence=Evidence(evidence),
            summary=summary,
            recommendation=(
                f"Activation checkpointing: full (per block) would save about {format_bytes(full_saving)}, "
                f"selective about {format_bytes(selective_saving)} (estimates); or a smaller micro-batch with "
                "gradient accumulation, FlashAttention / SDPA, and a chunked loss for large vocabularies."
            ),
            estimated_saving_bytes=full_saving,
        )
    ]


# ----------------------------------------------------------------------------- by module
# The recorder's module scopes (memlens.recorder.module_scopes): each module's forward as a
# START/END pair named after its ``named_modules()`` name; the model itself is ``<root>``.
FORWARD_SCOPE = re.compile(r"^memlens\.forward#(.+)$")
ROOT_MODULE = "<root>"
# Blocks listed by name in the evidence; the rest are counted.
LISTED_BLOCKS = 8
# Other modules (not blocks) named in the evidence.
LISTED_OTHERS = 3


@dataclass
class ModuleActivations:
    """The plateau's bytes by the module whose forward allocated them (innermost scope), and the
    repeated blocks (``layers.0``, ``layers.1``, ...) that hold them."""

    inclusive: dict[str, int]  # module -> bytes allocated inside its forward (its children's too)
    allocations: int  # activation allocations placed in a module
    outside_bytes: int  # activation bytes allocated outside every module's forward
    scopes: int  # forward scopes in the step
    block_parent: str | None  # "layers" when repeated blocks were found
    blocks: list[tuple[str, int]] = field(default_factory=list)  # (module, bytes), in index order
    others: list[tuple[str, int]] = field(default_factory=list)  # other top-level modules, largest first
    theory: LayerTheory | None = None

    def evidence(self, height: int) -> list[EvidenceItem]:
        """Where the plateau was allocated, by module: what holds it (its cause)."""
        found: list[EvidenceItem] = []
        if self.blocks:
            sizes = [size for _, size in self.blocks]
            found += [
                fact("blocks", len(self.blocks), "count", "cause"),
                fact("block_parent", self.block_parent or "", "text", "cause"),
                fact("block_bytes_mean", round(sum(sizes) / len(sizes)), "bytes", "cause"),
                fact("block_bytes_min", min(sizes), "bytes", "cause"),
                fact("block_bytes_max", max(sizes), "bytes", "cause"),
                fact("largest_block", max(self.blocks, key=lambda b: b[1])[0], "text", "cause"),
                fact("blocks_share_of_plateau", round(sum(sizes) / height, 3) if height else 0.0, "ratio", "cause"),
                fact("per_block", _listing(self.blocks, LISTED_BLOCKS), "text", "cause"),
            ]
        if self.others:
            found.append(fact("other_modules", _listing(self.others, LISTED_OTHERS), "text", "cause"))
        found += [
            fact("activation_bytes_in_modules", height - self.outside_bytes, "bytes", "cause"),
            fact("activation_bytes_outside_modules", self.outside_bytes, "bytes", "cause"),
            fact("module_scopes", self.scopes, "count", "context"),
        ]
        if self.theory is not None:
            theory = self.theory
            found += [fact("theory_per_layer_bytes", theory.per_layer_bytes, "bytes", "context")]
            if theory.per_layer_with_scores_bytes is not None:
                found.append(fact("theory_per_layer_with_scores_bytes", theory.per_layer_with_scores_bytes, "bytes",
                                  "context"))
            found += [fact("theory_basis", theory.basis, "text", "context"),
                      fact("theory_layers", theory.layers, "count", "context")]
        return found

    def sentence(self, height: int) -> str:
        if self.blocks:
            sizes = [size for _, size in self.blocks]
            first, last = self.blocks[0][0], self.blocks[-1][0]
            largest = max(self.blocks, key=lambda b: b[1])
            text = (
                f"The {len(self.blocks)} blocks `{first}` ... `{last}` hold {sum(sizes) / height:.0%} of it, "
                f"{format_bytes(round(sum(sizes) / len(sizes)))} each on average (largest `{largest[0]}`, "
                f"{format_bytes(largest[1])})"
            )
        else:
            text = "By module: " + _listing(self.others, LISTED_OTHERS)
        if self.theory is not None:
            text += (f"; the per-layer theory gives {format_bytes(self.theory.per_layer_bytes)} "
                     f"({self.theory.basis})")
            with_scores = self.theory.per_layer_with_scores_bytes
            if with_scores is not None:
                text += f", {format_bytes(with_scores)} with the attention scores materialised"
        return text + "."


def _listing(modules: list[tuple[str, int]], limit: int) -> str:
    text = ", ".join(f"{name} {format_bytes(size)}" for name, size in modules[:limit])
    return text + (f", ... {len(modules) - limit} more" if len(modules) > limit else "")


def activations_by_module(ctx: DeviceContext, live: npt.NDArray[np.bool_], step_start: int,
                          forward_end: int) -> ModuleActivations | None:
    """Where the plateau's activations (``live``, a lifetimes mask) were allocated, by the
    innermost module forward scope in rows ``step_start..forward_end``; None without module
    scopes there."""
    annotations = device_annotations(ctx.snapshot.annotations, ctx.device)
    scopes = [scope for scope in _scopes(annotations, FORWARD_SCOPE) if scope[1] is not None]
    if not scopes or not ctx.trace.has_time:
        return None
    starts, ends = _rows_of_scopes(_search_times(ctx.trace), scopes, ctx.events)
    # Forward scopes of this step's forward (a checkpointed block's recompute runs in backward).
    keep = (starts >= step_start) & (starts <= forward_end)
    if not keep.any():
        return None
    names = [scope[0].split("#", 1)[1] for scope in scopes]
    index = np.flatnonzero(keep)
    # Paint the rows with the innermost scope: outer scopes first (earlier start, later end), so
    # a child's rows overwrite its parent's.
    order = index[np.lexsort((-ends[index], starts[index]))]
    span = forward_end - step_start + 1
    owner = np.full(span, -1, dtype=np.int64)
    for scope in order.tolist():
        lo, hi = max(int(starts[scope]) - step_start, 0), min(int(ends[scope]) - step_start, span)
        if hi > lo:
            owner[lo:hi] = scope
    lt = ctx.lifetimes
    rows = np.flatnonzero(live)
    made = lt.alloc_event[rows]
    inside = (made >= step_start) & (made <= forward_end)
    scope_of = np.full(rows.size, -1, dtype=np.int64)
    scope_of[inside] = owner[made[inside] - step_start]
    sizes = lt.size[rows]
    placed = scope_of >= 0
    exclusive: dict[str, int] = {}
    for scope, size in zip(scope_of[placed].tolist(), sizes[placed].tolist(), strict=True):
        exclusive[names[scope]] = exclusive.get(names[scope], 0) + int(size)
    if not exclusive:
        return None
    inclusive: dict[str, int] = {}
    for name, size in exclusive.items():
        for ancestor in _ancestors(name):
            inclusive[ancestor] = inclusive.get(ancestor, 0) + size
    parent, blocks = _repeated_blocks(inclusive)
    top_level = sorted(((n, b) for n, b in inclusive.items() if n != ROOT_MODULE and "." not in n and n != parent),
                       key=lambda item: (-item[1], item[0]))
    result = ModuleActivations(
        inclusive=inclusive,
        allocations=int(placed.sum()),
        outside_bytes=int(sizes[~placed].sum()),
        scopes=int(keep.sum()),
        block_parent=parent,
        blocks=blocks,
        others=[item for item in top_level if item[1] > 0],
    )
    if blocks:
        result.theory = layer_theory(ctx.snapshot.sidecar, len(blocks))
    return result


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> [``a.b.c``, ``a.b``, ``a``]; the root module counts only for itself."""
    if name == ROOT_MODULE:
        return [name]
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _repeated_blocks(inclusive: dict[str, int]) -> tuple[str | None, list[tuple[str, int]]]:
    """The children ``P.0``, ``P.1``, ... of the parent ``P`` whose numbered children hold the
    most bytes (two at least): a model's stack of layers."""
    families: dict[str, list[tuple[int, str, int]]] = {}
    for name, size in inclusive.items():
        parent, _, last = name.rpartition(".")
        if last.isdigit():
            families.setdefault(parent, []).append((int(last), name, size))
    best: tuple[str, list[tuple[int, str, int]]] | None = None
    for parent, children in families.items():
        if len(children) >= 2 and (best is None or sum(c[2] for c in children) > sum(c[2] for c in best[1])):
            best = (parent, children)
    if best is None:
        return None, []
    return best[0], [(name, size) for _, name, size in sorted(best[1])]


@dataclass(frozen=True)
class LayerTheory:
    """Megatron's activation bytes per transformer layer for the sidecar's shapes."""

    per_layer_bytes: int  # no T x T scores kept (SDPA, FlashAttention)
    basis: str  # the formula and the shapes it was given
    layers: int
    per_layer_with_scores_bytes: int | None = None  # with the scores materialised (needs the heads)


def layer_theory(sidecar: Sidecar | None, layers: int) -> LayerTheory | None:
    """Megatron-LM's per-layer activation bytes (``memlens.budget.formulas``), when the sidecar
    says the batch, the sequence length and the hidden size; fp32 parameters without autocast
    count activations at 4 bytes an element, else 2 (as the budget does for that precision)."""
    from memlens.budget.formulas import megatron_layer_activation_bytes

    model = sidecar.model if sidecar is not None else None
    if model is None or model.inputs is None or model.config.hidden_size is None:
        return None
    config, hidden = model.config, model.config.hidden_size
    fp32 = model.main_dtype == "torch.float32" and model.autocast_dtype in (None, "torch.float32")
    scale = 2.0 if fp32 else 1.0
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    kv_ratio = kv_heads / heads if kv_heads is not None and heads is not None else 1.0
    batch, seq = model.inputs.batch_size, model.inputs.seq_len
    return LayerTheory(
        per_layer_bytes=int(megatron_layer_activation_bytes(
            batch, seq, hidden, None, flash_attention=True, kv_ratio=kv_ratio, bytes_scale=scale)),
        basis=f"Megatron 34*B*T*d with B={batch}, T={seq}, d={hidden}, {'fp32' if fp32 else '16-bit'} activations",
        layers=layers,
        per_layer_with_scores_bytes=int(megatron_layer_activation_bytes(
            batch, seq, hidden, heads, flash_attention=False, kv_ratio=kv_ratio, bytes_scale=scale))
        if heads is not None else None,
    )
