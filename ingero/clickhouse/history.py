"""A window of the store, as a trace database: what the explain engine and the collectives join read.

The engine and the join are written against ingero's SQLite schema, and their claims are checked
there. Rather than a second implementation in ClickHouse SQL, a window of one node's rows is read
from the store (through a ``Distributed`` table: any server of the cluster) into a SQLite database
with ingero's schema (:func:`ingero.store.schema.migrate`), and the same code runs on it. The window
is bounded by the caller's ``--since``/``--from``/``--to``; ``--since`` counts back from the node's
newest stored row (history, not "now").
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ingero.clickhouse.client import ClickHouse, ch_literal
from ingero.clickhouse.schema import BY_NAME, Table
from ingero.errors import UsageError
from ingero.store.schema import migrate
from ingero.store.window import Window, resolve_window
from ingero.timeutil import fmt_duration, fmt_ts

# what one node's window brings along: the tables (and the time column that bounds each; None: all rows)
EXPLAIN_TABLES: tuple[str, ...] = (
    "sessions",
    "process_names",
    "cgroup_metadata",
    "stack_traces",
    "system_snapshots",
    "annotations",
    "causal_chains",
    "event_aggregates",
    "nccl_comms",
    "nccl_calls",
    "engine_metrics",  # the serving chains (ingero.explain.rules_serving) read the engines' own series
    "events",
)
COLLECTIVE_TABLES: tuple[str, ...] = ("sessions", "nccl_comms", "nccl_calls")
BUCKET_NS = 60 * 1_000_000_000  # event_aggregates buckets: a bucket that started before the window overlaps it


def _bounds(table: Table, window: Window) -> str:
    if table.time is None or table.name == "sessions":
        return ""
    lo = window.start_ns
    if lo is not None and table.name == "event_aggregates":
        lo -= BUCKET_NS
    parts = []
    if lo is not None:
        parts.append(f" AND `{table.time}` >= {int(lo)}")
    if window.end_ns is not None:
        parts.append(f" AND `{table.time}` <= {int(window.end_ns)}")
    return "".join(parts)


def newest(ch: ClickHouse, database: str, table: str, node: str | None = None) -> int | None:
    """The newest time of ``table`` in the store (one node's, or the whole store's); None when empty."""
    t = BY_NAME[table]
    where = f" WHERE node = {ch_literal(node)}" if node is not None else ""
    res = ch.select(f"SELECT count(), max(`{t.time}`) FROM {database}.{table}{where}")
    count, last = res.rows[0]
    return int(last) if int(count) else None


def store_window(
    ch: ClickHouse,
    database: str,
    since: str | None,
    from_: str | None,
    to: str | None,
    *,
    node: str | None = None,
    table: str = "events",
) -> Window:
    """The flags' window over the store: ``--since`` counts back from the newest stored row."""
    last = newest(ch, database, table, node)
    if last is None:
        who = f" for node {node}" if node else ""
        raise UsageError(
            f"no {table} rows in the store{who}", hint="ship a recording first: ingero ship --db D --clickhouse URL"
        )
    window = resolve_window(None, since, from_, to, now=last)
    if since and not to:
        note = f"history: --since {since} counts back {fmt_duration(window.end_ns - window.start_ns)} from the newest stored row at {fmt_ts(last)}"  # type: ignore[operator]
        window = Window(window.start_ns, window.end_ns, note)
    return window


def nodes(ch: ClickHouse, database: str, table: str, window: Window) -> list[str]:
    t = BY_NAME[table]
    res = ch.select(f"SELECT DISTINCT node FROM {database}.{table} WHERE 1{_bounds(t, window)} ORDER BY node")
    return [str(r[0]) for r in res.rows]


def stored_tables(ch: ClickHouse, database: str) -> set[str]:
    """The tables ``database`` has on the server ``ch`` talks to."""
    res = ch.select(f"SELECT name FROM system.tables WHERE database = {ch_literal(database)}")
    return {str(r[0]) for r in res.rows}


def load(
    ch: ClickHouse,
    database: str,
    node: str,
    window: Window,
    dest: sqlite3.Connection,
    tables: Sequence[str] = EXPLAIN_TABLES,
) -> dict[str, int]:
    """Copy ``node``'s rows of ``window`` into ``dest`` (ingero's schema is created there); rows per table.
    A table the store lacks (its schema applied by an ingero before the table existed) has no rows."""
    migrate(dest)
    counts: dict[str, int] = {}
    present = stored_tables(ch, database)
    dest.execute("BEGIN")
    try:
        for name in tables:
            if name not in present:
                counts[name] = 0
                continue
            t = BY_NAME[name]
            cols = [c.name for c in t.columns if c.in_sqlite]
            sel = ", ".join(f"`{c}`" for c in cols)
            # FINAL: a row the tracer rewrote (a call's entry, then its return) is read as its last version
            res = ch.select(
                f"SELECT {sel} FROM {database}.{name} FINAL WHERE node = {ch_literal(node)}{_bounds(t, window)}"
            )
            marks = ", ".join("?" for _ in cols)
            quoted = ", ".join(f'"{c}"' for c in cols)
            dest.executemany(f"INSERT OR REPLACE INTO {name} ({quoted}) VALUES ({marks})", _rows(res.rows))
            counts[name] = len(res.rows)
        dest.execute("COMMIT")
    except BaseException:
        dest.execute("ROLLBACK")
        raise
    return counts


def _rows(rows: list[list[Any]]) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in rows]


def load_file(ch: ClickHouse, database: str, node: str, window: Window, path: Path) -> dict[str, int]:
    """:func:`load` into a new SQLite file at ``path`` (explain reads a large window over several connections)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = OFF")
        conn.execute("PRAGMA synchronous = OFF")
        return load(ch, database, node, window, conn)
    finally:
        conn.close()
