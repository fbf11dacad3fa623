"""Shipping progress, kept in the recording: the ``clickhouse_progress`` table and how far behind it is.

Read by the shipper (:mod:`ingero.clickhouse.shipper`), ``ingero ship --status`` and the agent's
``/metrics`` (``ingero_clickhouse_unshipped_rows``, ``ingero_clickhouse_lag_seconds``); no network code.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ingero.clickhouse.schema import TABLES
from ingero.errors import StoreError

PROGRESS_TABLE = "clickhouse_progress"
FIRST_ROWID = -(2**63)  # rowids may be negative (an INTEGER PRIMARY KEY holding a hash)
PROGRESS_DDL = """
CREATE TABLE IF NOT EXISTS clickhouse_progress (
	target       TEXT NOT NULL,              -- the ClickHouse store shipped to (ingero ship --target)
	tbl          TEXT NOT NULL,              -- the shipped table
	shipped      INTEGER NOT NULL,           -- rowid of the last row known to be in ClickHouse
	pending      INTEGER,                    -- last rowid of a batch sent whose answer was not seen
	pending_key  TEXT,                       -- JSON: that row's identity (schema key columns), for the probe
	pending_rows INTEGER NOT NULL DEFAULT 0,
	rows         INTEGER NOT NULL DEFAULT 0, -- rows shipped so far
	updated_at   INTEGER NOT NULL DEFAULT 0, -- unix nanos
	PRIMARY KEY (target, tbl)
)"""


@dataclass(frozen=True)
class TableLag:
    table: str
    shipped_rows: int
    unshipped_rows: int
    oldest_unshipped_ns: int | None  # time column of the oldest unshipped row (None: caught up / no time)


def lag(db: str | Path, target: str = "default") -> list[TableLag]:
    """How far shipping to ``target`` is behind, per table (read-only; no progress yet = all unshipped)."""
    from ingero.store.db import open_readonly

    conn = open_readonly(db)
    try:
        return lag_of(conn, target)
    except sqlite3.Error as e:
        raise StoreError(f"cannot read shipping progress of {db}: {e}") from None
    finally:
        conn.close()


def lag_of(conn: sqlite3.Connection, target: str) -> list[TableLag]:
    """:func:`lag` on an open connection (raises sqlite3.Error)."""
    have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    progress: dict[str, tuple[int, int]] = {}
    if PROGRESS_TABLE in have:
        for tbl, shipped, rows in conn.execute(
            f"SELECT tbl, shipped, rows FROM {PROGRESS_TABLE} WHERE target = ?", (target,)
        ):
            progress[tbl] = (int(shipped), int(rows))
    out: list[TableLag] = []
    for t in TABLES:
        if t.name not in have or t.keyed:  # keyed: shipped by difference with the store, no local cursor
            continue
        shipped, rows = progress.get(t.name, (FIRST_ROWID, 0))
        unshipped = conn.execute(f"SELECT count(*) FROM {t.name} WHERE rowid > ?", (shipped,)).fetchone()[0]
        oldest = None
        if t.time and unshipped:
            oldest = conn.execute(
                f"SELECT {t.time} FROM {t.name} WHERE rowid > ? ORDER BY rowid LIMIT 1", (shipped,)
            ).fetchone()[0]
        out.append(TableLag(t.name, rows, int(unshipped), oldest))
    return out


def shipping_summary(conn: sqlite3.Connection, now_ns: int) -> dict[str, dict[str, float | int]] | None:
    """Per store this recording ships to: unshipped rows and the age of the oldest one (seconds); None
    when it was never shipped. What the agent's ``/info`` and ``fleet status`` show."""
    out: dict[str, dict[str, float | int]] = {}
    for target in targets(conn):
        lags = lag_of(conn, target)
        oldest = min((lg.oldest_unshipped_ns for lg in lags if lg.oldest_unshipped_ns), default=None)
        out[target] = {
            "unshipped_rows": sum(lg.unshipped_rows for lg in lags),
            "lag_s": round(max(0.0, (now_ns - oldest) / 1e9), 3) if oldest else 0.0,
        }
    return out or None


def targets(conn: sqlite3.Connection) -> list[str]:
    """The stores this recording has been shipped to (none: never shipped)."""
    have = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (PROGRESS_TABLE,)).fetchone()
    if not have:
        return []
    return [str(r[0]) for r in conn.execute(f"SELECT DISTINCT target FROM {PROGRESS_TABLE} ORDER BY 1")]
