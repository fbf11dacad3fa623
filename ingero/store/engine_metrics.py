"""Serving engines' own metrics (``ingero trace --inference``): the ``engine_metrics`` table.

One row per published sample, with the name exactly as the engine publishes it (vLLM's ``vllm:*``,
SGLang's ``sglang:*``, TGI's ``tgi_*``, Triton's ``nv_inference_*``): a histogram is its ``_bucket``
rows (``le`` in the labels), ``_sum`` and ``_count``; a counter its ``_total``; a gauge its value.

The scraper (:mod:`ingero.agent.trace.engine_scrape`) stores a sample when its value changed since that
engine's previous scrape, and every sample once a minute: a value holds from its row until the next row
of the same series (a reader carries it forward). The rows go through the tracer's single writer
(:meth:`ingero.store.writer.StoreWriter.write_batch`, ``engine_metrics=``, in :data:`ROW_COLUMNS` order).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any

TABLE = "engine_metrics"
TABLE_SQL = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
	ts      INTEGER NOT NULL,            -- unix nanos of the scrape
	node    TEXT    NOT NULL DEFAULT '',
	pid     INTEGER NOT NULL,            -- the serving process
	engine  TEXT    NOT NULL,            -- vllm | sglang | tgi | triton
	metric  TEXT    NOT NULL,            -- the sample's name as published (vllm:num_requests_waiting, ..._bucket)
	labels  TEXT    NOT NULL DEFAULT '', -- JSON object of the sample's labels (le for a bucket), sorted
	value   REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_engine_metrics_ts ON {TABLE}(ts);
"""
# The columns of one row handed to the writer (``node`` is the writer's own).
ROW_COLUMNS = ("ts", "pid", "engine", "metric", "labels", "value")
EngineMetricRow = tuple[int, int, str, str, str, float]
MAX_ROWS = 200_000  # read for one series query at most


def insert_sql(node_sql: str = "?") -> str:
    """The INSERT of one :data:`ROW_COLUMNS` row plus ``node`` (a literal, or ``?``)."""
    return (
        f"INSERT INTO {TABLE}({', '.join(ROW_COLUMNS)}, node) VALUES ({', '.join('?' * len(ROW_COLUMNS))}, {node_sql})"
    )


def labels_text(labels: dict[str, str]) -> str:
    return json.dumps(labels, separators=(",", ":"), sort_keys=True) if labels else ""


def has_engine_metrics(conn: sqlite3.Connection) -> bool:
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)).fetchone()
    return row is not None


@dataclass
class Series:
    """One engine's samples of one metric, summed over their label sets per scrape (a gauge per model,
    a histogram's ``_sum`` or ``_count``; never its ``_bucket`` rows, whose ``le`` sets do not add up)."""

    node: str
    pid: int
    engine: str
    metric: str
    ts: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def load_rows(
    conn: sqlite3.Connection,
    start_ns: int | None = None,
    end_ns: int | None = None,
    *,
    node: str | None = None,
    metrics: tuple[str, ...] = (),
    limit: int = MAX_ROWS,
) -> list[tuple[int, str, int, str, str, str, float]]:
    """Rows (ts, node, pid, engine, metric, labels, value) in the window, oldest first; [] without the table."""
    if not has_engine_metrics(conn):
        return []
    where = ["ts >= ?", "ts <= ?"]
    params: list[Any] = [-(1 << 63) if start_ns is None else start_ns, (1 << 63) - 1 if end_ns is None else end_ns]
    if node is not None:
        where.append("node = ?")
        params.append(node)
    if metrics:
        where.append(f"metric IN ({', '.join('?' * len(metrics))})")
        params += list(metrics)
    sql = f"SELECT ts, node, pid, engine, metric, labels, value FROM {TABLE} WHERE {' AND '.join(where)} ORDER BY ts LIMIT ?"
    return [
        (int(a), str(b), int(c), str(d), str(e), str(f), float(g))
        for a, b, c, d, e, f, g in conn.execute(sql, (*params, limit))
    ]


def series(rows: list[tuple[int, str, int, str, str, str, float]]) -> dict[tuple[str, int, str, str], Series]:
    """Per (node, pid, engine, metric): the sum over label sets at each scrape, each label set's value
    carried forward from its last row (the scraper stores changes only)."""
    held: dict[tuple[str, int, str, str], dict[str, float]] = {}
    out: dict[tuple[str, int, str, str], Series] = {}
    for ts, nd, pid, engine, metric, labels, value in rows:
        key = (nd, pid, engine, metric)
        cur = held.setdefault(key, {})
        cur[labels] = value
        s = out.setdefault(key, Series(nd, pid, engine, metric))
        total = sum(cur.values())
        if s.ts and s.ts[-1] == ts:
            s.values[-1] = total
        else:
            s.ts.append(ts)
            s.values.append(total)
    return out


def summary(
    conn: sqlite3.Connection, start_ns: int | None = None, end_ns: int | None = None, node: str | None = None
) -> list[dict[str, Any]]:
    """Per engine process in the window: its scrapes (distinct instants), series, first and last scrape,
    and the last value of each series but histogram buckets (summed over label sets, as :func:`series`)."""
    rows = load_rows(conn, start_ns, end_ns, node=node)
    out: dict[tuple[str, int, str], dict[str, Any]] = {}
    scrapes: dict[tuple[str, int, str], set[int]] = {}
    for (nd, pid, engine, metric), s in sorted(series(rows).items()):
        key = (nd, pid, engine)
        e = out.setdefault(key, {"node": nd, "pid": pid, "engine": engine, "series": 0, "last": {}})
        e["series"] += 1
        scrapes.setdefault(key, set()).update(s.ts)
        if not metric.endswith("_bucket"):
            e["last"][metric] = s.values[-1]
    for key, e in out.items():
        e["scrapes"], e["first_ns"], e["last_ns"] = len(scrapes[key]), min(scrapes[key]), max(scrapes[key])
    return list(out.values())


__all__ = [
    "ROW_COLUMNS",
    "TABLE",
    "TABLE_SQL",
    "EngineMetricRow",
    "Series",
    "has_engine_metrics",
    "insert_sql",
    "labels_text",
    "load_rows",
    "series",
    "summary",
]
