"""The one JSON encoding of every answer (agent API, tools API, MCP, dashboard): compact, UTF-8, NaN/Inf as null."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def dumps(doc: Any) -> str:
    """Compact JSON (no pretty-printing); non-finite floats in computed figures become ``null``."""
    try:
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=str)
    except ValueError:  # NaN/Inf somewhere in computed figures
        return json.dumps(_finite(doc), ensure_ascii=False, separators=(",", ":"), default=str)


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Mapping):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v
