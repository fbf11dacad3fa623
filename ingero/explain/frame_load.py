"""Loading events into numpy frames (:mod:`ingero.explain.frame`), fast: the one place the explain engine
reads ``events`` row by row.

Materialising a million rows through ``sqlite3`` cursors costs about a microsecond per value; SQLite's
own ``group_concat`` over integer expressions costs a fraction of that. So each row is packed *inside
SQLite* and read back as comma-separated strings that numpy parses in C, in one pass over the events:

* ``duration`` as recorded (capped to [0, 2^43 ns ≈ 2.4 h] by numpy)
* ``b = ((timestamp - t0) // ts_div) << 22 | pid``             (pid_max is at most 2^22)
* ``t = (tid - pid) << 20 | node_idx << 13 | source << 9 | op << 1 | failed`` (``tid - pid`` is ``0`` for a
  process's main thread: short strings; small fields low, so the numbers stay short)
* ``arg0`` and ``arg1`` (the rows some rule reads keep them: :data:`ARG_OPS`).

Only GPU ids per process come from a second, narrower query (when a node has several GPU processes).

Node names map to small integers through a ``CASE`` expression built from the database's node list;
databases written by several nodes (a merged cluster DB) are split into one :class:`Frame` per node,
because latency distributions of different machines are never mixed.

Large tables are read in rowid slices (over sibling read-only connections with ``threads``), each slice's
columns parsed and unpacked in place. Whether numpy may back these columns with huge pages is the entry
point's choice (:mod:`ingero.explain.hugepages`), applied here before the first columns are allocated.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ingero.errors import IngeroError
from ingero.explain import hugepages
from ingero.explain.frame import GPU_SOURCES, I64, ArgRows, Frame, arg_row_mask
from ingero.store.db import node_names, open_readonly
from ingero.store.window import Window

__all__ = ["CHUNK_ROWS", "load_frames"]

_GPU_SQL = ", ".join(map(str, GPU_SOURCES))
MAX_DUR = (1 << 43) - 1
PID_BITS = 22
NODES_PER_QUERY = 127  # node index 127 = "not in the list" (found and loaded in another round)
CHUNK_ROWS = 2_000_000  # rows per group_concat string (keeps each string well under SQLite's 1 GB limit)
PARALLEL_MIN_ROWS = 200_000  # tables smaller than this are read by one query (threads cost more than they save)


def _parse(text: bytes | None) -> I64:
    if not text:
        return np.zeros(0, dtype=np.int64)
    return np.fromstring(text, dtype=np.int64, sep=",")


def _node_case(names: Sequence[str], trusted_single: bool = False) -> tuple[str, list[Any]]:
    if not names:
        return str(NODES_PER_QUERY), []
    if trusted_single and len(names) == 1:
        return "0", []  # the database names one node only: skip the per-row CASE
    whens = " ".join("WHEN ? THEN ?" for _ in names)
    params: list[Any] = []
    for i, n in enumerate(names):
        params.extend((n, i))
    return f"(CASE node {whens} ELSE {NODES_PER_QUERY} END)", params


def _filters(window: Window, node: str | None, pid: int | None) -> tuple[str, list[Any]]:
    where, params = window.clause("timestamp")
    extra: list[Any] = list(params)
    if node is not None:
        where += " AND node = ?"
        extra.append(node)
    if pid is not None:
        # GPU calls of this process only; host-side evidence stays node-wide (the rules pick the pid's rows)
        where += f" AND (source NOT IN ({_GPU_SQL}) OR pid = ?)"
        extra.append(pid)
    return where, extra


def _only_node(conn: sqlite3.Connection, name: str) -> bool:
    """True when the database's own bookkeeping (sessions and our writer's node_seq) names ``name`` only."""
    try:
        others = conn.execute("SELECT count(*) FROM node_seq WHERE node != ?", (name,)).fetchone()[0]
    except sqlite3.OperationalError:
        return False  # not written by our writer (an Ingero database): check every row
    return int(others) == 0


Slice = tuple[str, list[Any]]  # an extra WHERE term and its parameters: one group_concat query's rows
WHOLE: Slice = ("1", [])  # no extra range (a timestamp range would steer SQLite to the index, ~30% slower)


def _time_slices(
    conn: sqlite3.Connection, where: str, params: list[Any], threads: int, whole_table: bool
) -> tuple[int, int, list[Slice]]:
    # two queries: SQLite answers a lone min() or max() from the timestamp index, not both at once
    lo = conn.execute(f"SELECT min(timestamp) FROM events WHERE {where}", params).fetchone()[0]
    hi = conn.execute(f"SELECT max(timestamp) FROM events WHERE {where}", params).fetchone()[0]
    if lo is None or hi is None:
        return 0, 0, []
    lo, hi = int(lo), int(hi)
    # the table's size bounds the window's rows (max(rowid) is O(1)); count only when it might not fit
    bound = conn.execute("SELECT max(rowid) FROM events").fetchone()[0]
    if whole_table and (threads > 1 or (bound is not None and int(bound) > CHUNK_ROWS)):
        # a whole table in rowid ranges: each a scan of the table itself, never of the timestamp index
        # (a timestamp range would take SQLite there: several times slower on a multi-million-row table)
        by_rowid = _rowid_slices(conn, threads)
        if by_rowid:
            return lo, hi, by_rowid
    if bound is not None and int(bound) <= CHUNK_ROWS:
        return lo, hi, [WHOLE]
    count = int(conn.execute(f"SELECT count(*) FROM events WHERE {where}", params).fetchone()[0])
    n = max(1, math.ceil(count / CHUNK_ROWS))
    if n == 1:
        return lo, hi, [WHOLE]
    step = (hi - lo) // n + 1
    return lo, hi, [Window(lo + i * step, min(hi, lo + (i + 1) * step - 1)).clause("timestamp") for i in range(n)]


def _rowid_slices(conn: sqlite3.Connection, threads: int) -> list[Slice]:
    """Equal rowid ranges of the events table (a range scan of the table itself, in rowid order like
    the whole-table scan), at least one per thread and none over CHUNK_ROWS; [] when ``events`` is not
    a plain table (an Ingero 0.8 database read through a TEMP view has no rowid) or too small to split."""
    if conn.execute("SELECT 1 FROM sqlite_temp_master WHERE name = 'events'").fetchone():
        return []
    first, last = conn.execute("SELECT min(rowid), max(rowid) FROM events").fetchone()
    if first is None or int(last) - int(first) < PARALLEL_MIN_ROWS:
        return []
    first, last = int(first), int(last)
    n = max(threads, math.ceil((last - first + 1) / CHUNK_ROWS))
    step = (last - first) // n + 1
    return [("rowid BETWEEN ? AND ?", [first + i * step, min(last, first + (i + 1) * step - 1)]) for i in range(n)]


def _siblings(conn: sqlite3.Connection, threads: int) -> list[sqlite3.Connection]:
    """``conn`` and up to ``threads - 1`` more read-only connections to its database file, for the
    slices' queries to run at once (SQLite releases the GIL while it steps); just ``conn`` when the
    database is not a file."""
    if threads <= 1:
        return [conn]
    path = next((r[2] for r in conn.execute("PRAGMA database_list") if r[1] == "main"), "")
    if not path:
        return [conn]
    out = [conn]
    try:
        for _ in range(threads - 1):
            out.append(open_readonly(path, check_same_thread=False))
    except IngeroError:
        pass  # fewer threads: still correct
    return out


def load_frames(
    conn: sqlite3.Connection,
    window: Window | None = None,
    *,
    node: str | None = None,
    pid: int | None = None,
    with_args: bool = True,
    threads: int = 1,
) -> dict[str, Frame]:
    """One :class:`Frame` per node with events in ``window`` (``node`` restricts to one).

    With ``pid``, GPU API rows are that process's only; host, I/O and network rows stay node-wide.
    ``threads`` > 1 splits a large table's scan into rowid ranges read at once over that many
    read-only connections (the caller's ``conn`` and new ones to the same file: only where ``conn``
    carries no per-connection limits, such as the agent's query budget). The frames are the same.
    Only a whole-table read is split: a time window or a node is found through its index, which a
    rowid range would take SQLite away from (a 30 s window of a 1 M-event table: 5-30x slower).
    """
    hugepages.apply()
    window = window or Window()
    where, params = _filters(window, node, pid)
    whole_table = window.unbounded and node is None
    t0, t1, slices = _time_slices(conn, where, params, threads if whole_table else 1, whole_table)
    if not slices:
        return {}
    conns = _siblings(conn, min(threads, len(slices))) if len(slices) > 1 else [conn]
    try:
        return _load(conns, where, params, slices, t0, t1, node, with_args)
    finally:
        for c in conns[1:]:
            c.close()


def _load(
    conns: list[sqlite3.Connection],
    where: str,
    params: list[Any],
    slices: list[Slice],
    t0: int,
    t1: int,
    node: str | None,
    with_args: bool,
) -> dict[str, Frame]:
    conn = conns[0]
    ts_div = max(1000, math.ceil((t1 - t0 + 1) / (1 << (63 - PID_BITS - 1))))
    names = [node] if node is not None else node_names(conn)
    trusted = node is not None or (len(names) == 1 and _only_node(conn, names[0]))
    frames: dict[str, Frame] = {}
    pending: list[str] | None = names or [""]
    seen: set[str] = set()
    while pending is not None:
        batch, pending = pending[:NODES_PER_QUERY], pending[NODES_PER_QUERY:] or None
        parts, missing = _load_batch(conns, where, params, slices, batch, t0, ts_div, trusted)
        if with_args and parts:
            _attach_args(conn, parts, where, params, batch, trusted)
        trusted = False
        frames.update(parts)
        seen.update(batch)
        if missing and pending is None:
            found = [
                r[0]
                for r in conn.execute(f"SELECT DISTINCT node FROM events WHERE {where}", params)
                if r[0] is not None and r[0] not in seen
            ]
            pending = sorted(found) or None
    return {k: frames[k] for k in sorted(frames)}


def _load_batch(
    conns: list[sqlite3.Connection],
    where: str,
    params: list[Any],
    slices: list[Slice],
    names: Sequence[str],
    t0: int,
    ts_div: int,
    trusted: bool,
) -> tuple[dict[str, Frame], bool]:
    case, case_params = _node_case(names, trusted)
    # sources and ops are small ids (< 16, < 256 in the catalog): masked rather than range-checked, which
    # keeps the per-row work to a few operations; the fields do not overlap, so ``+`` packs them like ``|``
    # (and costs SQLite less); the duration goes as it is (the cheapest column), capped by numpy
    # (each string comes back as a BLOB: bytes, which numpy parses as they are — a TEXT result is decoded
    # into a str first, a copy of every column that costs ~20 % of the read)
    packed = (
        "duration",
        f"(((timestamp - ?) / ?) << {PID_BITS}) | (pid & {(1 << PID_BITS) - 1})",
        f"((coalesce(tid, pid) - pid) << 20) + ({case} << 13) + ((source & 15) << 9) + ((op & 255) << 1)"
        " + (ret_code != 0)",
        "coalesce(arg0, 0)",
        "coalesce(arg1, 0)",
    )
    sql = f"SELECT {', '.join(f'CAST(group_concat({c}) AS BLOB)' for c in packed)} FROM events WHERE {where}"
    parsed: dict[int, list[I64]] = {}  # per slice, its five packed columns (filled by run())

    def run(k: int) -> None:  # connection k reads slices k, k + len(conns), ...
        for i in range(k, len(slices), len(conns)):
            sw, sp = slices[i]
            row = conns[k].execute(sql + f" AND {sw}", [t0, ts_div, *case_params, *params, *sp]).fetchone()
            parsed[i] = [_parse(txt) for txt in row]

    if len(conns) == 1:
        run(0)
    else:  # the caller's connection stays on the caller's thread (sqlite3's check_same_thread)
        with ThreadPoolExecutor(len(conns) - 1, thread_name_prefix="ingero-frame") as pool:
            others = [pool.submit(run, k) for k in range(1, len(conns))]
            run(0)
            for f in others:
                f.result()
    parts = [parsed[i] for i in range(len(slices))]
    if not all(p[0].size == p[1].size == p[2].size for p in parts):  # a NULL duration, time or op
        raise sqlite3.DataError("events rows with no duration, timestamp, pid, source or op")
    args = all(p[3].size == p[0].size == p[4].size for p in parts)  # NULL arguments (foreign rows): none
    cols = _unpacked(parts, t0, ts_div, args=args, nodes=case != "0")
    source, op, dur, failed, ts, pid, tid, x, y, idx = cols
    out: dict[str, Frame] = {}
    if case == "0":  # the database's one node, by its own bookkeeping: every row is node 0
        bounds = np.asarray([0, source.size], dtype=np.int64)
        missing = False
    else:
        missing = bool(np.any(idx == NODES_PER_QUERY))
        if idx.size and not (idx[0] == idx).all():  # several nodes: group their rows
            order = np.argsort(idx, kind="stable")
            source, op, dur, failed, ts, pid, tid, x, y, idx = (
                c[order] for c in (source, op, dur, failed, ts, pid, tid, x, y, idx)
            )
        bounds = np.searchsorted(idx, np.arange(len(names) + 1))
    for i, name in enumerate(names):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if hi <= lo:
            continue
        fr = Frame(
            node=name,
            source=source[lo:hi],
            op=op[lo:hi],
            dur=dur[lo:hi],
            failed=failed[lo:hi],
            ts_ns=ts[lo:hi],
            pid=pid[lo:hi],
            tid=tid[lo:hi],
        )
        arg0, arg1 = x[lo:hi], y[lo:hi]
        m = arg_row_mask(fr.source, fr.op, arg0)
        fr.args = ArgRows(fr.source, fr.op, fr.pid, fr.ts_ns, arg0, arg1, fr.tid, fr.dur).select(m)
        out[name] = fr
    return out, missing


def _unpacked(parts: list[list[I64]], t0: int, ts_div: int, *, args: bool, nodes: bool) -> list[npt.NDArray[Any]]:
    """The slices' packed columns (see the module notes) unpacked, end to end, into the frame's columns:
    source, op, dur, failed, ts, pid, tid, arg0, arg1, node index (empty unless ``nodes``). Each column is
    allocated once and every slice unpacked into its part (no temporary the size of the whole table: on
    millions of rows every fresh allocation is paid in page faults)."""
    n = sum(int(p[0].size) for p in parts)
    cols: list[npt.NDArray[Any]] = [np.empty(n, dtype=np.int64) for _ in range(10)]
    cols[3] = np.empty(n, dtype=bool)
    if not nodes:
        cols[9] = np.zeros(0, dtype=np.int64)
    if not args:
        cols[7] = cols[8] = np.zeros(n, dtype=np.int64)
    source, op, dur, failed, ts, pid, tid, x, y, idx = cols
    o = 0
    for d, b, t, xs, ys in parts:
        sl = slice(o, o + d.size)
        o += d.size
        np.clip(d, 0, MAX_DUR, out=dur[sl])
        np.bitwise_and(np.right_shift(t, 9, out=source[sl]), 0xF, out=source[sl])
        np.bitwise_and(np.right_shift(t, 1, out=op[sl]), 0xFF, out=op[sl])
        failed[sl] = np.bitwise_and(t, 1, out=tid[sl])  # tid[sl]: scratch
        if nodes:
            np.bitwise_and(np.right_shift(t, 13, out=idx[sl]), 0x7F, out=idx[sl])
        np.bitwise_and(b, (1 << PID_BITS) - 1, out=pid[sl])
        np.add(np.right_shift(t, 20, out=tid[sl]), pid[sl], out=tid[sl])
        np.add(np.multiply(np.right_shift(b, PID_BITS, out=ts[sl]), ts_div, out=ts[sl]), t0, out=ts[sl])
        if args:
            x[sl], y[sl] = xs, ys
    return cols


def _several(pids: I64) -> bool:
    return bool(pids.size) and bool((pids != pids[0]).any())


def _attach_args(
    conn: sqlite3.Connection,
    frames: dict[str, Frame],
    where: str,
    params: list[Any],
    names: Sequence[str],
    trusted: bool,
) -> None:
    """GPU ids per process, when a node has several GPU processes (one more scan, of GPU rows only)."""
    case, case_params = _node_case(names, trusted)
    if not any(_several(fr.pid[fr.gpu_mask()]) for fr in frames.values()):
        return
    for i_node, p, g in conn.execute(
        f"SELECT DISTINCT {case}, pid, gpu_id FROM events WHERE {where} AND source IN ({_GPU_SQL})",
        [*case_params, *params],
    ):
        if 0 <= i_node < len(names) and names[i_node] in frames:
            frames[names[i_node]].gpu_ids.setdefault(int(p), set()).add(int(g or 0))
