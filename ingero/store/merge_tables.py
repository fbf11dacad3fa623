"""``ingero merge``, the tables beside ``events``: sessions, snapshots, process names, aggregates,
cgroups, NCCL communicators. Each function copies one table from the attached input ``src`` into
``main`` with INSERT ... SELECT (sessions, a handful of rows, are renumbered one by one).
The per-table policies are described in :mod:`ingero.store.merge`.
"""

from __future__ import annotations

import sqlite3

from ingero.store import merge_inputs as mi
from ingero.store.schema import AGGREGATE_COLUMNS, AGGREGATES_UPSERT
from ingero.store.writer import SESSION_FIELDS

# every sessions column but the id and the node identity (what the writer fills, plus its own stamps)
SESSION_COLUMNS = ("started_at", "stopped_at", "ingero_ver", *SESSION_FIELDS)
SIDE_TABLES = """
CREATE TABLE IF NOT EXISTS node_process_names (
	node    TEXT NOT NULL,            -- node the pid lives on ('' when unknown)
	pid     INTEGER NOT NULL,
	name    TEXT NOT NULL,
	seen_at INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (node, pid)
);
"""


def lit(value: str) -> str:
    """A SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def _snapshot_node_expr(info: mi.InputInfo) -> str:
    """SQL for the node that sampled snapshot ``s`` of the attached input."""
    if info.has("system_snapshots", "node"):  # our schema 2+: the writer stamped it
        fallback = lit(info.single_node) if info.single_node else "''"
        return f"CASE WHEN s.node != '' THEN s.node ELSE {fallback} END"
    if info.single_node:
        return lit(info.single_node)
    if info.has("sessions", "node"):  # the one node whose session was running at that moment
        return (
            "coalesce((SELECT CASE WHEN count(DISTINCT x.node) = 1 THEN max(x.node) ELSE '' END "
            "FROM src.sessions x WHERE x.node != '' AND s.timestamp >= x.started_at "
            "AND (x.stopped_at = 0 OR s.timestamp <= x.stopped_at)), '')"
        )
    return "''"


def copy_sessions(conn: sqlite3.Connection, info: mi.InputInfo, merged_nodes: set[str]) -> tuple[dict[int, int], int]:
    """Sessions renumbered in input order; the same node's same session twice is kept once."""
    if not info.has("sessions", "id"):
        return {}, 0
    cols = info.columns["sessions"]
    present = [c for c in SESSION_COLUMNS if c in cols]
    ident: list[str] = [c for c in ("node", "rank", "local_rank", "world_size") if c in cols]
    rows = conn.execute(f"SELECT id, {', '.join(present + ident)} FROM src.sessions ORDER BY id").fetchall()
    fallback = info.single_node or info.force_node or ""
    mapping: dict[int, int] = {}
    added = 0
    for row in rows:
        values = dict(zip(present + ident, row[1:], strict=True))
        values["node"] = values.get("node") or fallback
        if values["node"] in merged_nodes:
            dup = conn.execute(
                "SELECT id FROM main.sessions WHERE node = ? AND started_at = ?",
                (values["node"], values.get("started_at", 0)),
            ).fetchone()
            if dup is not None:  # the same node's same session, merged twice
                mapping[int(row[0])] = int(dup[0])
                continue
        keys = list(values)
        cur = conn.execute(
            f"INSERT INTO main.sessions({', '.join(keys)}) VALUES ({', '.join('?' * len(keys))})",
            [values[k] for k in keys],
        )
        mapping[int(row[0])] = int(cur.lastrowid or 0)
        added += 1
    return mapping, added


def copy_session_stats(conn: sqlite3.Connection, info: mi.InputInfo, mapping: dict[int, int]) -> None:
    if not mapping or not info.has("session_stats", "session_id"):
        return
    rows = conn.execute("SELECT session_id, key, value FROM src.session_stats").fetchall()
    conn.executemany(
        "INSERT OR REPLACE INTO main.session_stats(session_id, key, value) VALUES (?, ?, ?)",
        [(mapping[sid], key, value) for sid, key, value in rows if sid in mapping],
    )


