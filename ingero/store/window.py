"""Time windows for ``--since`` / ``--from`` / ``--to``.

On a live database (a tracer is recording into it) ``--since 5m`` means the last five minutes of
wall-clock time. On a finished recording "the last five minutes" before *now* would usually be empty,
so ``--since`` counts back from the recording's last event instead, and the window carries a note that
says so (the CLI prints it on stderr, the API returns it).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from ingero.errors import UsageError
from ingero.store.db import is_live
from ingero.timeutil import fmt_duration, fmt_ts, now_ns, parse_duration, parse_time


@dataclass(frozen=True)
class Window:
    start_ns: int | None = None
    end_ns: int | None = None
    note: str | None = None

    @property
    def unbounded(self) -> bool:
        return self.start_ns is None and self.end_ns is None

    def clause(self, column: str = "timestamp") -> tuple[str, list[int]]:
        """``("timestamp >= ? AND timestamp <= ?", [a, b])`` — ``("1", [])`` when unbounded."""
        parts: list[str] = []
        params: list[int] = []
        if self.start_ns is not None:
            parts.append(f"{column} >= ?")
            params.append(self.start_ns)
        if self.end_ns is not None:
            parts.append(f"{column} <= ?")
            params.append(self.end_ns)
        return (" AND ".join(parts) or "1"), params

    def as_dict(self) -> dict[str, object]:
        return {"start_ns": self.start_ns, "end_ns": self.end_ns, "note": self.note}


def resolve_window(
    conn: sqlite3.Connection | None,
    since: str | None = None,
    from_: str | None = None,
    to: str | None = None,
    *,
    now: int | None = None,
) -> Window:
    """Build a window from the user's flags against this database (``conn`` may be None: wall clock)."""
    if since and from_:
        raise UsageError("--since and --from both given", hint="use one: --since 5m or --from TIME")
    end = parse_time(to) if to else None
    if from_:
        start = parse_time(from_)
        if end is not None and end < start:
            raise UsageError("--to is before --from")
        return Window(start, end)
    if not since:
        return Window(None, end)
    span = parse_duration(since)
    if span <= 0:
        raise UsageError(f"--since {since}: must be positive")
    anchor = end if end is not None else (now if now is not None else now_ns())
    note = None
    if conn is not None and end is None:
        last = conn.execute("SELECT max(timestamp) FROM events").fetchone()[0]
        if last is not None and not is_live(conn, last):
            anchor = int(last)
            note = (
                f"not a live recording: --since {since} counts back {fmt_duration(span)} from its last "
                f"event at {fmt_ts(last)}"
            )
    return Window(anchor - span, anchor, note)
