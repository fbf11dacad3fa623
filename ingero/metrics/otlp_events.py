"""``--otlp-events``: the causal chains and the slow GPU calls the database gains, pushed as OTLP log records.

A daemon thread polls the database (read-only) every ``interval_s`` and hands what is new to the
official ``OTLPLogExporter`` as SDK log records, the resource being the metrics' one:

* **causal chains** (at most :data:`MAX_PER_POLL` new rows of ``causal_chains`` by ``detected_at``):
  event ``ingero.causal_chain``, body = the chain's summary, severity HIGH/MEDIUM/LOW ->
  ERROR/WARN/INFO, attributes ``ingero.chain.id``, ``ingero.severity``, ``ingero.root_cause``,
  ``ingero.cuda_op``, ``ingero.p99_us``, ``ingero.p50_us``, ``ingero.tail_ratio``, ``ingero.node``;
* **slow GPU calls** (CUDA runtime, driver and NCCL rows stored since the last poll, by rowid) that
  took at least :data:`SLOW_FACTOR` times their op's median and at least :data:`SLOW_FLOOR_NS`. The
  median is the upper bound of the latency bucket that holds it in the recorder's histograms
  (:meth:`~ingero.metrics.state.MetricState.op_medians_ns`), so slow calls are pushed by
  ``trace``; an op without a median yet is not judged. At most :data:`MAX_SLOW_PER_POLL` per poll,
  the slowest first; the rest of that poll's rows are skipped. Event ``ingero.slow_call``, severity
  WARN, body "cudaStreamSync took 52.2ms (≥ 10x its median ≤ 5ms), pid 4242", attributes
  ``ingero.op``, ``ingero.source``, ``ingero.duration_us``, ``ingero.median_us``, ``ingero.pid``,
  ``ingero.tid``, ``ingero.node``, ``ingero.stack_hash``.

Failed pushes are counted in ``ingero_export_dropped_total{exporter="otlp-events"}`` and never retried
beyond the exporter's own timeout: the tracer never waits on it.
"""

from __future__ import annotations

import sqlite3
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Protocol

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from ingero import __version__
from ingero.errors import IngeroError
from ingero.metrics.otlp import DEFAULT_TIMEOUT_S, METRICS_PATH, ExportCounts, metrics_url, resource_for
from ingero.metrics.state import MetricState
from ingero.store.catalog import GPU_API_SOURCES, SOURCE_NAMES, op_name
from ingero.store.db import open_readonly
from ingero.timeutil import NS_PER_MS, fmt_duration

EXPORTER = "otlp-events"
LOGS_PATH = "/v1/logs"
MAX_PER_POLL = 1000
EVENT_NAME = "ingero.causal_chain"
SLOW_EVENT_NAME = "ingero.slow_call"
SLOW_FACTOR = 10  # a call this many times its op's median is slow ...
SLOW_FLOOR_NS = NS_PER_MS  # ... and at least this long
MAX_SLOW_PER_POLL = 200
_SLOW_COLS = "rowid, timestamp, source, op, duration, pid, tid, node, stack_hash"
_SEVERITY = {
    "HIGH": (SeverityNumber.ERROR, "ERROR"),
    "MEDIUM": (SeverityNumber.WARN, "WARN"),
    "LOW": (SeverityNumber.INFO, "INFO"),
}
_SCOPE = InstrumentationScope("ingero", __version__)
_COLS = "id, detected_at, severity, summary, root_cause, cuda_op, cuda_p99_us, cuda_p50_us, tail_ratio, node"


class LogExporter(Protocol):
    def export(self, batch: Any) -> Any: ...

    def shutdown(self) -> None: ...


def logs_url(text: str) -> str:
    """The logs endpoint beside the metrics one: ``http://c:4318`` -> ``http://c:4318/v1/logs``."""
    u = urllib.parse.urlsplit(metrics_url(text))
    path = u.path[: -len(METRICS_PATH)] + LOGS_PATH if u.path.endswith(METRICS_PATH) else u.path
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path, u.query, ""))


def chain_records(rows: list[tuple[Any, ...]], resource: Resource) -> list[ReadableLogRecord]:
    out = []
    for cid, detected, sev, summary, cause, op, p99, p50, ratio, node in rows:
        number, text = _SEVERITY.get(str(sev).upper(), (SeverityNumber.INFO, "INFO"))
        record = LogRecord(
            timestamp=int(detected),
            severity_text=text,
            severity_number=number,
            body=str(summary),
            event_name=EVENT_NAME,
            attributes={
                "ingero.chain.id": str(cid),
                "ingero.severity": str(sev).upper(),
                "ingero.root_cause": str(cause),
                "ingero.cuda_op": str(op or ""),
                "ingero.p99_us": int(p99 or 0),
                "ingero.p50_us": int(p50 or 0),
                "ingero.tail_ratio": float(ratio or 0),
                "ingero.node": str(node or ""),
            },
        )
        out.append(ReadableLogRecord(log_record=record, resource=resource, instrumentation_scope=_SCOPE))
    return out


