"""One configuration of a plan, predicted in a process of its own.

``run_in_child`` (or ``python -m memlens.plan.child JOB.json``): installs the configuration's levers, runs the script
under predict (as ``memlens predict`` does: the same session, the same snapshot and sidecar),
counts the run's floating-point operations (``torch.utils.flop_counter``'s formulas: what
checkpointing recomputes shows there), and writes ``plan_result.json`` next to the snapshot. A fresh process
per configuration: predict needs a process whose autograd engine has not started, and the
levers patch classes for the whole process.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from memlens.plan.configurations import ChildJob, ChildResult
from memlens.sidecar import ModelInfo, OptimizerInfo

if TYPE_CHECKING:
    from memlens.predict.session import PredictResult

# How a configuration's problem starts when a lever found nothing to act on (plan's table says so).
NOT_APPLIED = "not applied: "

RESULT_NAME = "plan_result.json"


class FlopCount:
    """Counts the run's floating-point operations with ``torch.utils.flop_counter``'s formulas
    (matmuls, convolutions, attention). Not ``FlopCounterMode`` itself: its module tracker
    keeps what checkpointing frees alive, so a checkpointed run would be predicted too large."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self
        self.total = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                formula = flop_registry.get(func._overloadpacket)
                if formula is not None:
                    counter.total += int(formula(*args, **kwargs, out_val=out))
                return out

        self.mode = Mode()


