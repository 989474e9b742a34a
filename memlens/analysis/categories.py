"""What each allocation is: parameters, gradients, optimizer state, activations, temporaries.

Recorded, where memlens recorded the snapshot: the recorder's sidecar lists the storages it knew
by role at each step boundary (``tensor_roles``, see ``memlens.recorder.roles``), and
``classify`` gives each block a role covers its category ahead of any inference: parameters and
buffers ``parameters``, gradients ``gradients``, optimizer state ``optimizer_state``, the model's
inputs and outputs and what live autograd graphs hold ``activations``. A note matches the block that held its
address at its moment (the last trace row at or before its ``time_us``; a dump's notes, the end
of the trace). Blocks no note covers, and every block of a snapshot from elsewhere, keep the
inference below.

Inferred from lifetime, phase and stack, per allocation (vectorised over all lifetimes):
- live at the window's start and never freed, or made before the first step and kept across
  it: ``parameters`` (and other model state);
- made inside optimizer.step and kept after it: ``optimizer_state``; freed inside it: ``temporary``;
- made in the forward part of a step (up to its forward peak) and freed later in the step:
  ``activations``; freed before the forward peak: ``temporary``;
- made in backward (under autograd's ``backward`` frames, or between the forward peak and the
  first optimizer.step row of the step) and kept past the end of backward (into optimizer.step
  or the next step): ``gradients``; freed by then: ``temporary``;
- made after backward ended (after optimizer.step began, outside it, with no backward frames,
  e.g. a held-out forward pass at the end of the step): freed inside the step ``temporary``,
  kept past the step ``unknown``. Such blocks are often activations kept alive by a retained
  graph (``losses.append(loss)``), but the trace cannot tell them from logged outputs or caches
  made at the same point, and they are not the gradients of the step: calling them gradients
  would inflate the budget's gradient line. The leak finding names their stacks;
- anything else (e.g. forward outputs kept across steps): ``unknown``.

Workspace, from the allocation's own frames and ahead of the inference: a block allocated by
PyTorch's cuBLAS handle pool (``at::cuda::getNewWorkspace``/``getCurrentCUDABlasHandle``, C++
frames of a ``stacks="all"`` recording, and the frame memlens predict gives the workspaces it
models) is a library ``workspace``, kept for the process's life: one taken on autograd's thread,
with no Python frame, is not guessed to be a gradient by the phase it falls in. So is a cuDNN
convolution's (``at::native::run_conv_plan``), freed when the convolution returns. A recording
without C++ frames shows a cuBLAS workspace by its evidence instead (``untraced_cublas_workspaces``):
the default workspace's size, never freed, taken by the first step's end, once, by torch's
``F.linear`` frames or, with no frames at all, in a backward where no parameter (or, with the
recorder's notes, no noted gradient) explains it. And where the recorder noted the gradients it
saw in a step, a block of that step the phase would call a gradient and the recorder did not note
stays unknown (``unnoted_gradients``).

Leaked, after the inference: the leak finder (``memlens.analysis.leak``) gives the blocks of a
leak it found, that neither a recorded role nor the inference above named, the category
``leaked``: what its stacks (and the holder the recorder named) keep from step to step.

The forward peak of a step is the peak of its *step-local* memory (allocations freed inside
the same step), so gradients and optimizer state never move it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memlens.analysis.datatypes import CATEGORIES, PeakPhase, Step
from memlens.analysis.lifetimes import Lifetimes, lifetime_ranges
from memlens.analysis.stacks import StackFacts, calls_cublas_from_python
from memlens.sidecar import TensorRoles

I64 = npt.NDArray[np.int64]
PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARY, WORKSPACE, LEAKED, UNKNOWN = range(len(CATEGORIES))

# The block PyTorch's cuBLAS handle pool takes when CUBLAS_WORKSPACE_CONFIG is unset
# (CublasHandlePool.cpp, getChosenWorkspaceSize: the sum of its :SIZE_KiB:COUNT pairs): ":4096:8",
# 32 MiB, from Hopper on (an H200 recording holds two); ":4096:2:16:8", 8 MiB + 128 KiB, before it.
# memlens.predict.gpus.default_cublas_workspace_bytes models the same two.
CUBLAS_DEFAULT_WORKSPACE_BYTES = (8 * 4096 * 1024, 2 * 4096 * 1024 + 8 * 16 * 1024)


@dataclass
class Phases:
    """Per phase-step arrays (steps, or the whole window as one pseudo-step)."""

    start: I64
    end: I64
    forward_peak: I64  # row where step-local memory peaks: the end of forward
    backward_end: I64  # first optimizer row inside the step, else the step's end
    opt_start: I64  # optimizer windows, sorted
    opt_end: I64

    def step_of(self, events: I64) -> I64:
        """Index of the phase-step holding each row, -1 where none does."""
        k = np.searchsorted(self.start, events, side="right") - 1
        valid = (k >= 0) & (events >= 0)
        k_safe = np.where(valid, k, 0)
        inside = valid & (events < self.end[k_safe]) if self.end.size else np.zeros(events.shape, dtype=bool)
        return np.where(inside, k, -1)

    def phase_of(self, event: int) -> PeakPhase:
        """The phase of one trace row: forward before the step-local peak, backward from it to
        the step's first optimizer row, then the optimizer's window and what follows it."""
        rows = np.array([event], dtype=np.int64)
        if self.optimizer_window_of(rows)[0] >= 0:
            return "optimizer"
        k = int(self.step_of(rows)[0])
        if k < 0:
            return "outside_steps"
        if event < self.forward_peak[k]:
            return "forward"
        return "backward" if event < self.backward_end[k] else "after_optimizer"

    def optimizer_window_of(self, events: I64) -> I64:
        if self.opt_start.size == 0:
            return np.full(events.shape, -1, dtype=np.int64)
        k = np.searchsorted(self.opt_start, events, side="right") - 1
        valid = (k >= 0) & (events >= 0)
        k_safe = np.where(valid, k, 0)
        return np.where(valid & (events < self.opt_end[k_safe]), k, -1)


def build_phases(
    steps: list[Step], events: int, windows: list[tuple[int, int]], lifetimes: Lifetimes
) -> Phases:
    if not steps and events:
        steps = [Step(0, 0, events, None, None, True)]
    start = np.array([s.start_event for s in steps], dtype=np.int64)
    end = np.array([s.end_event for s in steps], dtype=np.int64)
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    windows = sorted(windows)
    opt_start = np.array([w[0] for w in windows], dtype=np.int64)
    opt_end = np.array([w[1] for w in windows], dtype=np.int64)
    backward_end = end.copy()
    if opt_start.size:
        first_opt = np.searchsorted(opt_start, start, side="left")
        has = first_opt < opt_start.size
        candidate = np.where(has, opt_start[np.minimum(first_opt, opt_start.size - 1)], end)
        use = has & (candidate < end) & (candidate > start)
        backward_end = np.where(use, candidate, end)
    phases = Phases(start, end, start.copy(), backward_end, opt_start, opt_end)
    if events == 0 or start.size == 0:
        return phases
    # Step-local memory: lifetimes made and freed inside one step, outside optimizer.step.
    # Their bytes added at the alloc's row and taken away at the free's, a range of lifetimes at a
    # time (a few temporaries per lifetime, none per row). A row allocates or frees at most one
    # block, so each row's change is one size, exact in float64 in any order of summing.
    a, f = lifetimes.alloc_event, lifetimes.free_event
    delta = np.zeros(events + 1, dtype=np.float64)
    for at in lifetime_ranges(a.size):
        a_range, f_range = a[at], f[at]
        step_a = phases.step_of(a_range)
        local = ((step_a >= 0) & (phases.step_of(np.minimum(f_range, events - 1)) == step_a) & (f_range < events)
                 & (phases.optimizer_window_of(a_range) < 0))
        weights = lifetimes.size[at][local].astype(np.float64)
        np.add.at(delta, a_range[local], weights)
        np.subtract.at(delta, f_range[local], weights)
    curve = np.cumsum(delta[:events], out=delta[:events])
    peaks = start.copy()
    # Steps do not overlap in real files; where they do (START scopes never closed, say 500,000
    # of them), each range stops at the next step's start so the argmaxes stay linear in rows.
    next_start = np.append(start[1:], events)
    for k in range(start.size):  # one argmax per step, not per row
        lo, hi = int(start[k]), int(backward_end[k])
        if hi <= lo:
            hi = int(end[k])
        hi = min(hi, max(int(next_start[k]), lo + 1))
        if hi > lo:
            peaks[k] = lo + int(np.argmax(curve[lo:hi]))
    phases.forward_peak = peaks
    return phases


# The recorder's roles (memlens.recorder.roles.ROLES) as categories, highest priority first.
ROLE_CATEGORIES: dict[str, int] = {
    "parameters": PARAMETERS,
    "buffers": PARAMETERS,
    "gradients": GRADIENTS,
    "optimizer_state": OPTIMIZER_STATE,
    "inputs": ACTIVATIONS,
    "outputs": ACTIVATIONS,
    "graph": ACTIVATIONS,
}


@dataclass
class RecordedRoles:
    """The recorder's notes for one device: the trace row each was taken after, the address,
    and the category its role gives."""

    row: I64
    address: I64
    category: npt.NDArray[np.int8]

    def __len__(self) -> int:
        return int(self.row.shape[0])


def recorded_roles(roles: TensorRoles | None, device: int, time_us: I64) -> RecordedRoles | None:
    """The sidecar's ``tensor_roles`` notes for ``device`` against its trace's ``time_us`` column,
    or None when the sidecar has none (a snapshot memlens did not record). The sidecar's reader
    has checked their types; the notes only ever sharpen what inference would say."""
    if roles is None:
        return None
    n = int(time_us.shape[0])
    rows: list[int] = []
    addresses: list[int] = []
    categories: list[int] = []
    for record in roles.records:
        if record.device != device:
            continue
        # time_us None: at the dump, the end of the trace
        row = n - 1 if record.time_us is None else int(np.searchsorted(time_us, record.time_us, side="right")) - 1
        for role, category in ROLE_CATEGORIES.items():
            found = getattr(record, role)[0::2]
            rows.extend([row] * len(found))
            addresses.extend(found)
            categories.extend([category] * len(found))
    return RecordedRoles(
        np.array(rows, dtype=np.int64),
        np.array(addresses, dtype=np.int64),
        np.array(categories, dtype=np.int8),
    )


def match_roles(lifetimes: Lifetimes, roles: RecordedRoles) -> tuple[I64, npt.NDArray[np.int8]]:
    """(lifetime index, category) for every note that names a block live at its row: the
    lifetime at that address with the latest alloc at or before the row, still live after it."""
    if len(roles) == 0 or len(lifetimes) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8)
    addresses, group = np.unique(lifetimes.address, return_inverse=True)
    stride = np.int64(lifetimes.events + 2)  # alloc_event + 1 lies in [0, events + 1)
    keys = group.astype(np.int64) * stride + (lifetimes.alloc_event + 1)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    note_group = np.searchsorted(addresses, roles.address)
    known = note_group < addresses.size
    known &= addresses[np.minimum(note_group, addresses.size - 1)] == roles.address
    row = np.clip(roles.row, -1, lifetimes.events)
    note_keys = note_group.astype(np.int64) * stride + (row + 1)
    position = np.searchsorted(sorted_keys, note_keys, side="right") - 1
    valid = known & (position >= 0)
    candidate = order[np.maximum(position, 0)]
    valid &= group[candidate] == note_group
    valid &= lifetimes.free_event[candidate] > row
    return candidate[valid], roles.category[valid]


def apply_roles(category: npt.NDArray[np.int8], lifetimes: Lifetimes, roles: RecordedRoles | None) -> int:
    """Overwrite ``category`` where a recorded role covers the block; returns how many blocks.
    A block noted under several roles takes the first in ``ROLE_CATEGORIES``' order."""
    if roles is None:
        return 0
    index, role_category = match_roles(lifetimes, roles)
    if index.size == 0:
        return 0
    priority = {code: rank for rank, code in enumerate(dict.fromkeys(ROLE_CATEGORIES.values()))}
    rank = np.array([priority[int(code)] for code in role_category], dtype=np.int64)
    # Highest priority last, so that it is the one written.
    order = np.argsort(-rank, kind="stable")
    category[index[order]] = role_category[order]
    return int(np.unique(index).size)


