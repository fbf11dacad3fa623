"""Storage regime and true counts: what ``event_aggregates`` says about the stored rows.

Recorders (ingero's and Ingero's) store bulk ops only when slow or as a sample, and count every event,
stored or not, in ``event_aggregates`` (per minute, source, op and pid: count, stored, duration sum,
min and max). Explain reads it to:

* tell the regime: ``complete`` (every counted event is stored), ``selective`` (some ops sampled), or
  ``unknown`` (no aggregates: an older or foreign recording — stored rows are all there is);
* give sampled ops their true count, total and mean time and maximum, and say that their percentiles
  come from a sample (never a p50 of stored-only rows presented as complete);
* find recording holes: minutes inside the recording with nothing counted.

Each node is judged by its own aggregates (:func:`aggregate_scopes`): by ``event_aggregates.node``
(schema 6), which keeps a merged cluster database's nodes apart — one that sampled heavily is selective
while its peer that stored everything is complete. A database without the column (an older or Ingero
recording) counted its only node's; one holding several nodes without it (an older merge: cluster totals
summed over nodes) tells no node's regime, and its aggregates are not used.
"""

from __future__ import annotations

import dataclasses
import itertools
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field

from ingero.explain.stats import OpStats
from ingero.store.window import Window
from ingero.timeutil import NS_PER_S, fmt_ts

MINUTE_NS = 60 * NS_PER_S
COMPLETE, SELECTIVE, UNKNOWN = "complete", "selective", "unknown"


@dataclass
class Storage:
    regime: str = UNKNOWN
    counts: dict[tuple[int, int], tuple[int, int, int, int]] = field(default_factory=dict)  # count, stored, sum, max
    holes: list[tuple[int, int]] = field(default_factory=list)  # (from, to) unix ns

    def sampled(self, source: int, op: int) -> bool:
        c = self.counts.get((source, op))
        return c is not None and c[1] < c[0]

    def notes(self, node: str) -> list[str]:
        out = []
        sampled = sorted(k for k in self.counts if self.sampled(*k))
        if self.regime == SELECTIVE and sampled:
            from ingero.store.catalog import op_name

            parts = [
                f"{op_name(s, o)} {self.counts[(s, o)][1]:,} of {self.counts[(s, o)][0]:,}" for s, o in sampled[:4]
            ]
            out.append(
                f"{node}: selective storage — sampled ops ({', '.join(parts)} calls stored): counts, totals and "
                "means come from event_aggregates, percentiles from the stored sample; their throughput is not "
                "judged from stored rows"
            )
        for a, b in self.holes[:3]:
            out.append(f"{node}: recording hole — nothing counted from {fmt_ts(a)} to {fmt_ts(b)}")
        return out


def aggregate_scopes(conn: sqlite3.Connection, nodes: Sequence[str]) -> dict[str, str | None]:
    """The nodes explained (``nodes``) whose own aggregates this database holds, each with the ``node``
    filter that selects them: its name (schema 6), or None (all rows: a database without the column, holding
    that node alone). A node left out has none that can be told apart (see the module docstring)."""
    try:
        cols = {r[1] for r in conn.execute("PRAGMA table_info(event_aggregates)")}
    except sqlite3.OperationalError:
        return {}
    if "node" in cols:
        return {n: n for n in nodes}
    if not cols or len(nodes) != 1:
        return {}
    try:  # the database's sessions (cheap): an explain of one node of an older merge is not that node's
        (recorded,) = conn.execute("SELECT count(DISTINCT node) FROM sessions WHERE node != ''").fetchone()
    except sqlite3.OperationalError:
        recorded = 0
    return {nodes[0]: None} if recorded <= 1 else {}


def aggregates_where(window: Window, pid: int | None = None, node: str | None = None) -> tuple[str, list[int | str]]:
    """The WHERE clause (and its parameters) of ``event_aggregates`` rows in ``window`` (of ``pid``; counted
    by ``node``, a filter from :func:`aggregate_scopes`)."""
    where, params = window.clause("bucket")
    if window.start_ns is not None:  # buckets are minute-truncated: the window's first minute counts
        where, params = Window(window.start_ns - window.start_ns % MINUTE_NS, window.end_ns).clause("bucket")
    sql_params: list[int | str] = list(params)
    if pid is not None:
        where += " AND pid = ?"
        sql_params.append(pid)
    if node is not None:
        where += " AND node = ?"
        sql_params.append(node)
    return where, sql_params


def load_storage(conn: sqlite3.Connection, window: Window, pid: int | None = None, node: str | None = None) -> Storage:
    """The regime, true counts and holes of the aggregates in ``window`` (of ``pid``; counted by ``node``)."""
    where, sql_params = aggregates_where(window, pid, node)
    try:
        rows = conn.execute(
            "SELECT source, op, sum(count), sum(stored), sum(sum_dur), max(max_dur) FROM event_aggregates "
            f"WHERE {where} GROUP BY 1, 2",
            sql_params,
        ).fetchall()
        buckets = [
            int(r[0])
            for r in conn.execute(f"SELECT DISTINCT bucket FROM event_aggregates WHERE {where} ORDER BY 1", sql_params)
        ]
    except sqlite3.OperationalError:
        return Storage()
    if not rows:
        return Storage()
    counts = {(int(s), int(o)): (int(c), int(st), int(sd or 0), int(mx or 0)) for s, o, c, st, sd, mx in rows}
    regime = SELECTIVE if any(st < c for c, st, _, _ in counts.values()) else COMPLETE
    holes = [(a + MINUTE_NS, b) for a, b in itertools.pairwise(buckets) if b - a > MINUTE_NS]
    return Storage(regime, counts, holes)


def with_true_counts(ops: list[OpStats], storage: Storage) -> list[OpStats]:
    """Sampled ops get their true count, total, mean and max from the aggregates, and ``stored`` set."""
    out = []
    for st in ops:
        c = storage.counts.get((st.source, st.op))
        if c is None or c[1] >= c[0] or c[0] <= st.count:
            out.append(st)
            continue
        count, _stored, total, mx = c
        out.append(
            dataclasses.replace(
                st,
                count=count,
                total_ns=float(total),
                mean_ns=total / count if count else 0.0,
                max_ns=float(max(mx, st.max_ns)),
                stored=st.count,
            )
        )
    out.sort(key=lambda s: s.total_ns, reverse=True)
    return out
