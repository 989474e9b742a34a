"""``memlens plan``: what fits, and the cheapest way to make it fit, measured on the user's script.

``plan(PlanOptions(...))`` is the service every face calls: it returns a ``PlanResult`` (each
configuration's predicted peaks, whether it fits, what it costs, its snapshot with the sidecar so
``memlens triage`` opens it, and the cheapest configuration that fits with the change that makes
it so). The engine is ``memlens.plan``: the options (``options``), the processes that predict each
configuration (``runner``, ``child``), the scoring and the recommendation (``scoring``,
``recommend``), all put together by ``memlens.plan.planner``.
"""

from __future__ import annotations

from memlens.plan.configurations import Configuration
from memlens.plan.options import PlanOptions, command_line_fields
from memlens.plan.planner import plan as _plan
from memlens.plan.planner import predict_configurations as _predict_configurations
from memlens.plan.results import PlanConfig, PlanProgress, PlanResult


def plan(options: PlanOptions, on_progress: PlanProgress | None = None) -> PlanResult:
    """What fits of ``options.command``, and the cheapest change that makes it fit (see
    ``memlens.plan.planner.plan``); ``on_progress`` is told of each configuration as it starts and
    ends."""
    return _plan(options, on_progress)


def predict_configurations(options: PlanOptions, configurations: list[Configuration]) -> list[PlanConfig]:
    """Each of ``configurations`` predicted and scored as ``plan`` does, into ``options.out`` (a
    new folder), without a recommendation."""
    return _predict_configurations(options, configurations)


__all__ = ["PlanConfig", "PlanOptions", "PlanProgress", "PlanResult", "command_line_fields", "plan",
           "predict_configurations"]
