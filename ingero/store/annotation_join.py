"""The labels in force for an event: Ingero's annotation join (agent 0.17), and a summary for explain.

An annotation applies to an event (``timestamp``, ``pid``, ``node``) when

* its scope matches: unscoped (pid 0) applies to every process; a scoped one to the same pid **of the
  same incarnation**. Incarnations are the pid's lifetimes seen in the recording: from its
  ``process_fork`` (the parent's event, the child in arg1) or, when no fork was seen, its first
  ``process_exec``, to its ``process_exit``. The annotation's instant (a span's start) places it in one
  lifetime; when the annotation or the event falls in none (no lifecycle seen), pid and time decide,
  as in Ingero, so a reused pid cannot inherit a previous run's labels when its lifetimes were seen;
* its time matches: a span applies within [span_start, span_end]; an instant applies from its
  timestamp on (a mark in the run: ``step=2`` after ``step=1`` replaces it);
* its node matches (a merged database): annotations of node '' (Ingero's rows) apply to every node.

For one key the latest annotation wins (by its instant, then its id), as in Ingero's test of two
sequential steps. One sweep over events and annotations in time order: O((E + A) log(E + A)).
"""

from __future__ import annotations

import bisect
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ingero.errors import UsageError
from ingero.store.annotations import Annotation, format_labels, has_annotations, list_annotations
from ingero.store.catalog import op_ids

_FORK, _EXEC, _EXIT = op_ids("process_fork", "process_exec", "process_exit")
_NO_END = (1 << 63) - 1
MAX_ANNOTATIONS = 1_000_000  # read for one join at most
SUMMARY_VALUES = 3  # values of one key shown in explain's text


@dataclass(frozen=True)
class EventKey:
    timestamp: int
    pid: int
    node: str = ""


def lifecycle_sql(node: str | None = None) -> str:
    """The process lifecycle rows a join needs (timestamp, pid, source, op, arg1[, node])."""
    ops = ", ".join(str(op) for _, op in (_FORK, _EXEC, _EXIT))
    cols = "timestamp, pid, source, op, arg1" + (f", {node} AS node" if node else "")
    return f"SELECT {cols} FROM events WHERE source = {_FORK[0]} AND op IN ({ops})"


