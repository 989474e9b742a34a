"""Imported once by the plan's fork server, so each configuration's process starts warm.

torch, the predictor, the fake-tensor machinery (building a ``FakeTensorMode`` imports
``torch._dynamo``) and peft (which imports transformers) take seconds to import; children forked
from a process that has them start at once. Nothing runs here that would start autograd's engine
(predict needs a process where it has not).
"""

from __future__ import annotations

import importlib.util

import torch.utils._python_dispatch
import torch.utils.flop_counter  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode

import memlens.analysis.run
import memlens.plan.apply
import memlens.predict.command
import memlens.predict.session
import memlens.predict.written
import memlens.snapshot.reader  # noqa: F401

FakeTensorMode()
if importlib.util.find_spec("peft") is not None:
    import peft  # noqa: F401
