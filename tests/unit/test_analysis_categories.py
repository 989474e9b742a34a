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


# What a recording with Python-only stacks (memlens record's default) shows of cuBLAS: the forward's
# workspace under F.linear's frame, the one autograd's thread takes with no frame at all.
LINEAR = [{"filename": "/venv/site-packages/torch/nn/modules/linear.py", "line": 134, "name": "forward"},
          {"filename": "/work/proj/train.py", "line": 9, "name": "<module>"}]
CUBLAS_32MIB = 32 * MiB  # the default workspace from Hopper on (CUBLAS_WORKSPACE_CONFIG :4096:8)


def _python_stack_run(parameter_bytes: int, *, leak_linear_outputs: bool = False,
                      gradient_notes: list[int] | None = None) -> dict[str, int]:
    """Three steps of a forward (four 64 MiB activations), a backward that keeps one gradient of
    ``parameter_bytes`` and, in step 0 only, the two workspaces; the categories at the peak.
    ``gradient_notes``: the addresses the recorder's sidecar notes as
    gradients before each step's end (None: no sidecar)."""
    from tests.unit.tracebuilder import MODEL, TraceBuilder

    builder = TraceBuilder()
    builder.ghost(parameter_bytes, MODEL)
    gradient = 0
    records: list[dict[str, object]] = []
    for index in range(3):
        with builder.scope(f"memlens.step#{index}"):
            if index == 0 or leak_linear_outputs:
                builder.alloc(CUBLAS_32MIB, LINEAR)
            activations = [builder.alloc(64 * MiB, MODEL) for _ in range(4)]
            for address in reversed(activations):
                builder.free(address)
            if index == 0:
                builder.alloc(CUBLAS_32MIB)  # autograd's thread: no frames
                gradient = builder.alloc(parameter_bytes)  # also autograd's thread
            if gradient_notes is not None:
                notes = [value for address in gradient_notes or [gradient] for value in (address, parameter_bytes)]
                records.append({"time_us": builder.clock, "at": "optimizer.pre", "device": 0, "gradients": notes})
    sidecar = None if gradient_notes is None else {"memlens_sidecar_version": 2,
                                                   "tensor_roles": {"version": 1, "records": records}}
    return analyze(builder.snapshot(sidecar=sidecar)).device(0).categories_at_peak


def test_cublas_workspaces_of_a_python_stack_recording_are_workspace() -> None:
    """Neither workspace carries a C++ frame: the forward's one shows F.linear, the backward's
    none. By their size (the default workspace), taken once in the first step and never freed,
    they are workspaces; the frameless one was a gradient by phase before."""
    cats = _python_stack_run(2 * MiB)
    assert cats["workspace"] == 2 * CUBLAS_32MIB
    assert cats["gradients"] == 2 * MiB  # only the real gradient
    assert cats["unknown"] == 0


def test_a_frameless_block_the_size_of_a_parameter_stays_a_gradient_without_the_recorders_notes() -> None:
    """A 32 MiB parameter's gradient comes from autograd's thread, frameless, exactly as the
    workspace does: with nothing else to go on it stays a gradient (two of them by phase)."""
    cats = _python_stack_run(CUBLAS_32MIB)
    assert cats["workspace"] == CUBLAS_32MIB  # only the forward's, under F.linear
    assert cats["gradients"] == 2 * CUBLAS_32MIB


def test_the_recorders_gradient_notes_tell_the_workspace_from_a_same_sized_gradient() -> None:
    """With the sidecar's notes of the gradients it saw, the frameless block it did not note is
    the workspace and the one it noted stays a gradient."""
    cats = _python_stack_run(CUBLAS_32MIB, gradient_notes=[])
    assert cats["workspace"] == 2 * CUBLAS_32MIB
    assert cats["gradients"] == CUBLAS_32MIB


def test_a_linear_output_kept_every_step_is_not_a_workspace() -> None:
    """F.linear's 32 MiB outputs kept step after step (a leak) repeat under one stack: a workspace
    is taken once per handle, so none of them is one."""
    cats = _python_stack_run(2 * MiB, leak_linear_outputs=True)
    assert cats["workspace"] == CUBLAS_32MIB  # the frameless one only
    assert cats["gradients"] == 2 * MiB


def test_a_cudnn_convolution_workspace_is_workspace() -> None:
    """cuDNN's convolution plans take a workspace under ``at::native::run_conv_plan`` and free it
    when the convolution returns: a library workspace, not the step's temporary memory."""
    from tests.unit.tracebuilder import MODEL, TraceBuilder, frame

    conv = [frame("at::native::run_conv_plan(cudnnContext*, at::Tensor const&, at::Tensor const&)",
                  "aten/src/ATen/native/cudnn/Conv_v8.cpp", 0), *MODEL]
    builder = TraceBuilder()
    builder.ghost(2 * MiB, MODEL)
    with builder.scope("memlens.step#0"):
        activations = [builder.alloc(64 * MiB, MODEL) for _ in range(2)]
        builder.free(builder.alloc(250 * MiB + 808 * 1024, conv))
        for address in activations:
            builder.free(address)
    device = analyze(builder.snapshot()).device(0)
    assert device.top_stacks_by_category["workspace"][0].bytes == 250 * MiB + 808 * 1024
    assert device.top_stacks_by_category["temporary"] == []


def test_a_block_the_recorder_did_not_note_as_a_gradient_is_not_guessed_one() -> None:
    """A frameless 6 MiB block kept from the backward (not a workspace's size) would be a gradient
    by its phase; the recorder noted the step's gradients and not it, so it stays unknown."""
    from tests.unit.tracebuilder import MODEL, TraceBuilder

    builder = TraceBuilder()
    builder.ghost(2 * MiB, MODEL)
    records: list[dict[str, object]] = []
    for index in range(2):
        with builder.scope(f"memlens.step#{index}"):
            activations = [builder.alloc(64 * MiB, MODEL) for _ in range(4)]
            for address in reversed(activations):
                builder.free(address)
            if index == 0:
                gradient = builder.alloc(2 * MiB)
                builder.alloc(6 * MiB)  # autograd's thread, no frames: not seen by the recorder
            records.append({"time_us": builder.clock, "at": "optimizer.pre", "device": 0,
                            "gradients": [gradient, 2 * MiB]})
    sidecar = {"memlens_sidecar_version": 2, "tensor_roles": {"version": 1, "records": records}}
    cats = analyze(builder.snapshot(sidecar=sidecar)).device(0).categories_at_peak
    assert cats["gradients"] == 2 * MiB
    assert cats["unknown"] == 6 * MiB
    without_notes = analyze(builder.snapshot()).device(0).categories_at_peak
    assert without_notes["gradients"] == 8 * MiB  # a snapshot from elsewhere keeps the inference