class Lifetimes:
    """Each (node, pid)'s lifetimes [start, end) from the recording's lifecycle events."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._starts: dict[tuple[str, int], list[int]] = {}
        self._ends: dict[tuple[str, int], list[int]] = {}
        self._nodes: dict[int, set[str]] = {}  # pid -> the nodes it had lifetimes on
        cols = {r[1] for r in conn.execute("PRAGMA table_info(events)")}
        rows = conn.execute(lifecycle_sql("node" if "node" in cols else "''") + " ORDER BY timestamp").fetchall()
        for ts, pid, _source, op, arg1, nd in rows:
            if op == _FORK[1]:
                self._open((str(nd), int(arg1)), int(ts), fork=True)
            elif op == _EXEC[1]:
                self._open((str(nd), int(pid)), int(ts), fork=False)
            else:
                ends = self._ends.get((str(nd), int(pid)))
                if ends and ends[-1] == _NO_END:
                    ends[-1] = int(ts)

    def _open(self, key: tuple[str, int], ts: int, *, fork: bool) -> None:
        ends = self._ends.setdefault(key, [])
        if ends and ends[-1] == _NO_END:
            if fork:  # a fork of a pid still open: its exit was not seen; the new lifetime starts here
                ends[-1] = ts
            else:
                return  # an exec inside a lifetime (fork, then exec) is the same process
        self._starts.setdefault(key, []).append(ts)
        ends.append(_NO_END)
        self._nodes.setdefault(key[1], set()).add(key[0])

    def at(self, node: str, pid: int, ts: int) -> int:
        """The index of the lifetime of ``pid`` on ``node`` that holds ``ts``; -1 for none. No node
        (a result without a node column, Ingero's rows): the pid's node when it was on one only."""
        if not node:
            nodes = self._nodes.get(pid, set())
            node = next(iter(nodes)) if len(nodes) == 1 else ""
        starts = self._starts.get((node, pid))
        if not starts:
            return -1
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts < self._ends[(node, pid)][i] else -1


def _order(a: Annotation) -> tuple[int, int]:
    return (a.span_start if a.is_span else a.timestamp, a.id)


def labels_in_force(conn: sqlite3.Connection, events: Sequence[EventKey]) -> list[dict[str, str]]:
    """For each event, the labels in force (see the module docstring); {} where none."""
    out: list[dict[str, str]] = [{} for _ in events]
    if not events or not has_annotations(conn):
        return out
    last = max(e.timestamp for e in events)
    marks = sorted(list_annotations(conn, None, last, limit=MAX_ANNOTATIONS, overlapping=True), key=_order)
    if not marks:
        return out
    life = Lifetimes(conn)
    where = [-1 if not a.pid else life.at(a.node, a.pid, _order(a)[0]) for a in marks]
    # Instants in force, per (node, pid, lifetime): key -> ((instant, id), value). Spans: active list.
    instants: dict[tuple[str, int, int], dict[str, tuple[tuple[int, int], str]]] = {}
    spans: list[int] = []
    j = 0
    for i in sorted(range(len(events)), key=lambda k: events[k].timestamp):
        ev = events[i]
        while j < len(marks) and _order(marks[j])[0] <= ev.timestamp:
            a = marks[j]
            if a.is_span:
                spans.append(j)
            else:
                held = instants.setdefault((a.node, a.pid, where[j]), {})
                for k, v in a.labels.items():
                    held[k] = (_order(a), v)
            j += 1
        spans = [s for s in spans if marks[s].span_end >= ev.timestamp]
        here = life.at(ev.node, ev.pid, ev.timestamp)
        found: dict[str, tuple[tuple[int, int], str]] = {}
        for (nd, pid, iv), held in instants.items():
            if _applies(nd, pid, iv, ev, here):
                for k, got in held.items():
                    if k not in found or got[0] > found[k][0]:
                        found[k] = got
        for s in spans:
            a = marks[s]
            if _applies(a.node, a.pid, where[s], ev, here):
                for k, v in a.labels.items():
                    if k not in found or _order(a) > found[k][0]:
                        found[k] = (_order(a), v)
        out[i] = {k: v for k, (_, v) in sorted(found.items())}
    return out


def _applies(node: str, pid: int, lifetime: int, ev: EventKey, ev_lifetime: int) -> bool:
    if node and ev.node and node != ev.node:
        return False
    if not pid:
        return True
    if pid != ev.pid:
        return False
    return lifetime < 0 or ev_lifetime < 0 or lifetime == ev_lifetime


def with_labels(conn: sqlite3.Connection, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """``query --annotations``: each result row plus the ``labels`` (``k=v ...``) of its event. The
    result must have ``timestamp`` and ``pid`` columns (``node`` too, when it has one)."""
    names = [c.lower() for c in columns]
    missing = [c for c in ("timestamp", "pid") if c not in names]
    if missing:
        raise UsageError(
            f"--annotations joins on the result's timestamp and pid: no {' or '.join(missing)} column",
            hint="select e.timestamp and e.pid (the default query has both)",
        )
    ts, pid = names.index("timestamp"), names.index("pid")
    node = names.index("node") if "node" in names else None
    keys = [EventKey(int(r[ts] or 0), int(r[pid] or 0), str(r[node] or "") if node is not None else "") for r in rows]
    return [[*r, format_labels(labels)] for r, labels in zip(rows, labels_in_force(conn, keys), strict=True)]


def label_summary(
    conn: sqlite3.Connection, start_ns: int | None, end_ns: int | None, node: str | None = None
) -> dict[str, Any]:
    """``explain --annotations``: the window's protocol labels by key: how many values, the first and
    last, how many rows, spans and scoped processes (``ingero annotate`` messages are listed apart)."""
    marks = [
        a
        for a in list_annotations(conn, start_ns, end_ns, limit=MAX_ANNOTATIONS, overlapping=True)
        if (node is None or not a.node or a.node == node) and "message" not in a.labels
    ]
    keys: dict[str, dict[str, Any]] = {}
    for a in marks:
        for k, v in a.labels.items():
            entry = keys.setdefault(k, {"values": [], "first": v, "last": v})
            if v not in entry["values"]:
                entry["values"].append(v)
            entry["last"] = v
    return {
        "annotations": len(marks),
        "spans": sum(1 for a in marks if a.is_span),
        "pids": sorted({a.pid for a in marks if a.pid}),
        "writers": sorted({a.peer_uid for a in marks}),
        "keys": {
            k: {"distinct": len(e["values"]), "first": e["first"], "last": e["last"]} for k, e in sorted(keys.items())
        },
    }


def render_label_summary(summary: dict[str, Any]) -> str:
    """The text section of ``explain --annotations`` ('' when the window has no labels)."""
    if not summary["annotations"]:
        return ""
    head = f"\nlabels (ingero annotate, {summary['annotations']} annotation(s), {summary['spans']} span(s)"
    if summary["pids"]:
        head += ", pids " + ", ".join(str(p) for p in summary["pids"][:8]) + ("..." if len(summary["pids"]) > 8 else "")
    lines = [head + "):"]
    for k, e in summary["keys"].items():
        span = e["first"] if e["distinct"] == 1 else f"{e['first']} ... {e['last']}"
        lines.append(f"  {k}: {e['distinct']} value(s), {span}")
    return "\n".join(lines) + "\n"


__all__ = [
    "EventKey",
    "Lifetimes",
    "label_summary",
    "labels_in_force",
    "lifecycle_sql",
    "render_label_summary",
    "with_labels",
]
