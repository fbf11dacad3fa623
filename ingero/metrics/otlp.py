"""OTLP/HTTP (protobuf) push of the same metrics, built on the OpenTelemetry SDK's data model and its
official OTLP/HTTP exporter.

Two daemon threads, never the tracer's: a *ticker* copies a snapshot every ``interval_s`` into a
bounded queue, and a *sender* hands queued snapshots to ``OTLPMetricExporter`` (which encodes them
and retries with backoff within its timeout). When the collector is down or slow the sender blocks,
the queue fills and the ticker drops the oldest snapshot, counting it in
``ingero_export_dropped_total{exporter="otlp"}``; a failed export is counted there too. The
tracer's only cost is :meth:`MetricState.observe`, which is the same with or without a collector.

Counters are cumulative from the agent's start (``start_time_unix_nano``), so a dropped snapshot
loses resolution, never counts. Resource attributes follow the OpenTelemetry semantic conventions
(``service.name=ingero``, ``service.version``, ``host.name``, ``k8s.*`` from the downward-API
environment variables in :data:`K8S_ENV`, plus ``OTEL_RESOURCE_ATTRIBUTES``) and ingero's own
``ingero.node`` / ``ingero.rank``.

The serving engines' own series (:mod:`ingero.metrics.engine_series`) go under the same names as in
the Prometheus exposition, with the same attributes (``node`` among them): a counter is a monotonic
cumulative sum starting at the engine's ``_created`` (else the agent's start), a histogram keeps the
engine's bucket bounds, and a summary — which the SDK's data model lacks — is its ``_sum`` and
``_count`` as sums (its quantiles are not sent).
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any, Protocol

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from ingero import __version__
from ingero.errors import UsageError
from ingero.metrics import registry as r
from ingero.metrics.engine_series import EngineFamily
from ingero.metrics.state import MetricState

EXPORTER = "otlp"
METRICS_PATH = "/v1/metrics"
DEFAULT_INTERVAL_S = 10.0
DEFAULT_QUEUE = 8  # snapshots waiting for the sender; each is cumulative, so the newest is what matters
DEFAULT_TIMEOUT_S = 5.0
# Downward-API environment variables -> OpenTelemetry k8s resource attributes.
K8S_ENV = {
    "K8S_NODE_NAME": "k8s.node.name",
    "K8S_POD_NAME": "k8s.pod.name",
    "K8S_POD_UID": "k8s.pod.uid",
    "K8S_NAMESPACE": "k8s.namespace.name",
    "K8S_CONTAINER_NAME": "k8s.container.name",
    "K8S_CLUSTER_NAME": "k8s.cluster.name",
}
_SCOPE = InstrumentationScope("ingero", __version__)


class MetricExporter(Protocol):
    def export(self, metrics_data: MetricsData, timeout_millis: float = ..., **kwargs: Any) -> MetricExportResult: ...

    def shutdown(self, timeout_millis: float = ..., **kwargs: Any) -> None: ...


def metrics_url(text: str) -> str:
    """``http://collector:4318`` -> ``http://collector:4318/v1/metrics``; ``host:4318`` gets ``http://``."""
    t = text.strip()
    if "://" not in t:
        t = "http://" + t
    u = urllib.parse.urlsplit(t)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise UsageError(f"--otlp {text}: not an http(s) URL", hint="e.g. http://otel-collector:4318")
    path = u.path if u.path not in ("", "/") else METRICS_PATH
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path, u.query, ""))


def resource_for(state: MetricState, env: dict[str, str] | None = None) -> Resource:
    env = dict(os.environ) if env is None else env
    attrs: dict[str, str | int] = {
        "service.name": "ingero",
        "service.version": __version__,
        "host.name": socket.gethostname(),
        "ingero.node": state.identity.node,
    }
    if state.identity.rank is not None:
        attrs["ingero.rank"] = state.identity.rank
    for var, key in K8S_ENV.items():
        if env.get(var):
            attrs[key] = env[var]
    return Resource.create(attrs)  # also merges OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME


def metrics_data(snap: r.Snapshot, resource: Resource) -> MetricsData:
    """One snapshot in the SDK's data model (what the OTLP exporter encodes)."""
    points: dict[str, list[Any]] = {m.name: [] for m in r.METRICS}
    for s in snap.samples:
        attrs = dict(zip(s.metric.all_labels, s.labels, strict=True))
        points[s.metric.name].append(NumberDataPoint(attrs, snap.start_ns, snap.time_ns, s.value))
    for h in snap.histograms:
        attrs = dict(zip(h.metric.all_labels, h.labels, strict=True))
        points[h.metric.name].append(
            HistogramDataPoint(
                attrs,
                snap.start_ns,
                snap.time_ns,
                h.count,
                h.sum,
                list(h.counts),
                list(r.DURATION_BUCKETS_S),
                h.min,
                h.max,
            )
        )
    metrics: list[Metric] = []
    for m in r.METRICS:
        pts = points[m.name]
        if not pts:
            continue
        data: Sum | Gauge | Histogram
        if m.kind == "counter":
            data = Sum(pts, AggregationTemporality.CUMULATIVE, is_monotonic=True)
        elif m.kind == "gauge":
            data = Gauge(pts)
        else:
            data = Histogram(pts, AggregationTemporality.CUMULATIVE)
        metrics.append(Metric(m.name, m.help, m.unit, data))
    for fam in snap.engines:
        metrics += engine_metrics(fam, snap)
    scope = ScopeMetrics(_SCOPE, metrics, "")
    return MetricsData([ResourceMetrics(resource, [scope], "")])


