"""The serving engines' own series (``trace --inference``: ``engine_metrics``), re-exported by ``--prometheus``
and ``--otlp`` with the node they were recorded on.

**Names.** A family is exported as :data:`PREFIX` + the name the engine publishes, every character that is
not a letter, digit or underscore made an underscore: vLLM's ``vllm:num_requests_running`` is
``ingero_engine_vllm_num_requests_running``, Triton's ``nv_inference_request_success`` is
``ingero_engine_nv_inference_request_success_total``. The prefix keeps them apart from the same series
scraped straight from the engine (no double counting in a ``sum``) and from ingero's own metrics;
the underscore keeps the name valid without the colon Prometheus reserves for recording rules (and
that OpenTelemetry instrument names do not allow). The published name is in the help text.

**Labels.** ``node`` (the row's node: a merged recording re-exports every node's engines), ``rank``
(the agent's for its own node's rows and for rows without a node; empty for another node's rows, whose
rank the recording does not say — as :mod:`ingero.metrics.dbfeed` labels the event totals), ``engine`` and ``engine_pid`` (a restarted engine is a new series, as in the engine's own ``/metrics``),
then the engine's own labels; one that clashes with these is renamed ``exported_<name>``, as Prometheus
does with ``honor_labels: false``.

**Kinds.** The table stores samples, not ``# TYPE`` lines, so the kind follows the sample's shape: a
``_bucket`` with ``le`` makes a histogram (its ``_sum`` and ``_count`` join it), a ``quantile`` label a
summary, a ``_total`` a counter (prometheus_client, which vLLM and SGLang publish with, always adds it),
and so do the counters TGI and Triton publish without it (:data:`COUNTERS`); anything else is a gauge.
``_created`` samples are not values and are not re-exported.

**Latest values.** The scraper stores a sample when it changes and every sample once a minute
(:data:`~ingero.agent.trace.engine_scrape.FULL_EVERY_NS`), so the rows of the last :data:`HOLD_NS` before
the newest one hold every live series' current value; a series not seen in them (an engine that
exited) is no longer exported. Read at most every :data:`TTL_S` (the engines are scraped once a second).
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ingero.agent.trace.engine_scrape import FULL_EVERY_NS
from ingero.errors import IngeroError
from ingero.store.db import open_readonly
from ingero.store.engine_metrics import TABLE, has_engine_metrics

PREFIX = "ingero_engine_"
HOLD_NS = FULL_EVERY_NS + 5_000_000_000  # a full snapshot's period plus a scrape's slack
TTL_S = 1.0
OWN_LABELS = ("node", "rank", "engine", "engine_pid")
# Counters published without ``_total`` (TGI's Rust exporter, Triton's prometheus-cpp), from their docs.
COUNTERS = frozenset(
    {
        "tgi_request_count",
        "tgi_request_success",
        "tgi_request_failure",
        "tgi_batch_inference_count",
        "tgi_batch_inference_success",
        "tgi_batch_concat",
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
        "nv_energy_consumption",
    }
)
_INVALID = re.compile(r"[^a-zA-Z0-9_]")
LatestRow = tuple[str, int, str, str, dict[str, str], float]  # node, pid, engine, metric, labels, value


@dataclass
class EngineSeries:
    """One label set of a family: a value (counter, gauge), or buckets / quantiles with sum and count."""

    labels: dict[str, str]
    value: float = 0.0
    buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative count), +Inf last
    quantiles: list[tuple[float, float]] = field(default_factory=list)  # (quantile, value)
    sum: float = 0.0
    count: float = 0.0
    created_s: float | None = None  # the engine's _created (when the counter started), when it publishes it


@dataclass
class EngineFamily:
    name: str  # the exported name (a counter's without _total: the exposition adds it)
    kind: str  # counter | gauge | histogram | summary
    published: str  # the family's name as the engine publishes it (a counter's without _total)
    engine: str
    series: list[EngineSeries] = field(default_factory=list)

    @property
    def help(self) -> str:
        return f"{self.engine}'s {self.published}, re-exported by ingero from trace --inference"


def exported_name(published: str) -> str:
    return PREFIX + _INVALID.sub("_", published)


def latest(conn: sqlite3.Connection) -> list[LatestRow]:
    """The current value of every series in the recording: its latest row in the last HOLD_NS (one grouped
    query; SQLite takes a bare column of ``max(ts)``'s group from the row that holds the maximum)."""
    if not has_engine_metrics(conn):
        return []
    (newest,) = conn.execute(f"SELECT max(ts) FROM {TABLE}").fetchone()
    if newest is None:
        return []
    rows = conn.execute(
        f"SELECT node, pid, engine, metric, labels, value, max(ts) FROM {TABLE} WHERE ts >= ? "
        "GROUP BY node, pid, engine, metric, labels ORDER BY node, pid, engine, metric, labels",
        (int(newest) - HOLD_NS,),
    )
    return [
        (str(node), int(pid), str(engine), str(metric), json.loads(labels) if labels else {}, float(value))
        for node, pid, engine, metric, labels, value, _ in rows
    ]


def _shape(metric: str, labels: dict[str, str]) -> tuple[str, str, str]:
    """(kind, family's published name, part) of one sample; part: value | bucket | quantile | sum | count | created."""
    if "le" in labels and metric.endswith("_bucket"):
        return "histogram", metric[: -len("_bucket")], "bucket"
    if "quantile" in labels:
        return "summary", metric, "quantile"
    if metric in COUNTERS:  # before the suffixes: tgi_request_count, nv_inference_count are counters
        return "counter", metric, "value"
    for part in ("sum", "count", "created"):
        if metric.endswith("_" + part):
            return "", metric[: -len(part) - 1], part  # a histogram's, a summary's or a counter's: decided below
    if metric.endswith("_total"):
        return "counter", metric[: -len("_total")], "value"
    return "gauge", metric, "value"


def families(rows: list[LatestRow], node: str, rank: str) -> list[EngineFamily]:
    """The exported families of :func:`latest`'s rows; ``node`` where a row has none, ``rank`` on ``node``'s rows
    only (another node's rank is not in the recording: empty, as on that node's event totals)."""
    shapes = [_shape(metric, labels) for _, _, _, metric, labels, _ in rows]
    kinds: dict[tuple[str, str], str] = {}  # (engine, published) -> kind, from the samples that say it
    for (_, _, engine, _, _, _), (kind, published, _) in zip(rows, shapes, strict=True):
        if kind:
            kinds.setdefault((engine, published), kind)
    out: dict[str, EngineFamily] = {}
    taken: set[str] = set()  # exported sample names, so that no two families expose the same one
    series: dict[tuple[str, tuple[tuple[str, str], ...]], EngineSeries] = {}
    for (nd, pid, engine, metric, labels, value), (kind, published, part) in zip(rows, shapes, strict=True):
        if not kind:
            kind = kinds.get((engine, published), "")
            if not kind:  # a lone _sum/_count/_created: a gauge of its own name
                if part == "created":
                    continue
                kind, published, part = "gauge", metric, "value"
        if part == "created" and kind == "gauge":
            continue
        name = exported_name(published)
        fam = out.get(name)
        if fam is None:
            names = _sample_names(name, kind)
            if names & taken:
                continue  # two published names that sanitise alike: the first one kept
            taken |= names
            fam = out[name] = EngineFamily(name, kind, published, engine)
        elif (fam.kind, fam.engine, fam.published) != (kind, engine, published):  # two names that sanitise alike
            continue
        own = {k: v for k, v in labels.items() if k not in ("le", "quantile") and not k.startswith("__")}
        owner = nd or node
        lab = {"node": owner, "rank": rank if owner == node else "", "engine": engine, "engine_pid": str(pid)}
        lab |= {(f"exported_{k}" if k in OWN_LABELS else k): v for k, v in own.items()}
        key = (name, tuple(sorted(lab.items())))
        s = series.get(key)
        if s is None:
            s = series[key] = EngineSeries(lab)
            fam.series.append(s)
        if part == "bucket":
            s.buckets.append((float(labels["le"]), value))
        elif part == "quantile":
            s.quantiles.append((float(labels["quantile"]), value))
        elif part == "sum":
            s.sum = value
        elif part == "count":
            s.count = value
        elif part == "created":
            s.created_s = value
        else:
            s.value = value
    for fam in out.values():
        for s in fam.series:
            s.buckets.sort()
            s.quantiles.sort()
        if fam.kind == "histogram":  # a histogram whose buckets were never seen (only _sum/_count) is dropped
            fam.series = [s for s in fam.series if s.buckets and s.buckets[-1][0] == float("inf")]
    return [f for f in out.values() if f.series]


def _sample_names(name: str, kind: str) -> set[str]:
    if kind == "counter":
        return {name, name + "_total", name + "_created"}
    if kind in ("histogram", "summary"):
        return {name, name + "_bucket", name + "_sum", name + "_count", name + "_created"}
    return {name}


class EngineReader:
    """The engine families of a recording, re-read at most every TTL_S (a scrape storm reaches SQLite
    that often at most); a busy, missing or pre-inference file has none."""

    def __init__(self, path: Path, node: str, rank: str) -> None:
        self.path, self.node, self.rank = path, node, rank
        self._lock = threading.Lock()
        self._stamp = -TTL_S
        self._cached: list[EngineFamily] = []

    def __call__(self) -> list[EngineFamily]:
        with self._lock:
            if time.monotonic() - self._stamp >= TTL_S:
                self._stamp = time.monotonic()
                try:
                    conn = open_readonly(self.path, check_same_thread=False)
                    try:
                        rows = latest(conn)
                    finally:
                        conn.close()
                except (IngeroError, sqlite3.Error, OSError):
                    rows = []
                self._cached = families(rows, self.node, self.rank)
            return self._cached


__all__ = ["COUNTERS", "PREFIX", "EngineFamily", "EngineReader", "EngineSeries", "exported_name", "families", "latest"]
