"""Analysis settings and the thresholds every finding uses, each with the reason for its value.

Thresholds are module constants so the CLI, the app and the tests can quote them; the few a
user may want to change per run live on ``AnalysisSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlens.units import MiB, capacity_bytes

# --------------------------------------------------------------------------- steps

# Periodic step inference works on the allocated curve resampled to this many bins: enough to
# resolve ~1000 steps in a window, small enough that the FFT autocorrelation costs microseconds.
PERIODIC_BINS = 4096
# The autocorrelation peak must reach this (1.0 = identical periods). Training steps repeat the
# same kernels with the same sizes, so real loops score > 0.8; a single forward/backward (one
# triangle) or per-layer ripples on a ramp stay well below 0.5.
PERIODIC_MIN_AUTOCORR = 0.6
# Fewer than three repetitions is not evidence of a loop (two bumps can be anything).
PERIODIC_MIN_STEPS = 3

# --------------------------------------------------------------------------- leak

# Step 1 (warm-up) creates gradients and optimizer state (and the caching allocator warms up), so
# it is never compared: leaks are judged on the steps after it.
LEAK_WARMUP_STEPS = 1
# A stack leaks when survivors from at least this many of its steps are alive at one step's end.
# Gradients and handed-over tensors (``prev = out``) hold one step's worth; a prefetch queue two;
# a kept list holds every step's. Three separates a pile from a hand-over.
LEAK_MIN_KEPT_STEPS = 3
# ...but a window of fewer comparable steps than this cannot show three: two steps kept together
# is all a short run can show (the README's ``steps=range(2, 6)`` leaves three comparable steps).
LEAK_SHORT_RUN_STEPS = 4
LEAK_MIN_KEPT_STEPS_SHORT_RUN = 2
# The stack must leave survivors in at least this share of the comparable steps: a leak made
# every step or every other step qualifies; a one-off cache filled in one step does not.
LEAK_MIN_RECURRING_SHARE = 0.5
# Steps until the device is full (capacity known) or until the leak adds another peak's worth.
# Training runs last 10^4-10^6 steps: a leak that fills the device within a thousand steps (about
# a quarter of an hour at a step a second) kills every run; within 10^5 (a day) it kills most.
LEAK_HIGH_SEVERITY_STEPS_LEFT = 1_000
LEAK_MEDIUM_SEVERITY_STEPS_LEFT = 100_000

# --------------------------------------------------------------------------- activations

# Any plateau this large and this share of the peak is reported (severity says how much it
# matters): under 16 MiB no device is short of it, and under 5% of the peak checkpointing cannot
# change whether a job fits. A 5.6 GB plateau at 11% of a 51 GB peak is worth knowing.
ACTIVATION_MIN_BYTES = 16 * MiB
ACTIVATION_MIN_FRACTION_OF_PEAK = 0.05
# Above half the peak the plateau is the thing to fix first; from a fifth, checkpointing's +33%
# compute buys a real share of the device; below that it is worth knowing, not urgent.
ACTIVATION_HIGH_SEVERITY_FRACTION = 0.5
ACTIVATION_MEDIUM_SEVERITY_FRACTION = 0.2
# memory-budget.md: the rule of thumb stores 24*B*T*d bytes per layer (12 elements, 16-bit);
# full checkpointing keeps only each block's input, 2*B*T*d bytes: 1/12 of it.
FULL_CHECKPOINT_KEEP_FRACTION = 1 / 12
# Selective checkpointing recomputes elementwise and normalisation outputs and keeps matmul and
# attention outputs. In Megatron's 34*s*b*h per-layer count the elementwise/normalisation part
# (GeLU input 8, layer-norm inputs 4, dropout masks 2) is ~14/34, so ~60% stays. An estimate.
SELECTIVE_CHECKPOINT_KEEP_FRACTION = 0.6

# --------------------------------------------------------------------------- optimizer

# Below this the optimizer's bytes are not worth a finding (a few scalar step counters).
OPTIMIZER_MIN_BYTES = 16 * MiB
OPTIMIZER_MIN_FRACTION_OF_PEAK = 0.05
# When the global peak falls inside optimizer.step the spike *is* the peak: high severity.
# Adam keeps two fp32 moments per parameter (memory-budget.md): 8 bytes per parameter.
ADAM_STATE_BYTES_PER_PARAM = 8
# Parameters are fp32 unless told otherwise (torch's default dtype); used only to turn the
# parameters category's bytes into a parameter count when the sidecar has none.
DEFAULT_BYTES_PER_PARAM = 4

# --------------------------------------------------------------------------- fragmentation

# Blocked cudaMallocs (made while their pool held the request free, but in no block large enough)
# must add up to at least this much and this share of peak reserved: a few 2 MiB small-pool
# segments, or one 20 MiB segment in a multi-GiB run, change nothing worth a setting.
FRAGMENTATION_MIN_BYTES = 128 * MiB
FRAGMENTATION_MIN_BLOCKED_FRACTION = 0.05
# A replay saving of this share of the device (or, capacity unknown, of peak reserved) is worth
# changing the allocator's settings for at once.
FRAGMENTATION_HIGH_SAVING_FRACTION = 0.1
# State only (no history, no requests): the pieces inside partly used segments must be at least
# FRAGMENTATION_MIN_BYTES and this share of reserved; the caching allocator normally keeps 5-15%.
FRAGMENTATION_MIN_FRACTION = 0.2
# Idle cache (entirely free segments at dump time) is reported from this much and this share of
# reserved: below it, it is the ordinary slack of a warm cache. It is never lost to the process
# (the allocator releases it before an OOM), so it is only "medium" when it holds this share of
# a known capacity that another process or phase could use.
IDLE_CACHE_MIN_BYTES = 128 * MiB
IDLE_CACHE_MIN_FRACTION = 0.25
IDLE_CACHE_MEDIUM_FRACTION = 0.25
# The caching allocator rounds every request up to a multiple of 512 bytes.
ALLOCATOR_ROUNDING = 512

# --------------------------------------------------------------------------- oom

# A state-only snapshot whose reserved memory is this close to the device's capacity was most
# likely dumped at (or just before) an out-of-memory error.
OOM_NEAR_CAPACITY_FRACTION = 0.95

# --------------------------------------------------------------------------- display

TOP_STACKS = 5
MAX_FRAMES_PER_STACK = 8


@dataclass(frozen=True)
class AnalysisSettings:
    """What a user can set per run (``memlens.analyze(path, capacity="80GiB", device=0)``)."""

    capacity: int | None = None
    device: int | None = None
    bytes_per_param: int = DEFAULT_BYTES_PER_PARAM
    top_stacks: int = TOP_STACKS

    @classmethod
    def from_kwargs(cls, **settings: Any) -> AnalysisSettings:
        from memlens.errors import MemlensUsageError

        known = {"capacity", "device", "bytes_per_param", "top_stacks"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise MemlensUsageError(f"unknown analysis setting(s): {', '.join(unknown)}")
        capacity = settings.get("capacity")
        return cls(
            capacity=None if capacity is None else capacity_bytes(capacity),
            device=settings.get("device"),
            bytes_per_param=int(settings.get("bytes_per_param") or DEFAULT_BYTES_PER_PARAM),
            top_stacks=int(settings.get("top_stacks") or TOP_STACKS),
        )