class TrainingState:
    """The model and optimizer a training loop held at its last step, kept alive until the rank's
    figures are read (``held_bytes``) and its snapshot written.

    Tutorials train inside ``def main()``: once it returns, the optimizer (and, under DDP or TP,
    the model) is freed, and a rank read at the script's end held nothing, where its GPU held
    12 bytes per owned parameter throughout training. So, while the script runs, the optimizers
    that step (a global step post-hook) are kept, and so are the outermost modules called since
    the step before (global forward hooks): what the last step trained. A model the script
    dropped for another before its last step is not kept. Nothing kept is freed later than the
    script's end, so no peak changes; the end of the run reads as the end of its last step."""

    def __init__(self) -> None:
        self.optimizers: dict[int, Any] = {}
        self.models: dict[int, Any] = {}  # the outermost modules called in the last step
        self._called: dict[int, Any] = {}  # ... and since it
        self._depth = 0
        self._handles: list[Any] = []

    def __enter__(self) -> TrainingState:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handles = [register_module_forward_pre_hook(self._entered),
                         register_module_forward_hook(self._left, always_call=True),
                         register_optimizer_step_post_hook(self._stepped)]  # fmt: skip
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.models.update(self._called)  # what ran after the last step (an evaluation) too

    def _entered(self, module: Any, _args: Any) -> None:
        if self._depth == 0:
            self._called[id(module)] = module
        self._depth += 1

    def _left(self, _module: Any, _args: Any, _output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _stepped(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.optimizers[id(optimizer)] = optimizer
        if self._called:
            self.models, self._called = self._called, {}

    def stepped_parameters(self) -> int | None:
        """The elements of the parameters the kept optimizers step that take gradients, each
        tensor once; None where no optimizer stepped."""
        seen: dict[int, int] = {}
        for optimizer in self.optimizers.values():
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if getattr(parameter, "requires_grad", False):
                        seen[id(parameter)] = int(parameter.numel())
        return sum(seen.values()) if seen else None

    def release(self) -> None:
        self.optimizers.clear()
        self.models.clear()
        self._called.clear()


def run_job(job: ChildJob) -> ChildResult:
    from memlens.plan.apply import PLACEHOLDER_VALUES, LeverHooks
    from memlens.predict.command import run_command, split_command
    from memlens.predict.session import PredictSession, run_in_session
    from memlens.predict.written import SNAPSHOT_NAME, oom_line, write_prediction

    kind, target, argv = split_command(tuple(job.command))
    out = Path(job.out_dir)
    from memlens.plan.apply import install_fake_distributed

    hooks = LeverHooks(tuple(job.levers))
    hooks.world_size = job.world_size
    undo_distributed = (
        install_fake_distributed(job.world_size, job.rank)
        if job.distributed
        or job.world_size > 1
        or any(lever.text() in ("fsdp", "offload=params") for lever in job.levers)
        else None
    )
    link = None
    undo_pipeline = None
    if undo_distributed is not None:
        from memlens.plan.pipeline import SENT_NAME, PipelineLink, install_pipeline_support

        link = PipelineLink(job.pipeline_received, out / SENT_NAME)
        undo_pipeline = install_pipeline_support(link)
    hooks.install()
    counter = FlopCount()
    session = PredictSession(gpu=job.gpu, capacity=job.capacity, reserve_outside=job.reserve_outside, stacks=job.stacks,
                             placeholder_values=job.placeholder_values)
    if undo_distributed is not None:
        from memlens.plan.ddp import collective_op_hook

        session.op_hooks.append(collective_op_hook)

    @contextlib.contextmanager
    def placeholder_values() -> Iterator[None]:
        before, session.placeholder_values = session.placeholder_values, True
        try:
            yield
        finally:
            session.placeholder_values = before

    PLACEHOLDER_VALUES[:] = [placeholder_values]

    def body() -> Any:
        return run_command(kind, target, argv)

    kept = TrainingState()

    try:
        # Entered before the session, the counter sits below predict's own mode. Above it, its
        # frame held each op's arguments while predict asked whether anything but the op holds a
        # backward operand (to add in place, as the GPU does): the plan's run then allocated where
        # predict's does not, and a configuration that fits in predict ran out of memory here.
        with counter.mode, kept:
            result = run_in_session(session, body, capture_errors=True)
    finally:
        hooks.uninstall()
        if undo_pipeline is not None:
            undo_pipeline()
        if undo_distributed is not None:
            undo_distributed()
    predicted = out / SNAPSHOT_NAME
    write_prediction(predicted, session, result, job.world_size, job.rank)
    held = held_bytes()
    uneven = uneven_shards() if job.world_size > 1 else 0
    stepped = kept.stepped_parameters()
    kept.release()
    result.value = None
    read_back_peaks(predicted, result)
    problem = None
    if not result.fits:
        if result.oom:
            problem = oom_line(result)
        else:
            problem = result.error or result.stop_reason or result.interrupted
            if problem is not None and result.stopped_at and result.stopped_at not in problem:
                problem = f"{problem} (at {result.stopped_at})"
            if problem is None and not result.used_cuda:
                problem = "nothing was put on the GPU: the script made no CUDA tensor"
        if problem is not None:
            from memlens.errors import one_line

            problem = one_line(problem)  # a table row: the script's exception can span lines
    fits = result.fits
    unapplied = hooks.unapplied()
    if unapplied:
        fits = False
        problem = NOT_APPLIED + "; ".join(unapplied) + (f" (and: {problem})" if problem else "")
    notes = hooks.final_notes()
    if link is not None and link.stages:
        notes["pipeline"] = {"stages": link.stages}
    if uneven:
        notes["uneven_shards"] = uneven
    model = msgspec.convert(result.model, ModelInfo) if result.model is not None else None
    optimizer = msgspec.convert(result.optimizer, OptimizerInfo) if result.optimizer is not None else None
    return ChildResult(
        peak_allocated_bytes=result.peak_allocated_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes,
        capacity_bytes=result.capacity_bytes,
        fits=fits,
        oom=result.oom,
        oom_requested_bytes=result.oom_requested_bytes if result.oom else None,
        problem=problem,
        snapshot=str(predicted.resolve()),
        notes=notes,
        held_bytes=held,
        flops=counter.total,
        # No parameter on the GPU (FSDP2's CPU offload keeps them on the host): what the
        # optimizers stepped, each parameter at its whole size (a DTensor's global numel).
        trainable_parameters=model.parameters_trainable if model is not None else stepped,
        model=model,
        optimizer=optimizer,
        seconds=round(result.seconds, 3),
    )


def read_back_peaks(predicted: Path, result: PredictResult) -> None:
    """The result's peaks made those ``memlens triage`` reads from the written file (one number
    per quantity): the analysis' of the file, which triage's report carries unchanged. Nothing
    to read when the script put nothing on the GPU."""
    if not result.used_cuda:
        return
    from memlens.analysis import analyze_snapshot
    from memlens.snapshot.reader import load

    device = analyze_snapshot(load(str(predicted))).report.device(0)
    result.peak_allocated_bytes = device.peak_allocated_bytes
    result.peak_reserved_bytes = device.peak_reserved_bytes


def run_in_child(job_path: str, log_path: str, alloc_conf: str) -> None:
    """A child process's entry (``multiprocessing``): the script's output to ``log_path``, the
    allocator levers in ``PYTORCH_CUDA_ALLOC_CONF``, then the job; in a process group of its
    own, which the plan ends whole when it is stopped."""
    import os

    from memlens.plan.processes import lead_own_group

    lead_own_group()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    main(["child", job_path])


def held_bytes() -> dict[str, int]:
    """What the simulated GPU holds at the end of the run (after the last step), by role: every
    live parameter, its gradient, and every optimizer's state; each storage counted once, a
    sharded (``DTensor``) value by its local shard."""
    import gc

    import torch

    from memlens.predict.session import live_cuda_parameters

    seen: set[int] = set()

    def size(tensor: Any) -> int:
        if not isinstance(tensor, torch.Tensor):
            return 0
        local = getattr(tensor, "_local_tensor", None)
        tensor = local if local is not None else tensor
        if tensor.device.type != "cuda":
            return 0
        storage = tensor.untyped_storage()
        if storage._cdata in seen:
            return 0
        seen.add(storage._cdata)
        return int(storage.nbytes())

    parameters = live_cuda_parameters()
    # DeepSpeed's ZeRO-3 parameter is an empty placeholder; its partition is its ds_tensor.
    held = {"parameters": sum(size(p) + size(getattr(p, "ds_tensor", None)) for p in parameters)}
    held["gradients"] = sum(size(p.grad) for p in parameters if p.grad is not None)
    optimizers = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.optim.Optimizer)]
    # What an optimizer steps that is no model parameter (DeepSpeed's fp32 master partitions) is
    # its state too; the model's parameters were counted above (each storage once).
    held["optimizer_state"] = sum(
        size(value) for optimizer in optimizers for state in optimizer.state.values() for value in state.values()
    ) + sum(size(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"])
    return held


def uneven_shards() -> int:
    """How many live sharded (``DTensor``) parameters split unevenly over their mesh: a dimension
    sharded over N ranks that N does not divide, so the last ranks' shards are smaller
    (``torch.chunk``'s split; FSDP2 pads each shard's storage to the first's, but what is made
    like a shard, AdamW's moments, is not padded) and the ranks' memory differs."""
    from torch.distributed.tensor import DTensor, Shard

    from memlens.predict.session import live_cuda_parameters

    count = 0
    for parameter in live_cuda_parameters():
        if not isinstance(parameter, DTensor):
            continue
        mesh = parameter.device_mesh
        for mesh_dim, placement in enumerate(parameter.placements):
            if isinstance(placement, Shard) and parameter.shape[placement.dim] % mesh.size(mesh_dim):
                count += 1
                break
    return count


def main(argv: list[str]) -> int:
    from memlens.files import write_atomic

    job_path = Path(argv[1])
    job = msgspec.json.decode(job_path.read_bytes(), type=ChildJob)
    try:
        outcome = run_job(job)
    except Exception as exc:  # a lever that cannot apply, a script that cannot start: one line
        from memlens.errors import one_line

        outcome = ChildResult(problem=one_line(f"{type(exc).__name__}: {exc}"))
    write_atomic(Path(job.out_dir) / RESULT_NAME, msgspec.json.encode(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