def classify(
    lifetimes: Lifetimes, phases: Phases, facts: StackFacts, has_history: bool, roles: RecordedRoles | None = None
) -> npt.NDArray[np.int8]:
    """Category code (index into ``CATEGORIES``) of every lifetime: recorded roles first, then
    inference for the rest."""
    category = _infer(lifetimes, phases, facts, has_history)
    category[facts.workspace[lifetimes.stack_id]] = WORKSPACE
    if has_history:
        saw_gradients = roles is not None and bool((roles.category == GRADIENTS).any())
        category[untraced_cublas_workspaces(lifetimes, phases, facts, category, saw_gradients)] = WORKSPACE
        category[unnoted_gradients(category, lifetimes, phases, roles)] = UNKNOWN
    apply_roles(category, lifetimes, roles)  # gives the gradients it noted back their role
    return category


def unnoted_gradients(category: npt.NDArray[np.int8], lifetimes: Lifetimes, phases: Phases,
                      roles: RecordedRoles | None) -> npt.NDArray[np.bool_]:
    """The blocks the phase inference calls gradients in a step where the recorder noted the
    gradients it saw (at ``optimizer.pre``, every ``.grad`` of the optimizer's parameters): a
    gradient is noted there, so one it did not note is not guessed to be one (it stays unknown;
    ``apply_roles`` then gives the noted ones their role). Steps without such a note, and
    snapshots without the recorder's sidecar, keep the inference."""
    none = np.zeros(len(lifetimes), dtype=bool)
    if roles is None or phases.start.size == 0:
        return none
    noted_steps = np.unique(phases.step_of(roles.row[roles.category == GRADIENTS]))
    noted_steps = noted_steps[noted_steps >= 0]
    if noted_steps.size == 0:
        return none
    made_in = phases.step_of(np.where(lifetimes.alloc_event >= 0, lifetimes.alloc_event, -1))
    return (category == GRADIENTS) & np.isin(made_in, noted_steps)


