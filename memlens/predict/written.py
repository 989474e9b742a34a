"""A predicted run written as ``memlens record`` writes a recording: the snapshot, its sidecar
(``predicted_sidecar``), and the one-line account of an out-of-memory error (``oom_line``), so
``triage`` says of a prediction what it says of a recording of the same script."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from memlens.recorder.writing import write_sidecar, write_snapshot
from memlens.sidecar.writer import build_sidecar, sidecar_path
from memlens.units import format_bytes

if TYPE_CHECKING:
    from memlens.predict.session import PredictResult, PredictSession
    from memlens.sidecar import ModelInfo, Sidecar

# The whole run's snapshot in the prediction's folder (``memlens triage OUT/predicted.pickle``).
SNAPSHOT_NAME = "predicted.pickle"


def write_prediction(
    predicted: Path, session: PredictSession, result: PredictResult, world_size: int = 1, rank: int = 0
) -> None:
    """The run's snapshot at ``predicted`` and its sidecar beside it; ``world_size`` > 1: the run
    is rank ``rank`` of that many, which is what triage and fleet read from the sidecar."""
    write_snapshot(predicted, result.snapshot or {})
    sidecar = predicted_sidecar(session, result)
    if world_size > 1:
        sidecar = msgspec.structs.replace(sidecar, world_size=world_size, rank=rank)
    write_sidecar(sidecar_path(predicted), sidecar)


def predicted_sidecar(session: PredictSession, result: PredictResult) -> Sidecar:
    """The recorder's sidecar for ``predicted.pickle``: device, peaks, OOM, the steps (one per
    optimizer.step(), as ``memlens record`` marks them), the model (as the recorder's
    ``ModelInspector`` saw it, else the parameters alive at the end) and optimizer, the tensors'
    roles (``tensor_roles``) and who holds a leak (``leak_holders``), all as the recorder writes
    them, so ``triage`` says of a prediction what it says of a recording of the same script."""
    oom = None
    if result.oom:
        oom = {"requested_bytes": result.oom_requested_bytes, "device_free_bytes": session.simulator.device_free_bytes}
    reason = result.interrupted or ("oom" if result.oom else "exception" if result.error else "exit")
    return build_sidecar(
        backend="cpu",
        reason=reason,
        device={
            "type": "cuda",
            "index": 0,
            "name": f"{session.gpu.name} (memlens predict, simulated)",
            "total_memory_bytes": session.capacity,
            "simulated": True,
            "compute_capability": ".".join(str(part) for part in session.gpu.capability),
        },
        allocator_settings=session.settings.to_snapshot_dict(),
        rank=0,
        world_size=1,
        local_rank=0,
        steps=[dict(step) for step in session.steps.steps],
        steps_selected=None,
        peak_allocated_bytes=result.peak_allocated_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes,
        oom=oom,
        model=inspected if (inspected := _inspected_model(session)) is not None else result.model,
        optimizer=result.optimizer,
        recorder={"stacks": session.tracker.stacks is not None, "max_entries": None,
                  "max_stack_depth": None, "dump_every": None, "predict": True},
        tensor_roles=session.roles.to_sidecar(),
        leak_holders=session.leak_holders,
    )  # fmt: skip


def _inspected_model(session: PredictSession) -> ModelInfo | None:
    inspector = session.model_inspector
    return inspector.stats if inspector is not None else None


def oom_line(result: Any) -> str:
    """``OUT OF MEMORY at train.py:12: aten.mm.default asked for 64.00 MiB``; in the backward
    pass, the line that called backward and the forward line whose gradient was computed."""
    request = ""
    if result.oom_op or result.oom_requested_bytes is not None:
        asked = f" asked for {format_bytes(result.oom_requested_bytes)}" if result.oom_requested_bytes else ""
        request = f": {result.oom_op or 'an allocation'}{asked}"
    if result.oom_in_backward:
        gradient = f" of {result.oom_forward_at}" if result.oom_forward_at else " (forward line not known)"
        return (
            f"OUT OF MEMORY in the backward pass called at {result.oom_at or '?'}{request}, "
            f"computing the gradient{gradient}"
        )
    return f"OUT OF MEMORY at {result.oom_at or 'an allocation outside your code'}{request}"


__all__ = ["SNAPSHOT_NAME", "oom_line", "predicted_sidecar", "write_prediction"]
