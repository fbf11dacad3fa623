"""Prometheus exposition: one collector that turns a :class:`~ingero.metrics.state.MetricState` snapshot
into metric families at scrape time, and the plain-HTTP ``/metrics`` listener behind ``--prometheus``.

The listener is prometheus-client's own threaded HTTP server (``start_http_server``) on a private
registry: a scrape runs in its thread and takes the state's lock only to copy a few small arrays,
so it never waits on, or holds up, the tracer's trio loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ingero.errors import UsageError
from ingero.metrics import registry as r
from ingero.metrics.engine_series import EngineFamily
from ingero.metrics.state import MetricState

_LE = [*(repr(float(b)) for b in r.DURATION_BUCKETS_S), "+Inf"]


def families(snap: r.Snapshot) -> list[Metric]:
    """The Prometheus families of one snapshot, in :data:`registry.METRICS` order."""
    out: dict[str, Metric] = {}
    for m in r.METRICS:
        if m.kind == "counter":
            out[m.name] = CounterMetricFamily(m.name, m.help, labels=m.all_labels)
        elif m.kind == "gauge":
            out[m.name] = GaugeMetricFamily(m.name, m.help, labels=m.all_labels)
        else:
            out[m.name] = HistogramMetricFamily(m.name, m.help, labels=m.all_labels)
    for s in snap.samples:
        fam = out[s.metric.name]
        assert isinstance(fam, CounterMetricFamily | GaugeMetricFamily)
        fam.add_metric(list(s.labels), s.value)
    for h in snap.histograms:
        hist = out[h.metric.name]
        assert isinstance(hist, HistogramMetricFamily)
        cum, buckets = 0, []
        for le, n in zip(_LE, h.counts, strict=True):
            cum += n
            buckets.append((le, float(cum)))
        hist.add_metric(list(h.labels), buckets, h.sum)
    return [f for f in out.values() if f.samples] + [engine_family(f) for f in snap.engines]


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def engine_family(fam: EngineFamily) -> Metric:
    """One serving engine's family as published, under its exported name (see :mod:`ingero.metrics.engine_series`)."""
    m = Metric(fam.name, fam.help, fam.kind)
    for s in fam.series:
        if fam.kind == "histogram":
            for le, n in s.buckets:
                m.add_sample(fam.name + "_bucket", {**s.labels, "le": _le(le)}, n)
            m.add_sample(fam.name + "_count", s.labels, s.count)
            m.add_sample(fam.name + "_sum", s.labels, s.sum)
        elif fam.kind == "summary":
            for q, v in s.quantiles:
                m.add_sample(fam.name, {**s.labels, "quantile": repr(q)}, v)
            m.add_sample(fam.name + "_count", s.labels, s.count)
            m.add_sample(fam.name + "_sum", s.labels, s.sum)
        else:
            m.add_sample(fam.name + ("_total" if fam.kind == "counter" else ""), s.labels, s.value)
        if s.created_s is not None and fam.kind != "gauge":
            m.add_sample(fam.name + "_created", s.labels, s.created_s)
    return m


class IngeroCollector(Collector):
    def __init__(self, snapshot: Callable[[], r.Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from families(self._snapshot())


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def parse_prometheus_addr(text: str) -> tuple[str, int]:
    """``9464``, ``:9464`` (every interface), ``127.0.0.1:9464``, ``[::1]:9464``; port 0 = any free port."""
    t = text.strip()
    host, sep, port_s = t.rpartition(":")
    if not sep:
        host, port_s = "", t
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_s)
    except ValueError:
        raise UsageError(
            f"--prometheus {text}: not a port", hint="use [ADDR:]PORT, e.g. :9464 or 127.0.0.1:9464"
        ) from None
    if not 0 <= port <= 65535:
        raise UsageError(f"--prometheus {text}: port out of range")
    return host, port


def serve_metrics(
    state: MetricState, host: str, port: int, *, before: Callable[[], None] | None = None
) -> MetricsServer:
    """Start ``/metrics`` on ``host:port`` in a thread. ``before`` runs at the start of every scrape."""

    def snapshot() -> r.Snapshot:
        if before is not None:
            before()
        return state.snapshot()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(IngeroCollector(snapshot))
    try:
        server, thread = start_http_server(port, host, registry=registry)
    except OSError as e:
        raise UsageError(f"--prometheus {host}:{port}: {e.strerror or e}", hint="pick another port") from None
    return MetricsServer(host, int(server.server_address[1]), server, thread)
