"""Record a Lightning ``Trainer.fit`` run: ``MemlensCallback``.

    from memlens.integrations.lightning import MemlensCallback
    trainer = Trainer(max_epochs=1, callbacks=[MemlensCallback("runs/exp1")])

The callback subclasses ``lightning.pytorch.Callback`` (from the ``lightning`` package), or
``pytorch_lightning.Callback`` where only the older ``pytorch-lightning`` package is installed.

Recording starts at ``on_train_start`` (the LightningModule and ``trainer.optimizers`` are
watched then, after the sanity check) and the snapshot is written at ``on_train_end``. Each
optimizer step is one memlens step: it begins at the ``on_train_batch_start`` of the first
batch of a gradient-accumulation window and ends at the ``on_train_batch_end`` after which
``trainer.global_step`` has moved, so ``accumulate_grad_batches=4`` gives one step per four
batches, as Lightning counts ``global_step`` (manual optimization too: a batch whose
``training_step`` steps no optimizer does not end a step). Validation between steps falls
outside the steps. Every rank records its own file (``rank{N}.pickle``), named from
``trainer.global_rank``. Options are ``memlens.record``'s; ``steps`` counts this run's optimizer
steps from 0.

Failures go through Lightning's ``on_exception``: the snapshot is written (``reason``:
``"exception"``, ``"oom"``, or ``"interrupted"`` for Ctrl-C) and Lightning re-raises. An out of
memory is written earlier still, by the recorder's OOM observer at the failing allocation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlens.integrations._framework import (
    FrameworkRun,
    MissingExtraError,
    RecordingCallback,
    require,
)

if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer

    from memlens.recorder.session import Recorder
else:
    try:
        Callback = require("lightning.pytorch", "lightning", "lightning").Callback
    except MissingExtraError:
        try:
            Callback = require("pytorch_lightning", "lightning", "lightning").Callback
        except MissingExtraError:
            raise MissingExtraError(
                "memlens.integrations.lightning needs lightning (or pytorch-lightning), which is not "
                "installed: pip install 'memlens[lightning]'"
            ) from None


class MemlensCallback(RecordingCallback, Callback):
    """A Lightning ``Callback`` that records the fit's memory with memlens.

    ``out`` and ``record_options`` are ``memlens.record``'s; ``recorder`` is a started
    ``memlens.record(...)`` session to mark steps in instead (its ``with`` block then writes the
    snapshot). ``runs`` lists each ``fit()``'s recording, newest last.
    """

    def __init__(
        self, out: str | Path = "memlens_runs", *, recorder: Recorder | None = None, **record_options: Any
    ) -> None:
        super().__init__()
        self._set_up_recording(out, recorder, record_options)
        # trainer.global_step when the open step began: the step ends once it has moved.
        self._global_step_at_begin: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        run = FrameworkRun(self.out, self.record_options, recorder=self.recorder)
        self.runs.append(run)
        self._global_step_at_begin = None
        run.start(
            rank=int(trainer.global_rank),
            world_size=int(trainer.world_size),
            model=pl_module,
            optimizers=list(trainer.optimizers),
        )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.runs or self.runs[-1].in_step:
            return  # inside an accumulation window: the step began with its first batch
        self.runs[-1].begin_step()
        self._global_step_at_begin = int(trainer.global_step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.runs or self._global_step_at_begin is None:
            return
        if int(trainer.global_step) > self._global_step_at_begin:  # an optimizer stepped
            self.runs[-1].end_step()
            self._global_step_at_begin = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.runs:
            self._global_step_at_begin = None
            self.runs[-1].finish()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning calls this, then re-raises the exception itself: nothing to raise here.
        if self.runs and self.runs[-1].active:
            self._global_step_at_begin = None
            self.runs[-1].fail(exception)


__all__ = ["MemlensCallback"]