def slow_call_records(
    rows: list[tuple[Any, ...]], medians: dict[int, int], resource: Resource
) -> list[ReadableLogRecord]:
    out = []
    for _rowid, ts, source, op, dur, pid, tid, node, stack in rows:
        name, median = op_name(int(source), int(op)), medians[int(source) << 8 | int(op)]
        record = LogRecord(
            timestamp=int(ts),
            severity_text="WARN",
            severity_number=SeverityNumber.WARN,
            body=f"{name} took {fmt_duration(int(dur))} (≥ {SLOW_FACTOR}x its median ≤ {fmt_duration(median)}), pid {pid}",
            event_name=SLOW_EVENT_NAME,
            attributes={
                "ingero.op": name,
                "ingero.source": SOURCE_NAMES.get(int(source), str(source)),
                "ingero.duration_us": int(dur) // 1000,
                "ingero.median_us": median // 1000,
                "ingero.pid": int(pid),
                "ingero.tid": int(tid or pid),
                "ingero.node": str(node or ""),
                "ingero.stack_hash": f"{int(stack or 0) & 0xFFFFFFFFFFFFFFFF:016x}",
            },
        )
        out.append(ReadableLogRecord(log_record=record, resource=resource, instrumentation_scope=_SCOPE))
    return out


class ChainLogPusher(ExportCounts):
    def __init__(
        self,
        state: MetricState,
        db_path: Path,
        exporter: LogExporter,
        *,
        interval_s: float = 10.0,
        resource: Resource | None = None,
    ) -> None:
        self.db_path = db_path
        self.exporter = exporter
        self.interval_s = interval_s
        self.resource = resource or resource_for(state)
        self._since: tuple[int, str] = (-1, "")
        self._rowid: int | None = None  # the events already looked at (None: not yet read; history is not pushed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(state, EXPORTER)

    def poll(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], dict[int, int]]:
        """What is new since the last poll, in one read-only open of the database: the chains (by
        detected_at, then id), the slow GPU calls, and the medians those were judged by."""
        medians = self.state.op_medians_ns(GPU_API_SOURCES)
        try:
            conn = open_readonly(self.db_path, check_same_thread=False)
        except IngeroError:
            return [], [], medians
        try:
            return self._chains(conn), self._slow_calls(conn, medians), medians
        finally:
            conn.close()

    def _chains(self, conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
        t, cid = self._since
        try:
            return conn.execute(
                f"SELECT {_COLS} FROM causal_chains WHERE detected_at > ? OR (detected_at = ? AND id > ?) "
                "ORDER BY detected_at, id LIMIT ?",
                (t, t, cid, MAX_PER_POLL),
            ).fetchall()
        except sqlite3.Error:
            return []

    def _slow_calls(self, conn: sqlite3.Connection, medians: dict[int, int]) -> list[tuple[Any, ...]]:
        """GPU calls stored since the last poll that took ≥ SLOW_FACTOR x their op's median (slowest
        first, at most MAX_SLOW_PER_POLL), in rowid order."""
        try:
            top = conn.execute("SELECT max(rowid) FROM events").fetchone()[0] or 0
            since, self._rowid = self._rowid, int(top)
            if since is None or not medians or top <= since:
                return []
            whens = " ".join(f"WHEN {code} THEN {max(SLOW_FACTOR * m, SLOW_FLOOR_NS)}" for code, m in medians.items())
            rows = conn.execute(
                f"SELECT {_SLOW_COLS} FROM events WHERE rowid > ? AND rowid <= ? "
                f"AND duration >= (CASE (source << 8) | op {whens} ELSE {(1 << 63) - 1} END) "
                "ORDER BY duration DESC LIMIT ?",
                (since, top, MAX_SLOW_PER_POLL),
            ).fetchall()
            return sorted(rows)
        except sqlite3.Error:
            return []

    def push_once(self) -> int:
        """Push the chains and slow calls found since the last call; how many records were pushed (0 on
        failure, counted)."""
        rows, slow, medians = self.poll()
        if not rows and not slow:
            return 0
        if rows:
            self._since = (int(rows[-1][1]), str(rows[-1][0]))
        try:
            result = self.exporter.export(
                chain_records(rows, self.resource) + slow_call_records(slow, medians, self.resource)
            )
        except Exception:  # the exporter's own failure modes are many; each is one drop
            result = None
        if getattr(result, "name", "") == "SUCCESS":
            self.sent += 1
            return len(rows) + len(slow)
        self.dropped += 1
        return 0

    def start(self) -> None:
        self.poll()  # marks the events already stored as history: only later slow calls are pushed
        self._thread = threading.Thread(target=self._loop, name="ingero-otlp-events", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push_once()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=DEFAULT_TIMEOUT_S + 1)
        self.exporter.shutdown()


def otlp_log_exporter(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> LogExporter:
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

    return OTLPLogExporter(endpoint=logs_url(url), timeout=timeout_s)
