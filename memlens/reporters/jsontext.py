"""The JSON text every face prints or returns for an answer (``--json``, the MCP tools' text)."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["json_text"]


def json_text(payload: Any) -> str:
    """Indented JSON that never says NaN or Infinity (a non-finite float, which no figure should
    be, is null, as the report's own encoder writes it)."""
    return json.dumps(_finite(payload), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
