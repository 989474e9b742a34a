"""What a callback accepts from the page, checked at the boundary.

A callback's inputs come from a POST anyone can forge (``/_dash-update-component``): a window
of ``"abc"``, a NaN or ±1e308 range, a list where an id belongs. Each callback passes its
inputs through these functions first; a value of the wrong type or out of range raises
``BadInput`` naming the field, which the app shows as one line in the message area (see
``callbacks.answer_error``) instead of a traceback. The checks are about types and ranges
only: what a well-formed value means is the panels' business.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from memlens.errors import MemlensError

# Longest id, text field or choice accepted from the page (real ones are a few dozen characters).
MAX_TEXT = 1_000
# Most ids in one multi-select (the ranks of one job).
MAX_IDS = 1_000
# Trace rows, event numbers and clicks: beyond 2^53 a float no longer holds every integer.
MAX_INDEX = 2**53
# A timeline's x range (event index or seconds): anything finite that fits the trace's rows.
MAX_COORDINATE = float(2**53)
# Device ordinals (the reader refuses 1,024 and above).
MAX_DEVICE = 1_024


class BadInput(MemlensError):
    """A value from the page that no control of the page sends (a forged or broken request)."""


def _refuse(field: str, what: str, value: Any) -> BadInput:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return BadInput(f"{field}: expected {what}, got {shown}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def source_id(value: Any, field: str = "snapshot") -> str | None:
    """A snapshot id (or nothing picked)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise _refuse(field, "a snapshot id", value)
    return value


