"""Record a Hugging Face ``Trainer`` run: ``MemlensCallback``.

    from memlens.integrations.huggingface import MemlensCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[MemlensCallback("runs/exp1")])

Recording starts at ``on_train_begin`` (the model and the optimizer the Trainer built are
watched then) and the snapshot is written at ``on_train_end``. Each optimizer step is one
memlens step: it begins at ``on_step_begin`` (the first micro-batch of a gradient-accumulation
window) and ends at ``on_step_end`` (after ``optimizer.step()`` and ``zero_grad``), so
``gradient_accumulation_steps=4`` gives one step per four micro-batches, as the Trainer counts
``global_step``. Evaluation, logging and checkpointing between steps fall outside the steps.
Every rank records its own file (``rank{N}.pickle``), named from ``TrainingArguments``'
``process_index``. Options are ``memlens.record``'s (``steps=range(2, 6)``, ``dump_every``,
``capacity``, ``stacks`` ...); ``steps`` counts this run's optimizer steps from 0.

Failures. A ``TrainerCallback`` is told nothing about an exception: the Trainer lets it
propagate past the callbacks. So:

- out of memory: the recorder's own OOM observer writes the snapshot at the failing allocation
  (``reason: "oom"``), before anything is freed, and the ``OutOfMemoryError`` goes on to the
  caller unchanged (nothing here catches it);
- any other exception that ends the program: ``sys.excepthook`` (``threading.excepthook`` for a
  training thread) writes the snapshot (``reason: "exception"``) before the traceback is
  printed; a program that ends inside training without one (SIGTERM, ``sys.exit``) is
  written at exit (``reason: "terminated"``);
- code that catches the exception around ``trainer.train()`` and goes on (a notebook, a
  hyper-parameter search): record around it yourself and hand the recorder in, so leaving the
  ``with`` block writes the snapshot however it is left::

      with memlens.record("runs/exp1") as rec:
          Trainer(..., callbacks=[MemlensCallback(recorder=rec)]).train()

  (Without that, a run still open when the next ``train()`` begins is written then, as failed.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlens.integrations._framework import FrameworkRun, RecordingCallback, UncaughtExceptionGuard, require

if TYPE_CHECKING:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

    from memlens.recorder.session import Recorder
else:
    TrainerCallback = require("transformers", "hf", "huggingface").TrainerCallback


class MemlensCallback(RecordingCallback, TrainerCallback):
    """A ``transformers.TrainerCallback`` that records the training run's memory with memlens.

    ``out`` and ``record_options`` are ``memlens.record``'s; ``recorder`` is a started
    ``memlens.record(...)`` session to mark steps in instead (its ``with`` block then writes
    the snapshot, on success or on any exception). ``runs`` lists each ``train()`` call's
    recording, newest last (``runs[-1].recorder.paths`` are the files it wrote).
    """

    def __init__(
        self, out: str | Path = "memlens_runs", *, recorder: Recorder | None = None, **record_options: Any
    ) -> None:
        self._set_up_recording(out, recorder, record_options)
        self._guard: UncaughtExceptionGuard | None = None

    # ---------------------------------------------------------------- Trainer events
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._fail_unfinished_run()
        run = FrameworkRun(self.out, self.record_options, recorder=self.recorder)
        self.runs.append(run)
        run.start(
            rank=int(getattr(args, "process_index", 0)),
            world_size=int(getattr(args, "world_size", 1)),
            model=kwargs.get("model"),
            optimizers=[kwargs.get("optimizer")],
        )
        if self.recorder is None:
            self._guard = UncaughtExceptionGuard(run)
            self._guard.install()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.runs:
            self.runs[-1].begin_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.runs:
            self.runs[-1].end_step()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self.runs:
            return
        try:
            self.runs[-1].finish()
        finally:
            self._remove_guard()

    # ---------------------------------------------------------------- failures
    def _fail_unfinished_run(self) -> None:
        """A run that never reached ``on_train_end`` failed (its exception was caught by the
        caller, who then trained again): write it now, as failed, before the next one starts."""
        if self.runs and self.runs[-1].active:
            try:
                self.runs[-1].fail(None)
            finally:
                self._remove_guard()

    def _remove_guard(self) -> None:
        if self._guard is not None:
            self._guard.uninstall()
            self._guard = None


__all__ = ["MemlensCallback"]