def copy_snapshots(conn: sqlite3.Connection, info: mi.InputInfo) -> tuple[int, int]:
    """Every snapshot of the input, attributed to its node. Returns (added, moved by 1 ns)."""
    if not info.has("system_snapshots", "timestamp"):
        return 0, 0
    c = conn
    cols = "timestamp, cpu_pct, mem_pct, mem_avail, swap_mb, load_avg"
    s_cols = ", ".join(f"s.{col}" for col in cols.split(", "))
    node_expr = _snapshot_node_expr(info)
    before = c.execute("SELECT coalesce(max(id), 0) FROM main.system_snapshots").fetchone()[0]
    total = c.execute("SELECT count(*) FROM src.system_snapshots").fetchone()[0]
    added = c.execute(
        f"INSERT OR IGNORE INTO main.system_snapshots({cols}, node) SELECT {s_cols}, {node_expr} "
        "FROM src.system_snapshots s ORDER BY s.timestamp"
    ).rowcount
    added = max(added, 0)
    moved = 0
    if added >= total:
        return added, moved
    # Rare: a timestamp an earlier input holds. Same node → duplicate, skipped; else moved 1 ns on.
    clashes = c.execute(
        f"SELECT {s_cols}, {node_expr} FROM src.system_snapshots s WHERE EXISTS "
        "(SELECT 1 FROM main.system_snapshots m WHERE m.timestamp = s.timestamp AND m.id <= ?)",
        (before,),
    ).fetchall()
    for ts, *rest, node in clashes:
        owner = c.execute("SELECT node FROM main.system_snapshots WHERE timestamp = ?", (ts,)).fetchone()
        if owner is not None and node and owner[0] == node:
            continue
        new_ts = ts + 1
        while c.execute("SELECT 1 FROM main.system_snapshots WHERE timestamp = ?", (new_ts,)).fetchone():
            new_ts += 1
        c.execute(
            f"INSERT INTO main.system_snapshots({cols}, node) VALUES (?, ?, ?, ?, ?, ?, ?)", (new_ts, *rest, node)
        )
        added += 1
        moved += 1
    return added, moved


def copy_process_names(conn: sqlite3.Connection, info: mi.InputInfo) -> None:
    if not info.has("process_names", "pid"):
        return
    c = conn
    c.execute(
        "INSERT OR IGNORE INTO main.process_names(pid, name, seen_at) SELECT pid, name, seen_at FROM src.process_names"
    )
    upsert = (
        " WHERE true ON CONFLICT(node, pid) DO UPDATE SET name = excluded.name, seen_at = excluded.seen_at "
        "WHERE excluded.seen_at > main.node_process_names.seen_at"
    )
    if info.has("node_process_names", "node"):
        c.execute(
            "INSERT INTO main.node_process_names(node, pid, name, seen_at) "
            "SELECT node, pid, name, seen_at FROM src.node_process_names" + upsert
        )
    else:
        c.execute(
            "INSERT INTO main.node_process_names(node, pid, name, seen_at) "
            "SELECT ?, pid, name, seen_at FROM src.process_names" + upsert,
            (info.single_node or "",),
        )


def copy_aggregates(conn: sqlite3.Connection, info: mi.InputInfo) -> None:
    """Each node's minute counts kept apart (schema 6's ``node``): an input without the column (an older
    or Ingero recording) counted its only node's; one holding several nodes without it (an older merge:
    cluster totals) stays unattributed (``''``). The same node's same key twice (a rotated database) adds up."""
    if not info.has("event_aggregates", "bucket"):
        return
    cols = ", ".join(c for c in AGGREGATE_COLUMNS if info.has("event_aggregates", c))
    fallback = lit(info.single_node or "")
    node = f"CASE WHEN node != '' THEN node ELSE {fallback} END" if info.has("event_aggregates", "node") else fallback
    conn.execute(
        f"INSERT INTO main.event_aggregates({cols}, node) SELECT {cols}, {node} FROM src.event_aggregates "
        f"WHERE true {AGGREGATES_UPSERT}"
    )


def copy_simple(conn: sqlite3.Connection, info: mi.InputInfo, table: str, *, skip: tuple[str, ...] = ()) -> None:
    """Copy the rows of ``table``: every column the merged table and the input share, less ``skip``
    (e.g. an AUTOINCREMENT id that would collide across inputs)."""
    if not info.has(table):
        return
    mine = [r[1] for r in conn.execute(f'PRAGMA main.table_info("{table}")')]
    have = [col for col in mine if col not in skip and info.has(table, col)]
    if not have:
        return
    names = ", ".join(have)
    conn.execute(f"INSERT OR IGNORE INTO main.{table}({names}) SELECT {names} FROM src.{table}")