def untraced_cublas_workspaces(lifetimes: Lifetimes, phases: Phases, facts: StackFacts,
                               category: npt.NDArray[np.int8], saw_gradients: bool) -> npt.NDArray[np.bool_]:
    """The cuBLAS workspaces of a recording whose stacks carry no C++ frames (``stacks="python"``,
    what ``memlens record`` and most scripts ask for), where ``is_workspace_frame`` has nothing to
    see. A block is one when all of these hold:

    - its size is a default cuBLAS workspace (``CUBLAS_DEFAULT_WORKSPACE_BYTES``), it was taken in
      the window no later than the first step's end (a handle's first matmul) and never freed;
    - no block of its stack and size made in a later step outlives that step (a workspace is
      taken once per handle; a forward output kept every step, a leak, repeats);
    - its stack is Python frames only, the innermost in one of torch's cuBLAS callers (F.linear's
      module, the functional wrappers), or it has no frames and was taken in the backward part of
      its step: autograd's engine thread, which has no Python frames, taking its own handle's.
      Gradients come from that thread with the same empty stack, so a frameless block is a
      workspace only where it cannot be a gradient: no parameter has its size (a gradient has its
      parameter's), or the recorder noted the gradients it saw (``saw_gradients``; ``apply_roles``
      then gives the ones it noted back their role, so none is lost).

    ``category`` is the inference so far (its parameters are read); returns a mask over lifetimes.
    """
    a, f, size = lifetimes.alloc_event, lifetimes.free_event, lifetimes.size
    found = np.zeros(len(lifetimes), dtype=bool)
    if phases.start.size == 0 or len(lifetimes) == 0:
        return found
    sized = np.isin(size, CUBLAS_DEFAULT_WORKSPACE_BYTES)
    candidate = sized & (a >= 0) & (f >= lifetimes.events) & (a < phases.end[0])
    if not candidate.any():
        return found
    # Blocks made after the first step that outlive the step they were made in (never freed,
    # when made outside every step): a stack and size found among them again is no workspace.
    k = phases.step_of(np.where(a >= 0, a, -1))
    step_end = np.where(k >= 0, phases.end[np.maximum(k, 0)], lifetimes.events)
    outliving = sized & (a >= phases.end[0]) & (f >= step_end)
    # (Only blocks of the workspace sizes are compared, so the key cannot collide.)
    stack_size = lifetimes.stack_id.astype(np.int64) * (1 << 40) + size
    candidate &= ~np.isin(stack_size, np.unique(stack_size[outliving]))
    index = np.nonzero(candidate)[0]
    stack_ids = lifetimes.stack_id[index]
    framed: list[int] = []
    frameless: list[int] = []
    for stack_id in np.unique(stack_ids).tolist():  # once per distinct stack
        frames = facts.table.innermost(stack_id)
        if not frames:
            frameless.append(stack_id)
        elif calls_cublas_from_python(frames):
            framed.append(stack_id)
    ks = np.maximum(k[index], 0)
    on_engine_thread = (np.isin(stack_ids, frameless) & (k[index] >= 0) & (a[index] > phases.forward_peak[ks])
                        & (a[index] < phases.backward_end[ks]))
    if not saw_gradients:
        on_engine_thread &= ~np.isin(size[index], size[category == PARAMETERS])
    found[index[np.isin(stack_ids, framed) | on_engine_thread]] = True
    return found


