"""Categories at the peak and per allocation."""

from __future__ import annotations

from memlens.analysis import CATEGORIES, analyze, analyze_snapshot
from tests.unit.tracebuilder import MiB, training_run


def test_categories_of_a_training_loop() -> None:
    analysis = analyze_snapshot(training_run(3).snapshot())
    device = analysis.device(0)
    cats = device.categories_at_peak
    assert set(cats) == set(CATEGORIES)
    assert sum(cats.values()) == device.peak_allocated_bytes
    assert cats["parameters"] == 4 * 32 * MiB
    assert cats["activations"] == 8 * 64 * MiB
    assert cats["gradients"] == 4 * 32 * MiB  # made in step 1's backward, kept
    assert cats["optimizer_state"] == 8 * 32 * MiB  # two moments per parameter
    assert device.top_stacks_by_category["activations"][0].frames[0].startswith("forward (/work/proj/model.py")
    assert len(analysis.category_of_event(0)) == device.events


def test_state_only_snapshot_is_all_unknown() -> None:
    from tests.unit.tracebuilder import TraceBuilder

    b = TraceBuilder()
    b.ghost(10 * MiB)
    device = analyze(b.snapshot()).device(0)
    assert device.events == 0
    assert device.categories_at_peak["unknown"] == 10 * MiB
    assert device.peak_allocated_bytes == 10 * MiB


def test_forward_after_optimizer_kept_across_steps_is_not_gradients() -> None:
    """A held-out forward after optimizer.step whose outputs are kept (``losses.append(loss)``):
    made outside backward, no backward frames, outliving the step: never gradients; unknown to
    the inference, and leaked where the leak finder sees them pile up (steps 2 and 3, the
    comparable ones: no holder names step 1's)."""
    from tests.unit.tracebuilder import MODEL, TEMP, TraceBuilder

    b = TraceBuilder()
    params = [b.ghost(32 * MiB, MODEL) for _ in range(4)]
    grads: list[int] = []
    state: list[int] = []
    for step in range(1, 4):
        with b.scope(f"memlens.step#{step}"):
            b.train_step([64 * MiB] * 8, params, grads, state, 16 * MiB)
            b.alloc(8 * MiB, MODEL)  # kept: the held-out graph's activations
            b.free(b.alloc(4 * MiB, TEMP))  # a temporary of the held-out forward
    analysis = analyze_snapshot(b.snapshot())
    device = analysis.device(0)
    category_of_event = analysis.category_of_event(0)
    rows = [i for i, e in enumerate(b.trace) if e["action"] == "alloc" and e["size"] in (8 * MiB, 4 * MiB)]
    names = [CATEGORIES[category_of_event[i]] for i in rows]
    assert names == ["unknown", "temporary", "leaked", "temporary", "leaked", "temporary"]
    assert device.categories_at_peak["gradients"] == 4 * 32 * MiB  # the real ones are still found


def test_a_cublas_workspace_is_its_own_category_never_a_gradient() -> None:
    """The workspace autograd's thread takes at the first backward matmul has no Python frame and
    lives on: by its phase it would be a gradient. Its own C++ frame (what a CUDA recording with
    C++ stacks shows, and what memlens predict writes) says it is a library workspace."""
    from tests.unit.tracebuilder import MODEL, TraceBuilder, frame

    builder = TraceBuilder()
    builder.ghost(32 * MiB, MODEL)
    workspace_frames = [frame("at::cuda::getNewWorkspace()", "aten/src/ATen/cuda/CublasHandlePool.cpp", 0)]
    for index in range(3):
        with builder.scope(f"memlens.step#{index}"):
            activations = [builder.alloc(64 * MiB, MODEL) for _ in range(4)]
            if index == 0:
                builder.alloc(32 * MiB, workspace_frames)
            for address in reversed(activations):
                builder.free(address)
    cats = analyze(builder.snapshot()).device(0).categories_at_peak
    assert cats["workspace"] == 32 * MiB
    assert cats["gradients"] == 0
    assert cats["parameters"] == 32 * MiB
