"""Pipeline parallelism (``torch.distributed.pipelining``) on the simulated process group: one stage
per rank, each rank in a process of its own, one after another.

A stage's memory is its own: its layers, the activations its schedule keeps for the micro-batches
in flight, the buffers it receives the previous stage's activations and the next stage's
gradients into. The schedule, the stage and their sends and receives run unchanged, and the fake
process group completes every send and receive at once (the buffers are allocated as a real run's
are; they hold no values, as no simulated tensor does). What one process lacks of a real job is
what the other stages tell this one before the first step, and it is supplied:

- the shapes of the activations the previous stage sends (``PipelineStage``'s runtime shape
  inference receives them as a pickled object from the previous rank): read from what the ranks
  before, run first, sent (``SENT_NAME`` in the rank's folder, which passes on what it received).
  So a pipeline's ranks run in order, 0 first; rank 0 needs nothing, having the inputs. A rank
  whose previous stage is on a later rank (an interleaved schedule's second stage on rank 0)
  cannot be run so, and says it in one line.
- the shapes of the gradients the next stage sends back: derived from this stage's outputs,
  PyTorch's own rule (``_derive_grad_metas``, what its static mode does: a gradient has the shape,
  stride and dtype of the activation it is the gradient of).
- the warm-up vote (every stage votes whether its shapes were given, ``input_args``, so shape
  inference can be skipped): this stage's vote, and the earlier ranks' as they sent it; the later
  stages are taken to vote as this one does (the same script builds every stage).

Not supported: activations sent between stages as DTensors (their metadata names a mesh of the
sending process), said in one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memlens.errors import MemlensUsageError

# What a rank sends the next one, in its configuration's rank folder.
SENT_NAME = "pipeline_sent.json"


def _dtype_of(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise MemlensUsageError(f"pipeline: the previous stage sent an unknown dtype {name!r}")
    return dtype


def metas_to_json(metas: tuple[Any, ...]) -> list[dict[str, Any] | None]:
    """A stage's output metadata (``_TensorMeta``s) as plain values."""
    from torch.distributed.pipelining._utils import _DTensorMeta

    written: list[dict[str, Any] | None] = []
    for meta in metas:
        if meta is None:
            written.append(None)
            continue
        if isinstance(meta, _DTensorMeta):
            raise MemlensUsageError(
                "pipeline: a stage sends a DTensor to the next one, which --world-size does not support"
            )
        dtype = str(meta.dtype).removeprefix("torch.")
        shape, stride = list(meta.shape), list(meta.stride)
        written.append({"shape": shape, "stride": stride, "dtype": dtype, "requires_grad": meta.requires_grad})
    return written


def metas_from_json(values: list[dict[str, Any] | None]) -> tuple[Any, ...]:
    import torch
    from torch.distributed.pipelining._utils import _TensorMeta

    def meta(value: dict[str, Any]) -> Any:
        return _TensorMeta(
            shape=torch.Size(value["shape"]),
            stride=tuple(value["stride"]),
            dtype=_dtype_of(value["dtype"]),
            requires_grad=bool(value["requires_grad"]),
        )

    return tuple(None if value is None else meta(value) for value in values)


class PipelineLink:
    """What this rank's stages receive from the rank before (``received``: that rank's
    ``SENT_NAME``, None for rank 0) and what they send the next one (``sent``, written at
    ``sent_path``); ``stages``: what was seen of each stage this rank built (index, count,
    schedule)."""

    def __init__(self, received_path: str | None, sent_path: Path) -> None:
        self.received: dict[str, Any] = {}
        if received_path is not None:
            self.received = json.loads(Path(received_path).read_text())
        # Passed on with this rank's own: a stage whose previous stage is on a rank before the
        # one just before (a pipeline with data parallel ranks in between) finds its shapes too.
        self.sent: dict[str, Any] = {
            "forward": dict(self.received.get("forward", {})),
            "votes": dict(self.received.get("votes", {})),
        }
        self.sent_path = sent_path
        self.stages: list[dict[str, Any]] = []

    def write(self) -> None:
        self.sent_path.write_text(json.dumps(self.sent))

    def forward_metas_for(self, stage_index: int) -> Any:
        from torch.distributed.pipelining._utils import _StageForwardMeta

        found = self.received.get("forward", {}).get(str(stage_index))
        if found is None:
            raise MemlensUsageError(
                f"pipeline: stage {stage_index} needs the shapes the stage before it sends, and its rank was not "
                "run before this one"
            )
        return _StageForwardMeta(forward_metas=metas_from_json(found))