def _infer(lifetimes: Lifetimes, phases: Phases, facts: StackFacts, has_history: bool) -> npt.NDArray[np.int8]:
    category = np.full(len(lifetimes), UNKNOWN, dtype=np.int8)
    if not has_history:
        return category  # a state-only snapshot: nothing tells what a block is
    for at in lifetime_ranges(category.size):
        _infer_range(category[at], lifetimes.alloc_event[at], lifetimes.free_event[at], lifetimes.stack_id[at],
                     lifetimes.events, phases, facts)
    return category


def _infer_range(category: npt.NDArray[np.int8], a: I64, f: I64, stack_id: npt.NDArray[np.int32], n: int,
                 phases: Phases, facts: StackFacts) -> None:
    """The categories of one range of lifetimes (allocated at rows ``a``, freed at ``f``), in place."""
    ghost = a < 0
    category[ghost & (f >= n)] = PARAMETERS
    # Blocks made before the window under optimizer frames are its state (e.g. Adam moments).
    category[ghost & (f >= n) & facts.optimizer[stack_id]] = OPTIMIZER_STATE
    # A ghost freed during a step's backward was an activation of a step the window cut.
    ghost_freed = ghost & (f < n)
    k_free = phases.step_of(np.where(ghost_freed, f, -1))
    kf = np.maximum(k_free, 0)
    if phases.start.size:
        in_backward = ghost_freed & (k_free >= 0) & (f > phases.forward_peak[kf]) & (f <= phases.backward_end[kf])
        category[in_backward] = ACTIVATIONS

    made = ~ghost
    window = phases.optimizer_window_of(np.where(made, a, -1))
    in_opt = made & (window >= 0)
    if phases.opt_end.size:
        kept = f >= phases.opt_end[np.maximum(window, 0)]
        category[in_opt & kept] = OPTIMIZER_STATE
        category[in_opt & ~kept] = TEMPORARY

    rest = made & ~in_opt
    if phases.start.size == 0:
        return
    k = phases.step_of(np.where(rest, a, -1))
    first_start = int(phases.start[0])
    before = rest & (k < 0) & (a < first_start)
    category[before & (f >= phases.end[0])] = PARAMETERS
    category[before & (f < phases.end[0])] = TEMPORARY
    between = rest & (k < 0) & (a >= first_start)
    next_start_idx = np.searchsorted(phases.start, a, side="right")
    next_start = np.where(next_start_idx < phases.start.size,
                          phases.start[np.minimum(next_start_idx, phases.start.size - 1)], n)
    category[between & (f <= next_start)] = TEMPORARY

    in_step = rest & (k >= 0)
    ks = np.maximum(k, 0)
    peak = phases.forward_peak[ks]
    end = phases.end[ks]
    backward_end = phases.backward_end[ks]
    backward_stack = facts.backward[stack_id]
    forward = in_step & (a <= peak) & ~backward_stack
    # Backward: under autograd's frames, or (stacks or not) between the forward peak and the
    # first optimizer row. Rows after optimizer.step began (outside it) are not backward.
    backward = in_step & (backward_stack | ((a > peak) & (a < backward_end)))
    after_backward = in_step & ~forward & ~backward
    category[forward & (f <= peak)] = TEMPORARY
    category[forward & (f > peak) & (f < end)] = ACTIVATIONS
    category[backward & (f <= backward_end)] = TEMPORARY
    category[backward & (f > backward_end)] = GRADIENTS
    # Made after backward (e.g. an evaluation forward after optimizer.step): freed inside the
    # step it is a temporary; kept past the step it stays unknown (see the module docstring).
    category[after_backward & (f < end)] = TEMPORARY


def bytes_by_category(category: npt.NDArray[np.int8], size: I64, mask: npt.NDArray[np.bool_]) -> dict[str, int]:
    totals = np.bincount(category[mask].astype(np.int64), weights=size[mask].astype(np.float64),
                         minlength=len(CATEGORIES))
    return {name: round(totals[i]) for i, name in enumerate(CATEGORIES)}
