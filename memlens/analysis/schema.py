"""The JSON form of a report (``Report.to_json()``), schema_version 2.

Top level: ``schema_version`` (2), ``source`` (the file or "<memory>"), ``format_guess`` (which
PyTorch wrote it), ``devices`` (object keyed by the device number as text) and ``findings`` (all
devices' findings, most severe first, then largest ``bytes``).

Per device: ``events`` (trace rows), ``window_complete`` (the history saw every live byte),
``step_source`` (memlens | profiler | optimizer_annotations | user_metadata | periodic |
optimizer_frames | none) and ``steps`` (``index``, ``start_event``/``end_event`` as a half-open
row range, ``start_us``/``end_us`` or null without timestamps, ``partial`` when the window cut
the step); ``peak_allocated_bytes``/``peak_allocated_event`` (block bytes, as
``torch.cuda.memory_allocated`` counts them), ``peak_requested_bytes`` (what the program asked for
in those blocks; optional), ``peak_reserved_bytes``/
``peak_reserved_event``, ``peak_time_us`` (a peak event of null on a device with rows: the peak
is the instant before the first row, what was live when the history began), ``peak_phase``
(forward | backward | optimizer | after_optimizer | outside_steps: where in its step the
allocated peak fell, backward from the step-local peak on; null without steps; optional);
``baseline_allocated_bytes`` (live before the first row), ``final_allocated_bytes``,
``final_reserved_bytes``; allocated counts what ``torch.cuda.memory_allocated`` counts, so blocks
freed but waiting on another stream are apart: ``pending_free_peak_bytes`` and
``pending_free_final_bytes`` (optional: absent in reports from before they existed);
``capacity_bytes`` (null if unknown);
``categories_at_peak`` (bytes live at the allocated peak for each of parameters, gradients,
optimizer_state, activations, temporary, workspace, leaked, unknown: they sum to
``peak_allocated_bytes``; ``leaked`` and ``workspace`` are absent in reports from before they
existed),
``top_stacks_by_category`` (per category, stacks as below), ``optimizer_windows`` (row ranges
``[start, end)``) with ``optimizer_window_source`` (annotations | frames | none), ``notes`` (text)
that device's ``findings``, ``start_time_us``/``peak_reserved_time_us`` (null without
timestamps), ``timeline`` (null without rows: ``events``, and per point ``event``, ``allocated``,
``reserved``, ``time_us``: every bucket's lowest and highest point and every step's, so peaks
survive; ``oom_event``/``oom_allocated``/``oom_requested``) and ``segment_map`` (``segments``,
``reserved_bytes``, ``free_bytes``, ``largest_free_bytes``, ``hidden_bytes`` and the largest
segments ``shown``, each with ``blocks`` of ``offset``, ``size``, ``state``) and ``budget`` (null
without one; else ``ok`` and ``rows``, one per category and a ``total``: ``category``,
``theory_bytes`` (null when the budget could not estimate it), ``measured_bytes`` (null: not
measured), ``ratio`` (measured / theory, or null), ``verdict`` (within | outside | not_compared |
not_estimated | not_measured), ``tolerance``, ``theory_items`` (the budget's lines it sums) and
``note``, then ``largest_batch`` and ``largest_batch_note`` (the largest micro-batch on the
device's capacity scaled from the activations measured at the peak, and what it used; null and
"" without a capacity or the measured batch); set by ``memlens.ops.triage`` from the budget
options and the sidecar). The report also
carries the recorder's ``sidecar`` as read (``memlens.sidecar.Sidecar``, the current layout;
null for files memlens did not record).

A finding: ``kind`` (leak | activation_plateau | optimizer_spike | fragmentation | idle_cache |
oom), ``device``, ``severity`` (high | medium | low), ``bytes`` (what the finding is about: leaked
bytes, plateau height, spike, fragmentation's replay saving or the free bytes stranded in pieces,
the idle cache in entirely free segments, the failed request), ``start_event``/
``end_event`` (row range), ``start_us``/``end_us``, ``step`` (step index or null),
``top_stacks`` (``frames``: "name (file:line)" innermost first, ``bytes``, ``count``),
``evidence`` (a list of items, each ``name``, ``value`` (number or text), ``unit`` (bytes |
count | event | step | us | ratio | mib | text) and ``meaning`` (amount | pattern | cause | moment |
remedy | context), ordered by meaning in that order; the names per kind are documented in each
finder module and may grow), ``summary`` (one line), ``recommendation`` and ``estimated_saving_bytes``
(null when it cannot be told).

Adding fields is compatible; renaming or removing one bumps ``schema_version``. Version 2 (from
1): ``evidence`` became the list of typed items above (it was a flat object of name to value,
whose key order the terminal relied on).

``REPORT_SCHEMA`` (JSON Schema 2020-12) and ``validate`` are generated from the report's
dataclasses by msgspec: the types in ``memlens.analysis.report`` are the only definition.
"""

from __future__ import annotations

from typing import Any

import msgspec

from memlens.analysis.datatypes import SCHEMA_VERSION, schema_hook
from memlens.analysis.report import Report
from memlens.errors import MemlensFormatError


def _report_schema() -> dict[str, Any]:
    schema: dict[str, Any] = msgspec.json.schema(Report, schema_hook=schema_hook)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "memlens analysis report"
    # The one version this memlens writes and reads, not any integer.
    definition = schema["$defs"]["Report"]
    definition["properties"]["schema_version"] = {"type": "integer", "enum": [SCHEMA_VERSION]}
    definition["required"] = sorted({*definition.get("required", []), "schema_version"})
    return schema


REPORT_SCHEMA: dict[str, Any] = _report_schema()


def validate(instance: Any) -> list[str]:
    """Errors of a report's parsed JSON against the schema (an empty list: valid).

    msgspec stops at the first error, so the list has at most one, naming the path
    (``Expected `int`, got `str` - at `$.devices.0.events```).
    """
    if not isinstance(instance, dict):
        return [f"$: expected object, found {type(instance).__name__}"]
    try:
        Report.from_json(instance)
    except MemlensFormatError as exc:
        return [exc.problem]
    return []