class Vote:
    """The warm-up vote's result as the schedule reads it (``result.item() == 1``): the value the
    stages voted, beside the simulated tensor that holds none (passed on to a stage on the same
    rank, as the schedule passes the tensor)."""

    def __init__(self, tensor: Any, value: int) -> None:
        self.tensor = tensor
        self.value = value

    def item(self) -> int:
        return self.value


def install_pipeline_support(link: PipelineLink) -> Callable[[], None]:
    """``PipelineStage``'s exchanges with the other ranks answered from ``link`` (see the module's
    docstring); returns the undo. Does nothing where torch has no ``PipelineStage`` of this kind
    (an older release: its stages exchange shapes otherwise, and are not patched)."""
    try:
        from torch.distributed.pipelining import stage as stage_module
        from torch.distributed.pipelining._utils import InferenceMode, _derive_grad_metas, _StageBackwardMeta
    except ImportError:
        return lambda: None
    stage_class = stage_module.PipelineStage
    needed = ("_recv_meta", "_send_meta", "_warmup_forward_vote", "_warmup_backward_result")
    if not all(hasattr(stage_class, name) for name in needed):
        return lambda: None
    saved = {name: stage_class.__dict__[name] for name in (*needed, "__init__")}
    original_init = saved["__init__"]
    original_forward_vote = saved["_warmup_forward_vote"]
    original_backward_result = saved["_warmup_backward_result"]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        link.stages.append({"stage_index": int(self.stage_index), "num_stages": int(self.num_stages)})

    def recv_meta(self: Any, src_stage: int) -> Any:
        if src_stage < self.stage_index:  # the previous stage's activations: what its rank sent
            return link.forward_metas_for(self.stage_index)
        # The next stage's gradients for this stage's outputs: shaped as the outputs.
        outputs = self._stage_meta.outputs
        if outputs is None:
            raise MemlensUsageError(f"pipeline: stage {self.stage_index} has no outputs to receive gradients for")
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(outputs))

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        forward = getattr(meta, "forward_metas", None)
        if forward is not None and dst_stage > self.stage_index:
            link.sent["forward"][str(dst_stage)] = metas_to_json(forward)
            link.write()
        # The gradients' shapes sent back need no record: the stage before derives them.

    def forward_vote(self: Any, has_backward: bool, received_acc: Any = None) -> Any:
        # The tensors the vote allocates and sends are allocated as a real run's are.
        accumulated = original_forward_vote(self, has_backward, received_acc=received_acc)
        vote = 0 if InferenceMode.needs_dynamic(self._user_meta, has_backward) else 1
        link.sent["votes"][str(self.stage_index)] = vote
        link.write()
        return accumulated

    def backward_result(self: Any, received_result: Any = None) -> Any:
        if isinstance(received_result, Vote):
            received_result = received_result.tensor
        tensor = original_backward_result(self, received_result=received_result)
        votes = [int(v) for v in link.sent["votes"].values()]
        return Vote(tensor, min(votes, default=1))

    replacements = {"__init__": init, "_recv_meta": recv_meta, "_send_meta": send_meta,
                    "_warmup_forward_vote": forward_vote, "_warmup_backward_result": backward_result}  # fmt: skip
    for name, value in replacements.items():
        setattr(stage_class, name, value)

    def undo() -> None:
        for name, value in saved.items():
            setattr(stage_class, name, value)

    return undo


__all__ = ["SENT_NAME", "PipelineLink", "install_pipeline_support", "metas_from_json", "metas_to_json"]