def source_ids(value: Any, field: str = "snapshots") -> list[str]:
    """A multi-select of snapshot ids."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_IDS:
        raise _refuse(field, "a list of snapshot ids", value)
    return [i for i in (source_id(v, field) for v in value) if i]


def device(value: Any, field: str = "device") -> int | None:
    """A device ordinal (or the default one)."""
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < MAX_DEVICE:
        raise _refuse(field, "a device number", value)
    return int(value)


def choice(value: Any, options: Collection[str], default: str, field: str) -> str:
    """One of ``options`` (``default`` when nothing is picked)."""
    if value is None:
        return default
    if not isinstance(value, str) or value not in options:
        raise _refuse(field, "one of " + ", ".join(sorted(options)), value)
    return value


def optional_choice(value: Any, options: Collection[str], field: str) -> str | None:
    """One of ``options``, or nothing picked (None: the budget takes the sidecar's)."""
    if value is None or value == "":
        return None
    return choice(value, options, "", field)


def prefill(value: Any, field: str = "budget prefill") -> dict[str, Any] | None:
    """What the budget form was filled with (``BudgetPrefill.store``): sidecar values, an inferred count."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"sidecar", "inferred"}:
        raise _refuse(field, "the form's prefill", value)
    sidecar = value.get("sidecar") or {}
    if not isinstance(sidecar, dict) or len(sidecar) > 32 or not all(
            isinstance(k, str) and (v is None or (isinstance(v, str | int | float) and not isinstance(v, bool)
                                    and len(str(v)) <= MAX_TEXT)) for k, v in sidecar.items()):
        raise _refuse(field, "the form's prefill", value)
    inferred = value.get("inferred")
    if inferred is not None and (not isinstance(inferred, str) or len(inferred) > MAX_TEXT):
        raise _refuse(field, "the form's prefill", value)
    return {"sidecar": sidecar, "inferred": inferred}


def choices(value: Any, options: Collection[str], field: str) -> list[str]:
    """Some of ``options`` (a checklist)."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > len(options):
        raise _refuse(field, "a list of " + ", ".join(sorted(options)), value)
    return [choice(v, options, "", field) for v in value]


def text(value: Any, field: str) -> str | None:
    """A text field (a number typed into it arrives as a number: taken as its text)."""
    if value is None:
        return None
    if _is_int(value) or (isinstance(value, float) and math.isfinite(value)):
        return str(value)
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise _refuse(field, "text", value)
    return value


def number(value: Any, field: str, maximum: float = float(MAX_INDEX)) -> int | float | None:
    """A number field: blank, or a finite number in ``[0, maximum]``."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 <= value <= maximum:
        raise _refuse(field, f"a number from 0 to {maximum:g}", value)
    return value


def clicks(value: Any, field: str = "clicks") -> int | None:
    """A button's ``n_clicks``."""
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < MAX_INDEX:
        raise _refuse(field, "a click count", value)
    return int(value)


def click_list(value: Any, field: str = "finding clicks") -> list[int | None]:
    """The ``n_clicks`` of a pattern-matched set of buttons."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_IDS:
        raise _refuse(field, "a list of click counts", value)
    return [clicks(v, field) for v in value]


def index(value: Any, field: str) -> int:
    """A row or list index (a finding's, an event's)."""
    if not _is_int(value) or not 0 <= value < MAX_INDEX:
        raise _refuse(field, "an index", value)
    return int(value)


def _optional_row(value: Any, field: str) -> int | None:
    """A row of the view: may lie left of the trace (a zoom dragged past its start gives -3)."""
    if value is None:
        return None
    if not _is_int(value) or not -MAX_INDEX < value < MAX_INDEX:
        raise _refuse(field, "a trace row", value)
    return int(value)


VIEW_KEYS = ("start", "end", "highlight", "marker")


def view(value: Any, field: str = "view") -> dict[str, Any]:
    """The page's view store: rows ``start``/``end``, a ``highlight``ed finding, a ``marker`` row."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse(field, "a view (start, end, highlight, marker)", value)
    unknown = set(value) - set(VIEW_KEYS)
    if unknown:
        raise _refuse(field, "a view (start, end, highlight, marker)", sorted(map(str, unknown)))
    return {key: _optional_row(value[key], f"{field}.{key}") for key in VIEW_KEYS if key in value}


def _coordinate(value: Any, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or abs(value) > MAX_COORDINATE:
        raise _refuse(field, "a finite x coordinate", value)
    return float(value)


def relayout(value: Any, field: str = "timeline zoom") -> dict[str, Any]:
    """plotly's ``relayoutData``: the x range keys are checked (numbers), the rest passed on as flags."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse(field, "plotly relayout data", value)
    checked = dict(value)
    for key in ("xaxis.range[0]", "xaxis.range[1]"):
        if key in checked:
            checked[key] = _coordinate(checked[key], f"{field} {key}")
    if "xaxis.range" in checked:
        pair = checked["xaxis.range"]
        if not isinstance(pair, list) or len(pair) != 2:
            raise _refuse(f"{field} xaxis.range", "two x coordinates", pair)
        checked["xaxis.range"] = [_coordinate(x, f"{field} xaxis.range") for x in pair]
    for key in ("xaxis.autorange", "autosize"):
        if key in checked and not isinstance(checked[key], bool):
            raise _refuse(f"{field} {key}", "true or false", checked[key])
    return checked


def click_data(value: Any, field: str = "click") -> dict[str, Any] | None:
    """plotly's ``clickData``: a list of point dicts (what a point carries is the panel's to read)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _refuse(field, "plotly click data", value)
    points = value.get("points", [])
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise _refuse(f"{field} points", "a list of points", points)
    if points:
        custom = points[0].get("customdata")
        if custom is not None and not (_is_int(custom) and 0 <= custom < MAX_INDEX) \
                and not (isinstance(custom, str) and len(custom) <= MAX_TEXT):
            raise _refuse(f"{field} customdata", "an event number or a snapshot id", custom)
    return value


def upload_event(value: Any, field: str = "upload") -> dict[str, str] | None:
    """What upload.js hands the page after an upload: ``{"id", "name"}``, ``{"error", "name"}``, or
    ``{"note", "name"}`` (a sidecar kept for its snapshot), a note possibly with an id too."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _refuse(field, "an upload result", value)
    event: dict[str, str] = {}
    for key in ("id", "name", "error", "note"):
        if value.get(key) is not None:
            item = value[key]
            if not isinstance(item, str) or len(item) > 4 * MAX_TEXT:
                raise _refuse(f"{field} {key}", "text", item)
            event[key] = item
    if "id" not in event and "error" not in event and "note" not in event:
        raise _refuse(field, "an upload result (id, error or note)", value)
    return event
