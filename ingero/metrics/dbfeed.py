"""What the database contributes to the metrics: its size, its causal chains, and — for ``ingero serve``,
which has no recorder — the recording itself.

* :func:`database_provider` (trace and serve): ``ingero_db_size_bytes`` from ``stat`` and
  ``ingero_causal_chains{severity}`` from one ``GROUP BY`` over ``causal_chains``, cached for
  :data:`CHAINS_TTL_S` so a scrape storm never reaches SQLite more than that often.
* the serving engines' own series (``trace --inference``): :class:`~ingero.metrics.engine_series.EngineReader`;
  :func:`attach_database` registers it with the provider above;
* :class:`DatabaseFeed` (serve only): replays the rows added since its last read through the very
  same :meth:`MetricState.observe` the tracer feeds (``main.events`` by rowid, at most every
  :data:`REFRESH_TTL_S`), then sets the event and byte totals from ``event_aggregates`` (exact even
  where selective storage kept a sample). Histograms therefore describe the stored rows.
  The totals are labelled with the node of their rows (``event_aggregates.node``, schema 6), as the
  engines' series are: a merged recording exports each node's ``ingero_events_total`` and
  ``ingero_bytes_total`` under that node (``rank`` empty: the recording does not say it), the agent's
  own node (a row without one included) keeps its own labels, and no node's events count twice.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np

from ingero.agent.trace.recorder import BYTES_OPS
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.clickhouse.progress import TableLag, lag_of, targets
from ingero.errors import IngeroError
from ingero.metrics import registry as r
from ingero.metrics.state import MetricState, Provider, op_labels
from ingero.store.db import open_readonly

CHAINS_TTL_S = 10.0
REFRESH_TTL_S = 10.0
ROWS_PER_READ = 200_000
Totals = dict[int, tuple[int, int]]  # op code (source << 8 | op) -> (events, bytes)
_EVENT_COLS = (
    "rowid, timestamp, max(coalesce(duration, 0), 0), coalesce(arg0, 0), coalesce(arg1, 0), pid, tid, "
    "coalesce(ret_code, 0), source, op"
)


def db_size(path: Path) -> int:
    total = 0
    for p in (path, Path(f"{path}-wal")):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(p).st_size
    return total


def attach_database(state: MetricState, path: Path) -> None:
    """Everything the recording at ``path`` contributes at scrape time: size, chains, shipping, engines."""
    from ingero.metrics.engine_series import EngineReader

    state.add_provider(database_provider(state, path))
    state.add_engine_provider(EngineReader(path, *state.base_labels()))


def database_provider(state: MetricState, path: Path) -> Provider:
    cache: dict[str, int] = {}
    shipping: list[tuple[str, TableLag]] = []  # (target, lag) of each store the recording is shipped to
    stamp = [-CHAINS_TTL_S]
    lock = threading.Lock()

    def chains() -> dict[str, int]:
        with lock:
            if time.monotonic() - stamp[0] >= CHAINS_TTL_S:
                stamp[0] = time.monotonic()
                cache.clear()
                shipping.clear()
                try:
                    conn = open_readonly(path, check_same_thread=False)
                    try:
                        for sev, n in conn.execute("SELECT severity, count(*) FROM causal_chains GROUP BY severity"):
                            cache[str(sev).upper()] = int(n)
                        shipping.extend((t, lg) for t in targets(conn) for lg in lag_of(conn, t))
                    finally:
                        conn.close()
                except (IngeroError, sqlite3.Error, OSError):  # busy, missing or pre-chains file: no chain series
                    cache.clear()
            return dict(cache)

    def provide() -> list[r.Sample]:
        base = state.base_labels()
        found = chains()
        out = [r.Sample(r.DB_SIZE, base, float(db_size(path)))]
        for sev in r.SEVERITIES:
            out.append(r.Sample(r.CHAINS, (*base, sev), float(found.get(sev, 0))))
        now = time.time_ns()
        for target, lg in list(shipping):
            age = max(0.0, (now - lg.oldest_unshipped_ns) / 1e9) if lg.oldest_unshipped_ns else 0.0
            out.append(r.Sample(r.SHIP_BEHIND, (*base, target, lg.table), float(lg.unshipped_rows)))
            out.append(r.Sample(r.SHIP_LAG, (*base, target, lg.table), age))
        return out

    return provide


class DatabaseFeed:
    """Feeds a :class:`MetricState` from a database's rows (``ingero serve``)."""

    def __init__(self, state: MetricState, path: Path) -> None:
        self.state = state
        self.path = path
        self._last_rowid = 0
        self._last_read = -REFRESH_TTL_S
        self._lock = threading.Lock()
        self._others: dict[str, Totals] = {}  # nodes of the recording other than the agent's: their totals
        state.add_provider(self._other_nodes)

    def refresh(self, *, force: bool = False) -> None:
        with self._lock:
            if not force and time.monotonic() - self._last_read < REFRESH_TTL_S:
                return
            self._last_read = time.monotonic()
            conn = open_readonly(self.path, check_same_thread=False)
            try:
                self._read(conn)
            finally:
                conn.close()

    def _read(self, conn: sqlite3.Connection) -> None:
        tables = {row[0] for row in conn.execute("SELECT name FROM main.sqlite_master WHERE type = 'table'")}
        if "nccl_comms" in tables:
            cols = {row[1] for row in conn.execute("PRAGMA main.table_info(nccl_comms)")}
            comm_id = "comm_id" if "comm_id" in cols else "0"
            for comm, pid, rank, nranks, cid in conn.execute(
                f"SELECT comm, pid, rank, nranks, {comm_id} FROM main.nccl_comms ORDER BY pid, seen_at, comm"
            ):
                self.state.register_comm(
                    int(pid), int(comm) & 0xFFFFFFFFFFFFFFFF, int(rank), int(nranks), int(cid or 0)
                )
        while True:
            rows = conn.execute(
                f"SELECT {_EVENT_COLS} FROM main.events WHERE rowid > ? ORDER BY rowid LIMIT ?",
                (self._last_rowid, ROWS_PER_READ),
            ).fetchall()
            if not rows:
                break
            self._last_rowid = int(rows[-1][0])
            self.state.observe(_as_events(rows))
            if len(rows) < ROWS_PER_READ:
                break
        if "event_aggregates" in tables:
            own, others = _node_totals(conn, self.state.base_labels()[0])
            for totals in others.values():  # replayed rows of other nodes are theirs, not the agent's
                for code in totals.keys() - own.keys():
                    own[code] = (0, 0)
            self.state.set_counts(own)
            self._others = others

    def _other_nodes(self) -> list[r.Sample]:
        """The event and byte totals of the recording's other nodes, each under its node."""
        out = []
        for node, totals in sorted(self._others.items()):
            for code, (count, nbytes) in sorted(totals.items()):
                src, op = op_labels(code)
                if count:
                    out.append(r.Sample(r.EVENTS, (node, "", src, op), float(count)))
                if (code >> 8, code & 0xFF) in BYTES_OPS:
                    out.append(r.Sample(r.BYTES, (node, "", src, op), float(nbytes)))
        return out


