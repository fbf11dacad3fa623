"""``--otlp-events``: the causal chains the database gains, pushed as OTLP log records.

A daemon thread polls ``causal_chains`` (read-only, at most :data:`MAX_PER_POLL` new rows by
``detected_at`` per ``interval_s``) and hands them to the official ``OTLPLogExporter`` as SDK log
records: body = the chain's summary, severity HIGH/MEDIUM/LOW -> ERROR/WARN/INFO, attributes
``ingero.chain.id``, ``ingero.severity``, ``ingero.root_cause``, ``ingero.cuda_op``, ``ingero.p99_us``,
``ingero.p50_us``, ``ingero.tail_ratio``, ``ingero.node``; the resource is the metrics' one. Failed
pushes are counted in ``ingero_export_dropped_total{exporter="otlp-events"}`` and never retried
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
from ingero.store.db import open_readonly

EXPORTER = "otlp-events"
LOGS_PATH = "/v1/logs"
MAX_PER_POLL = 1000
EVENT_NAME = "ingero.causal_chain"
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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(state, EXPORTER)

    def new_chains(self) -> list[tuple[Any, ...]]:
        """Chains detected after the last ones pushed (by detected_at, then id)."""
        try:
            conn = open_readonly(self.db_path, check_same_thread=False)
        except IngeroError:
            return []
        try:
            t, cid = self._since
            return conn.execute(
                f"SELECT {_COLS} FROM causal_chains WHERE detected_at > ? OR (detected_at = ? AND id > ?) "
                "ORDER BY detected_at, id LIMIT ?",
                (t, t, cid, MAX_PER_POLL),
            ).fetchall()
        except sqlite3.Error:
            return []
        finally:
            conn.close()

    def push_once(self) -> int:
        """Push the chains found since the last call; how many were pushed (0 on failure, counted)."""
        rows = self.new_chains()
        if not rows:
            return 0
        self._since = (int(rows[-1][1]), str(rows[-1][0]))
        try:
            result = self.exporter.export(chain_records(rows, self.resource))
        except Exception:  # the exporter's own failure modes are many; each is one drop
            result = None
        if getattr(result, "name", "") == "SUCCESS":
            self.sent += 1
            return len(rows)
        self.dropped += 1
        return 0

    def start(self) -> None:
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
