"""The JSON text every face prints or returns for an answer (``--json``, the MCP tools' text)."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

__all__ = ["json_text"]


def json_text(payload: Any) -> str:
    """Indented JSON that never says NaN or Infinity (a non-finite float, which no figure should
    be, is null, as the report's own encoder writes it).

    Written compact by ``json``'s C encoder, then indented by ``msgspec.json.format``, which only
    moves whitespace: the text is ``json.dumps(payload, indent=2)``'s byte for byte, but an
    indented ``json.dumps`` runs the pure-Python encoder, 70 ms of a cached 1M-entry triage's
    answer. The tree is walked for non-finite floats only when the encoder meets one."""
    try:
        compact = json.dumps(payload, allow_nan=False)
    except ValueError:
        compact = json.dumps(_finite(payload), allow_nan=False)
    return msgspec.json.format(compact, indent=2)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
