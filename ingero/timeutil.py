"""Time parsing and formatting shared by every command.

All timestamps inside ingero are integer Unix nanoseconds (as in Ingero's databases); durations are
integer nanoseconds.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from ingero.errors import UsageError

NS_PER_US = 1_000
NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

_UNITS = {
    "ns": 1,
    "us": NS_PER_US,
    "µs": NS_PER_US,
    "ms": NS_PER_MS,
    "s": NS_PER_S,
    "m": 60 * NS_PER_S,
    "h": 3600 * NS_PER_S,
    "d": 86400 * NS_PER_S,
}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h|d)")


def now_ns() -> int:
    return time.time_ns()


def parse_duration(text: str) -> int:
    """Parse ``90s``, ``5m``, ``1h30m``, ``250ms`` or a bare number of seconds into nanoseconds."""
    s = text.strip().lower()
    if not s:
        raise UsageError("empty duration", hint="use e.g. 30s, 5m, 2h, 1d")
    try:
        value = float(s)
    except ValueError:
        pass
    else:
        if value < 0:
            raise UsageError(f"negative duration {text!r}")
        return int(value * NS_PER_S)
    pos = 0
    total = 0.0
    for m in _DURATION_RE.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s) or pos == 0:
        raise UsageError(f"cannot parse duration {text!r}", hint="use e.g. 30s, 5m, 2h, 1d, 1h30m")
    return int(total)


def parse_time(text: str) -> int:
    """Parse an absolute time into Unix ns.

    Accepts ISO 8601 (``2026-04-03T12:18:40Z``, naive = UTC), Unix seconds (``1775218715``, may
    have a fraction) or Unix nanoseconds (``1775218715095237062``), or ``now``.
    """
    s = text.strip()
    if s.lower() == "now":
        return now_ns()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        if "." not in s and len(s) >= 16:
            return int(s)
        return int(float(s) * NS_PER_S)
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(
            f"cannot parse time {text!r}", hint="use ISO 8601 (2026-04-03T12:18:40Z) or Unix seconds"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp()) * NS_PER_S + dt.microsecond * NS_PER_US


def fmt_ts(ns: int | None) -> str:
    """Unix ns → ``2026-04-03T12:18:43.111Z`` (UTC, millisecond precision)."""
    if not ns:
        return "-"
    dt = datetime.fromtimestamp(ns / NS_PER_S, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def fmt_duration(ns: float) -> str:
    """Go-style duration string, as Ingero prints them: ``734.136µs``, ``1.052216ms``, ``4.206s``."""
    ns = float(ns)
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    if ns < NS_PER_US:
        return f"{sign}{ns:.0f}ns"
    for unit, div in (("µs", NS_PER_US), ("ms", NS_PER_MS)):
        if ns < div * 1000:
            return f"{sign}{_trim(ns / div)}{unit}"
    if ns < 60 * NS_PER_S:
        return f"{sign}{_trim(ns / NS_PER_S)}s"
    minutes, rest = divmod(ns / NS_PER_S, 60)
    if minutes < 60:
        return f"{sign}{int(minutes)}m{_trim(rest, 3)}s"
    hours, minutes = divmod(minutes, 60)
    return f"{sign}{int(hours)}h{int(minutes)}m{int(rest)}s"


def fmt_latency(ns: float) -> str:
    """Short human figure for tables: ``18.4 ms``, ``734 µs``, ``1.2 s``."""
    ns = float(ns)
    if ns >= NS_PER_S:
        return f"{ns / NS_PER_S:.2f} s"
    if ns >= NS_PER_MS:
        return f"{ns / NS_PER_MS:.1f} ms"
    if ns >= NS_PER_US:
        return f"{ns / NS_PER_US:.0f} µs"
    return f"{ns:.0f} ns"


def _trim(value: float, digits: int = 6) -> str:
    text = f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return text or "0"
