"""The JSON form of a report (``Report.to_json()``), schema_version 1.

Top level: ``schema_version`` (1), ``source`` (the file or "<memory>"), ``format_guess`` (which
PyTorch wrote it), ``devices`` (object keyed by the device number as text) and ``findings`` (all
devices' findings, most severe first, then largest ``bytes``).

Per device: ``events`` (trace rows), ``window_complete`` (the history saw every live byte),
``step_source`` (memlens | profiler | optimizer_annotations | user_metadata | periodic |
optimizer_frames | none) and ``steps`` (``index``, ``start_event``/``end_event`` as a half-open
row range, ``start_us``/``end_us`` or null without timestamps, ``partial`` when the window cut
the step); ``peak_allocated_bytes``/``peak_allocated_event``, ``peak_reserved_bytes``/
``peak_reserved_event``, ``peak_time_us`` (a peak event of null on a device with rows: the peak
is the instant before the first row, what was live when the history began);
``baseline_allocated_bytes`` (live before the first row), ``final_allocated_bytes``,
``final_reserved_bytes``; allocated counts what ``torch.cuda.memory_allocated`` counts, so blocks
freed but waiting on another stream are apart: ``pending_free_peak_bytes`` and
``pending_free_final_bytes`` (optional: absent in reports from before they existed);
``capacity_bytes`` (null if unknown);
``categories_at_peak`` (bytes live at the allocated peak for each of parameters, gradients,
optimizer_state, activations, temporary, unknown: they sum to ``peak_allocated_bytes``),
``top_stacks_by_category`` (per category, stacks as below), ``optimizer_windows`` (row ranges
``[start, end)``) with ``optimizer_window_source`` (annotations | frames | none), ``notes`` (text)
and that device's ``findings``.

A finding: ``kind`` (leak | activation_plateau | optimizer_spike | fragmentation | idle_cache |
oom), ``device``, ``severity`` (high | medium | low), ``bytes`` (what the finding is about: leaked
bytes, plateau height, spike, fragmentation's replay saving or the free bytes stranded in pieces,
the idle cache in entirely free segments, the failed request), ``start_event``/
``end_event`` (row range), ``start_us``/``end_us``, ``step`` (step index or null),
``top_stacks`` (``frames``: "name (file:line)" innermost first, ``bytes``, ``count``),
``evidence`` (flat object of numbers and text; its keys per kind are documented in each finder
module and may grow), ``summary`` (one line), ``recommendation`` and ``estimated_saving_bytes``
(null when it cannot be told).

Adding fields is compatible; renaming or removing one bumps ``schema_version``.
"""

from __future__ import annotations

from typing import Any

from memlens.analysis.datatypes import CATEGORIES, FINDING_KINDS, SCHEMA_VERSION, SEVERITIES, STEP_SOURCES