def _node_totals(conn: sqlite3.Connection, own: str) -> tuple[Totals, dict[str, Totals]]:
    """``event_aggregates`` summed per node and op: the agent's own node's (``own``, or a row without a
    node: a recording before schema 6 has no column), and every other node's."""
    cols = {row[1] for row in conn.execute("PRAGMA main.table_info(event_aggregates)")}
    node = "node" if "node" in cols else "''"
    mine: Totals = {}
    others: dict[str, Totals] = {}
    for nd, s, o, n, b in conn.execute(
        f"SELECT {node}, source, op, sum(count), sum(sum_arg0) FROM main.event_aggregates GROUP BY 1, 2, 3"
    ):
        totals = mine if nd in ("", None, own) else others.setdefault(str(nd), {})
        code = int(s) << 8 | int(o)
        count, nbytes = totals.get(code, (0, 0))
        totals[code] = (count + int(n), nbytes + int(b or 0))
    return mine, others


def _as_events(rows: list[tuple[int, ...]]) -> np.ndarray:
    cols = np.array([row[1:] for row in rows], dtype=np.int64).reshape(len(rows), 9)
    ev = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for i, name in enumerate(("ts", "duration", "arg0", "arg1", "pid", "tid", "ret", "source", "op")):
        ev[name] = cols[:, i].astype(EVENT_DTYPE[name], casting="unsafe")
    ev["stack_id"] = -1
    return ev