def engine_metrics(fam: EngineFamily, snap: r.Snapshot) -> list[Metric]:
    """One serving engine's family in the SDK's data model (see the module doc)."""

    def start(created_s: float | None) -> int:
        return round(created_s * 1e9) if created_s else snap.start_ns

    def cumulative(name: str, values: list[tuple[dict[str, str], float, float | None]]) -> Metric:
        pts = [NumberDataPoint(lab, start(c), snap.time_ns, v) for lab, v, c in values]
        return Metric(name, fam.help, "", Sum(pts, AggregationTemporality.CUMULATIVE, is_monotonic=True))

    if fam.kind == "gauge":
        return [
            Metric(
                fam.name, fam.help, "", Gauge([NumberDataPoint(s.labels, 0, snap.time_ns, s.value) for s in fam.series])
            )
        ]
    if fam.kind == "counter":
        return [cumulative(fam.name, [(s.labels, s.value, s.created_s) for s in fam.series])]
    if fam.kind == "summary":
        return [
            cumulative(fam.name + "_sum", [(s.labels, s.sum, s.created_s) for s in fam.series]),
            cumulative(fam.name + "_count", [(s.labels, s.count, s.created_s) for s in fam.series]),
        ]
    pts: list[HistogramDataPoint] = []
    unknown: Any = None  # min and max: the engine does not publish them (the encoder leaves them unset)
    for s in fam.series:
        cum = [n for _, n in s.buckets]
        counts = [round(b - a) for a, b in zip([0.0, *cum[:-1]], cum, strict=True)]
        bounds = [le for le, _ in s.buckets[:-1]]  # the last is +Inf
        pts.append(
            HistogramDataPoint(
                s.labels, start(s.created_s), snap.time_ns, round(s.count), s.sum, counts, bounds, unknown, unknown
            )
        )
    return [Metric(fam.name, fam.help, "", Histogram(pts, AggregationTemporality.CUMULATIVE))]


class ExportCounts:
    """What an OTLP pusher has sent and dropped, exposed through ``state`` as
    ``ingero_export_sent_total`` / ``ingero_export_dropped_total`` with ``exporter=label``."""

    def __init__(self, state: MetricState, label: str) -> None:
        self.state = state
        self.sent = 0
        self.dropped = 0
        self._label = label
        state.add_provider(self._samples)

    def _samples(self) -> list[r.Sample]:
        base = self.state.base_labels()
        return [
            r.Sample(r.EXPORT_SENT, (*base, self._label), float(self.sent)),
            r.Sample(r.EXPORT_DROPPED, (*base, self._label), float(self.dropped)),
        ]


class OtlpPusher(ExportCounts):
    """Pushes snapshots of ``state`` every ``interval_s`` through a bounded queue (see module doc)."""

    def __init__(
        self,
        state: MetricState,
        exporter: MetricExporter,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        queue_max: int = DEFAULT_QUEUE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        before: Callable[[], None] | None = None,
        resource: Resource | None = None,
    ) -> None:
        self.exporter = exporter
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.resource = resource or resource_for(state)
        self._before = before
        self._queue: collections.deque[r.Snapshot] = collections.deque()
        self._queue_max = queue_max
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        super().__init__(state, EXPORTER)

    def start(self) -> None:
        for name, target in (("ingero-otlp-ticker", self._tick_loop), ("ingero-otlp-sender", self._send_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def enqueue(self) -> None:
        """Take a snapshot now and queue it (dropping the oldest when the queue is full)."""
        if self._before is not None:
            self._before()
        snap = self.state.snapshot()
        with self._cond:
            if len(self._queue) >= self._queue_max:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(snap)
            self._cond.notify()

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.enqueue()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait()
                if not self._queue:
                    return
                snap = self._queue.popleft()
            self._send(snap)

    def _send(self, snap: r.Snapshot) -> None:
        try:
            result = self.exporter.export(metrics_data(snap, self.resource), timeout_millis=self.timeout_s * 1000)
        except Exception:  # the exporter's own failure modes are many; each is one drop
            result = MetricExportResult.FAILURE
        if result == MetricExportResult.SUCCESS:
            self.sent += 1
        else:
            self.dropped += 1

    def close(self, *, flush: bool = True) -> None:
        """Stop; with ``flush``, queue one last snapshot and give the sender ``timeout_s`` to deliver."""
        if flush:
            self.enqueue()
        self._stop.set()
        with self._cond:
            if not flush:  # what is still queued is not sent: counted as dropped
                self.dropped += len(self._queue)
                self._queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 1)
        self.exporter.shutdown()


def otlp_exporter(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> MetricExporter:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=metrics_url(url), timeout=timeout_s)
