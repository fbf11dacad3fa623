"""NCCL calls of one database as columnar arrays: what ``GET /api/v1/collectives`` answers.

One row per collective or point-to-point call from ``nccl_calls``, joined with ``nccl_comms`` for the
cluster-wide communicator id and the caller's rank (see :mod:`ingero.store.schema`). Calls whose
communicator has no cluster-wide id (created before tracing started, or by ``ncclCommInitAll``)
cannot be matched across nodes and are counted apart (``unmatched``). The answer is bounded: at most
``max_calls`` calls, the newest, with ``truncated`` set.

Shape (``comm`` indexes ``comms``; ids are 16 hex digits)::

    {"comms": [{"id": "9f3a…", "nranks": 4}], "gpu_model": "...", "truncated": false, "unmatched": 0,
     "calls": {"comm": [...], "seq": [...], "op": [...], "bytes": [...], "entry_ns": [...],
               "duration_ns": [...], "rank": [...]}}
"""

from __future__ import annotations

import sqlite3
from typing import Any

from ingero.store.catalog import U64
from ingero.store.window import Window

MAX_CALLS = 200_000
CALL_COLUMNS = ("comm", "seq", "op", "bytes", "entry_ns", "duration_ns", "rank")
IN_FLIGHT = -1  # nccl_calls.duration of a call that had not returned when recorded


def _has_tables(conn: sqlite3.Connection) -> bool:
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"nccl_calls", "nccl_comms"} <= names:
        return False
    return "comm_id" in {r[1] for r in conn.execute("PRAGMA table_info(nccl_comms)")}


def empty_answer() -> dict[str, Any]:
    return {"comms": [], "gpu_model": "", "truncated": False, "unmatched": 0, "calls": {c: [] for c in CALL_COLUMNS}}


def parse_comm(text: str | None) -> int | None:
    """``comm=`` parameter: a cluster-wide id in hex (a prefix of at least 4 digits is not enough:
    the whole id is asked for). Raises ValueError."""
    if text is None or text == "":
        return None
    t = text.strip().lower().removeprefix("0x")
    if not t or len(t) > 16 or any(ch not in "0123456789abcdef" for ch in t):
        raise ValueError(f"comm={text!r} is not a communicator id (up to 16 hex digits)")
    return int(t, 16)


def read_calls(
    conn: sqlite3.Connection, window: Window, *, comm: int | None = None, max_calls: int = MAX_CALLS
) -> dict[str, Any]:
    """The window's NCCL calls with a cluster-wide communicator id, oldest first (see the module doc)."""
    out = empty_answer()
    if not _has_tables(conn):
        return out
    where, params = window.clause("c.timestamp")
    sql_from = (
        f"FROM nccl_calls c JOIN nccl_comms m ON m.node = c.node AND m.pid = c.pid AND m.comm = c.comm WHERE {where}"
    )
    args: list[Any] = list(params)
    if comm is not None:
        sql_from += " AND m.comm_id = ?"
        args.append(comm - (1 << 64) if comm >= 1 << 63 else comm)
    matched = sql_from + " AND m.comm_id != 0"
    rows = conn.execute(
        "SELECT m.comm_id, m.nranks, c.seq, c.op, c.bytes, c.timestamp, c.duration, m.rank "
        f"{matched} ORDER BY c.timestamp DESC LIMIT ?",
        (*args, max_calls + 1),
    ).fetchall()
    out["truncated"] = len(rows) > max_calls
    rows = rows[:max_calls]
    rows.reverse()
    if comm is None:
        out["unmatched"] = int(
            conn.execute(
                f"SELECT count(*) FROM nccl_calls c WHERE {where} AND NOT EXISTS ("
                "SELECT 1 FROM nccl_comms m WHERE m.node = c.node AND m.pid = c.pid AND m.comm = c.comm "
                "AND m.comm_id != 0)",
                params,
            ).fetchone()[0]
        )
    index: dict[int, int] = {}
    comms: list[dict[str, Any]] = []
    cols: dict[str, list[int]] = {c: [] for c in CALL_COLUMNS}
    for cid, nranks, seq, op, nbytes, ts, dur, rank in rows:
        i = index.get(cid)
        if i is None:
            i = index[cid] = len(comms)
            comms.append({"id": f"{cid & U64:016x}", "nranks": int(nranks)})
        cols["comm"].append(i)
        cols["seq"].append(seq)
        cols["op"].append(op)
        cols["bytes"].append(nbytes)
        cols["entry_ns"].append(ts)
        cols["duration_ns"].append(dur)
        cols["rank"].append(rank)
    out["comms"] = comms
    out["calls"] = cols
    try:
        row = conn.execute("SELECT gpu_model FROM sessions WHERE gpu_model != '' ORDER BY started_at DESC LIMIT 1")
        got = row.fetchone()
        out["gpu_model"] = str(got[0]) if got else ""
    except sqlite3.OperationalError:
        pass
    return out
