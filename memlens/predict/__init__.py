"""``memlens predict``: run a training script on the CPU against a simulated CUDA GPU.

``memlens.predict(fn, capacity="80GiB")`` (this package is callable: calling it is calling
``memlens.predict.predict``) runs ``fn`` on the simulated GPU and returns a ``PredictResult``.
See ``memlens.predict.session`` for how, and the README's "Predict" section for the limits.
"""

import sys
import types
from typing import Any

from memlens.predict.gpus import DEFAULT_GPU, GPUS, GpuSpec
from memlens.predict.session import PredictResult, PredictSession, predict


class _CallablePackage(types.ModuleType):
    """``memlens.predict`` is both this package and the function: importing a subpackage sets
    it as an attribute of its parent, which would hide a function of the same name."""

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> PredictResult:
        return predict(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["DEFAULT_GPU", "GPUS", "GpuSpec", "PredictResult", "PredictSession", "predict"]
