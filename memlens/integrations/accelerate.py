"""Record an ``accelerate`` training loop: ``with record(accelerator, "runs/exp1"):``.

    from memlens.integrations.accelerate import record
    with record(accelerator, "runs/exp1"):          # after accelerator.prepare(...)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()

One memlens step per optimizer step that accelerate really takes: ``optimizer.step()`` inside
``accelerator.accumulate`` is a no-op until the gradients are synchronised, so with
``gradient_accumulation_steps=4`` a step spans four micro-batches, as accelerate counts them. A
step ends when that ``optimizer.step()`` returns (also when a mixed-precision scaler skipped it
for an overflow: the iteration happened); the next one begins then, and what follows the last
step is the loop's tail, not a step.

The model and the optimizer are the ones passed, else those ``accelerator.prepare`` returned
(the first of each; with several optimizers, pass the one whose step ends a training step). The
file is named by ``accelerator.process_index`` (``rank{N}.pickle``). The snapshot is written when
the block is left: normally, by an exception (which goes on unchanged), at an out of memory
(at the failing allocation, by the recorder's OOM observer) or at SIGTERM. Options are
``memlens.record``'s; the block yields the ``Recorder`` (``rec.path``, ``rec.mark_step()``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlens.integrations._framework import FrameworkRun, check_record_options, require

if TYPE_CHECKING:
    from accelerate import Accelerator

    from memlens.recorder.session import Recorder
else:
    require("accelerate", "accelerate", "accelerate")


@contextlib.contextmanager
def record(
    accelerator: Accelerator,
    out: str | Path = "memlens_runs",
    *,
    model: Any = None,
    optimizer: Any = None,
    **record_options: Any,
) -> Iterator[Recorder]:
    """Record the loop inside the ``with`` block; see this module's docstring."""
    options = check_record_options(record_options, "memlens.integrations.accelerate.record")
    model = model if model is not None else _first(getattr(accelerator, "_models", None))
    optimizer = optimizer if optimizer is not None else _first(getattr(accelerator, "_optimizers", None))
    run = FrameworkRun(out, options)
    run.start(
        rank=int(accelerator.process_index),
        world_size=int(accelerator.num_processes),
        model=accelerator.unwrap_model(model) if model is not None else None,
        optimizers=[optimizer],
    )
    recorder = run.recorder
    restore = _mark_steps_after(optimizer, accelerator, recorder) if optimizer is not None else None
    try:
        yield recorder
    except BaseException as error:
        run.fail(error)
        raise
    else:
        run.finish()
    finally:
        if restore is not None:
            restore()


def _mark_steps_after(optimizer: Any, accelerator: Any, recorder: Any) -> Any:
    """Make ``optimizer.step()`` end a memlens step when accelerate really steps (the gradients
    are synchronised); returns what puts the optimizer back.

    The wrapper sits on this one optimizer object (an instance attribute), not on its class nor
    on torch's global optimizer hooks, so other optimizers and other recordings are untouched.
    """
    original = optimizer.step

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if getattr(accelerator, "sync_gradients", True):
            recorder.mark_step()
        return result

    had_own = "step" in vars(optimizer)
    optimizer.step = step

    def restore() -> None:
        if vars(optimizer).get("step") is step:
            if had_own:
                optimizer.step = original
            else:
                del optimizer.step

    return restore


def _first(items: Any) -> Any:
    return items[0] if items else None


__all__ = ["record"]
