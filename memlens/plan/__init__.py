"""``memlens plan``'s engine: what is asked (``options``: ``PlanOptions``) and answered
(``results``: ``PlanResult``), the levers (``levers``: the ``--try`` spec; ``apply``: the hooks
that pull them inside a predicted run), the configurations and what passes to and from each
child process (``configurations``, ``child``, ``preload``), the processes that run them
(``runner``, ``processes``), the ``--max`` bisection (``search``), the scoring and the code
change recommended (``scoring``, ``recommend``), put together by ``planner``. The service is
``memlens.ops.plan``, which calls ``planner``; so does ``memlens.plan(...)`` (this package is
callable, as ``memlens.predict`` is).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memlens.plan.results import PlanResult


def plan(
    command: Sequence[str],
    *,
    gpu: str | None = None,
    capacity: int | str | None = None,
    reserve_outside: int | str = 0,
    world_size: int | str = 1,
    tries: Sequence[str] = (),
    vary: Sequence[str] = (),
    maximum: str | None = None,
    out: str = "memlens_plan",
    jobs: int | None = None,
    stacks: bool = False,
    placeholder_values: bool = False,
    timeout_s: float = 900.0,
) -> PlanResult:
    """Predict ``command`` (``["python", "train.py", "--batch", "{B}"]``) once per configuration:
    the baseline, each of ``tries`` (``"ckpt"``, ``"lora=8+optim=adamw8bit"``), at each ``vary``
    value (``"B=1,2,4"``); ``maximum`` (``"B=1..256"``) bisects the largest value that fits;
    ``world_size`` is a number of ranks or several joined by commas (``"1,2,4"``).
    Returns a ``memlens.plan.results.PlanResult`` (the configurations, the recommended one's
    index and its change); every configuration's snapshot is written under ``out`` (a new folder).
    The keywords are ``memlens.plan.options.PlanOptions``' fields (``maximum`` is ``max``)."""
    from memlens.plan.options import PlanOptions
    from memlens.plan.planner import plan as _plan

    options = PlanOptions(
        command=list(command), gpu=gpu, capacity=capacity, reserve_outside=reserve_outside, world_size=world_size,
        tries=list(tries), vary=list(vary), max=maximum, out=out, jobs=jobs, stacks=stacks,
        placeholder_values=placeholder_values, timeout_s=timeout_s,
    )  # fmt: skip
    return _plan(options)


class _CallablePackage(types.ModuleType):
    """``memlens.plan`` is both this package and the function (see ``memlens.predict``)."""

    def __call__(self, command: Sequence[str], **kwargs: Any) -> PlanResult:
        return plan(command, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["plan"]
