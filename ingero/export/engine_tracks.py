"""The serving engines' own series (``trace --inference``: ``engine_metrics``) as Perfetto counter tracks.

One track per engine process and metric, on its node's process, named ``"{engine} {pid}: {metric}"`` with
the metric's name as the engine publishes it; a point at every scrape that changed the value (the
scraper stores changes only; a counter track holds its value until the next point, as the recording's
reader carries it forward). A gauge is its value, a counter its running total (Perfetto's "delta" view
shows its rate); label sets are summed (:func:`ingero.store.engine_metrics.series`). A histogram is one
track of its mean per scrape interval (Δ``_sum`` / Δ``_count``: ``vllm:time_to_first_token_seconds
(mean)``), points only where requests were observed; its ``_bucket`` rows, whose ``le`` sets do not add
up, are left out (and so are a summary's quantiles: its ``_sum`` / ``_count`` make the same mean track), and
so are ``_created`` samples (start times, not values).
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ingero.store.engine_metrics import TABLE, Series, has_engine_metrics, series
from ingero.store.window import Window

MEAN = " (mean)"


@dataclass
class CounterTrack:
    name: str
    points: list[tuple[int, float]] = field(default_factory=list)  # (unix ns, value), oldest first


def rows_sql(where: str, order: str = "ts", *, with_rowid: bool = False) -> str:
    """The rows tracks are drawn from (ts, node, pid, engine, metric, labels, value; after the rowid with
    ``with_rowid``) where ``where`` holds: no histogram buckets, no summary quantiles, no _created samples."""
    return (
        f"SELECT {'rowid, ' if with_rowid else ''}ts, node, pid, engine, metric, labels, value FROM {TABLE} WHERE ({where}) "
        r"AND metric NOT LIKE '%\_bucket' ESCAPE '\' AND metric NOT LIKE '%\_created' ESCAPE '\' "
        """AND labels NOT LIKE '%"quantile":%' """
        f"ORDER BY {order}"
    )


def read_tracks(conn: sqlite3.Connection, window: Window) -> dict[str, list[CounterTrack]]:
    """Each node's counter tracks in ``window`` ({} without the table)."""
    if not has_engine_metrics(conn):
        return {}
    where, params = window.clause("ts")
    return tracks_of(list(conn.execute(rows_sql(where), params)))


def tracks_of(rows: list[Any]) -> dict[str, list[CounterTrack]]:
    """Each node's counter tracks from :func:`rows_sql`'s rows (tuples or JSON lists, any order)."""
    typed = sorted((int(a), str(b), int(c), str(d), str(e), str(f), float(g)) for a, b, c, d, e, f, g in rows)
    return tracks_by_node(series(typed))


def tracks_by_node(found: dict[tuple[str, int, str, str], Series]) -> dict[str, list[CounterTrack]]:
    out: dict[str, list[CounterTrack]] = defaultdict(list)
    for (node, pid, engine, metric), s in sorted(found.items()):
        if metric.endswith("_bucket") or metric.endswith("_created"):
            continue
        head = f"{engine} {pid}: "
        for part in ("_sum", "_count"):
            base = metric[: -len(part)] if metric.endswith(part) else ""
            if base and (node, pid, engine, base + "_sum") in found and (node, pid, engine, base + "_count") in found:
                if part == "_sum":
                    out[node].append(
                        CounterTrack(head + base + MEAN, _means(s, found[(node, pid, engine, base + "_count")]))
                    )
                break
        else:
            out[node].append(CounterTrack(head + metric, list(zip(s.ts, s.values, strict=True))))
    return {node: [t for t in tracks if t.points] for node, tracks in out.items()}


def _means(total: Series, count: Series) -> list[tuple[int, float]]:
    """Δsum / Δcount at each instant the count moved."""
    at = dict(zip(total.ts, total.values, strict=True))
    out: list[tuple[int, float]] = []
    prev_n = prev_s = None
    last_s = 0.0
    for ts, n in zip(count.ts, count.values, strict=True):
        last_s = at.get(ts, last_s)
        if prev_n is not None and prev_s is not None and n > prev_n:
            out.append((ts, (last_s - prev_s) / (n - prev_n)))
        prev_n, prev_s = n, last_s
    return out


__all__ = ["CounterTrack", "read_tracks", "rows_sql", "tracks_by_node", "tracks_of"]