_INT = {"type": "integer"}
_NULLABLE_INT = {"type": ["integer", "null"]}
_STACK = {
    "type": "object",
    "required": ["frames", "bytes", "count"],
    "properties": {"frames": {"type": "array", "items": {"type": "string"}}, "bytes": _INT, "count": _INT},
}
_STEP = {
    "type": "object",
    "required": ["index", "start_event", "end_event", "start_us", "end_us", "partial"],
    "properties": {
        "index": _INT,
        "start_event": _INT,
        "end_event": _INT,
        "start_us": _NULLABLE_INT,
        "end_us": _NULLABLE_INT,
        "partial": {"type": "boolean"},
    },
}
FINDING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "kind", "device", "severity", "bytes", "start_event", "end_event", "start_us", "end_us", "step",
        "top_stacks", "evidence", "summary", "recommendation", "estimated_saving_bytes",
    ],
    "properties": {
        "kind": {"type": "string", "enum": list(FINDING_KINDS)},
        "device": _INT,
        "severity": {"type": "string", "enum": list(SEVERITIES)},
        "bytes": _INT,
        "start_event": _INT,
        "end_event": _INT,
        "start_us": _NULLABLE_INT,
        "end_us": _NULLABLE_INT,
        "step": _NULLABLE_INT,
        "top_stacks": {"type": "array", "items": _STACK},
        "evidence": {
            "type": "object",
            "additionalProperties": {"type": ["integer", "number", "string"]},
        },
        "summary": {"type": "string"},
        "recommendation": {"type": "string"},
        "estimated_saving_bytes": _NULLABLE_INT,
    },
}
_CATEGORY_BYTES = {
    "type": "object",
    "required": list(CATEGORIES),
    "properties": {name: _INT for name in CATEGORIES},
}
DEVICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "device", "events", "window_complete", "step_source", "steps", "peak_allocated_bytes",
        "peak_allocated_event", "peak_reserved_bytes", "peak_reserved_event", "peak_time_us",
        "baseline_allocated_bytes", "final_allocated_bytes", "final_reserved_bytes", "capacity_bytes",
        "categories_at_peak", "top_stacks_by_category", "optimizer_windows", "optimizer_window_source",
        "notes", "findings",
    ],
    "properties": {
        "device": _INT,
        "events": _INT,
        "window_complete": {"type": "boolean"},
        "step_source": {"type": "string", "enum": list(STEP_SOURCES)},
        "steps": {"type": "array", "items": _STEP},
        "peak_allocated_bytes": _INT,
        "peak_allocated_event": _NULLABLE_INT,
        "peak_reserved_bytes": _INT,
        "peak_reserved_event": _NULLABLE_INT,
        "peak_time_us": _NULLABLE_INT,
        "baseline_allocated_bytes": _INT,
        "final_allocated_bytes": _INT,
        "final_reserved_bytes": _INT,
        "pending_free_peak_bytes": _INT,
        "pending_free_final_bytes": _INT,
        "capacity_bytes": _NULLABLE_INT,
        "categories_at_peak": _CATEGORY_BYTES,
        "top_stacks_by_category": {
            "type": "object",
            "required": list(CATEGORIES),
            "properties": {name: {"type": "array", "items": _STACK} for name in CATEGORIES},
        },
        "optimizer_windows": {
            "type": "array",
            "items": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2},
        },
        "optimizer_window_source": {"type": "string", "enum": ["annotations", "frames", "none"]},
        "notes": {"type": "array", "items": {"type": "string"}},
        "findings": {"type": "array", "items": FINDING_SCHEMA},
    },
}
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "memlens analysis report",
    "type": "object",
    "required": ["schema_version", "source", "format_guess", "devices", "findings"],
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "source": {"type": "string"},
        "format_guess": {"type": "string"},
        "devices": {"type": "object", "additionalProperties": DEVICE_SCHEMA},
        "findings": {"type": "array", "items": FINDING_SCHEMA},
    },
}

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _type_ok(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[name])


def validate(instance: Any, schema: dict[str, Any] | None = None, path: str = "$") -> list[str]:
    """Errors of ``instance`` against the JSON-Schema subset used here (empty list: valid).

    Covers type (incl. lists of types), enum, required, properties, additionalProperties,
    items, minItems and maxItems: enough for ``REPORT_SCHEMA`` without a dependency.
    """
    schema = REPORT_SCHEMA if schema is None else schema
    errors: list[str] = []
    expected = schema.get("type")
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        if not any(_type_ok(instance, n) for n in names):
            return [f"{path}: expected {'/'.join(names)}, found {type(instance).__name__}"]
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: {instance!r} not one of {schema['enum']}")
    if isinstance(instance, dict):
        errors += [f"{path}: missing {key!r}" for key in schema.get("required", []) if key not in instance]
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in instance.items():
            if key in properties:
                errors += validate(value, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += validate(value, extra, f"{path}.{key}")
    if isinstance(instance, list):
        if "minItems" in schema and len(instance) < schema["minItems"]:
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if "items" in schema:
            for i, item in enumerate(instance):
                errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors
