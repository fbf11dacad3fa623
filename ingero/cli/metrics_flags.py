"""``--prometheus`` / ``--otlp`` for ``ingero trace`` and ``ingero serve``: the flags and their start-up.

``trace`` feeds the metrics from the recorder (every drained batch); ``serve``, which has no recorder,
from its database (:class:`ingero.metrics.dbfeed.DatabaseFeed`, re-read at most every 10 s).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ingero.identity import Identity
    from ingero.metrics.otlp import OtlpPusher
    from ingero.metrics.otlp_events import ChainLogPusher
    from ingero.metrics.prometheus import MetricsServer
    from ingero.metrics.state import MetricState
    from ingero.metrics.trace_hook import TraceMetrics


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("metrics export (Prometheus / OpenTelemetry)")
    g.add_argument(
        "--prometheus",
        metavar="[ADDR:]PORT",
        help="serve Prometheus metrics at http://ADDR:PORT/metrics (e.g. :9464, 127.0.0.1:9464)",
    )
    g.add_argument(
        "--otlp", metavar="URL", help="push metrics as OTLP/HTTP protobuf to this collector (e.g. http://otelcol:4318)"
    )
    g.add_argument("--otlp-interval", metavar="DUR", default="10s", help="OTLP push interval (default 10s)")
    g.add_argument(
        "--otlp-events",
        action="store_true",
        help="with --otlp, also push the causal chains the database gains, and (trace) GPU calls >= 10x their "
        "op's median, as OTLP log records (/v1/logs)",
    )


@dataclass
class Exporters:
    state: MetricState
    server: MetricsServer | None = None
    pusher: OtlpPusher | None = None
    events: ChainLogPusher | None = None
    observer: TraceMetrics | None = None
    lines: list[str] = field(default_factory=list)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.pusher is not None:
            self.pusher.close()
        if self.server is not None:
            self.server.close()


def wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "prometheus", None) or getattr(args, "otlp", None) or getattr(args, "otlp_events", False))


def start(args: argparse.Namespace, identity: Identity, db_path: Path, mode: str) -> Exporters | None:
    """Start what the flags ask for (None when neither is given). ``mode`` is trace or serve."""
    if not wanted(args):
        return None
    from ingero.errors import UsageError
    from ingero.metrics.dbfeed import DatabaseFeed, attach_database
    from ingero.metrics.state import MetricState
    from ingero.timeutil import parse_duration

    interval_s = parse_duration(args.otlp_interval) / 1e9
    if interval_s <= 0:
        raise UsageError("--otlp-interval must be positive")
    if args.otlp_events and not args.otlp:
        raise UsageError("--otlp-events needs --otlp", hint="add --otlp http://collector:4318")
    state = MetricState(identity, mode)
    out = Exporters(state)
    before = None
    if mode == "trace":
        from ingero.metrics.trace_hook import TraceMetrics

        out.observer = TraceMetrics(state, db_path)
    else:
        feed = DatabaseFeed(state, db_path)
        feed.refresh(force=True)
        attach_database(state, db_path)
        before = feed.refresh
    try:
        if args.otlp:
            from ingero.metrics.otlp import OtlpPusher, metrics_url, otlp_exporter

            if not getattr(args, "debug", False):  # failures are counted in ingero_export_dropped_total
                logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
            out.pusher = OtlpPusher(state, otlp_exporter(args.otlp), interval_s=interval_s, before=before)
            out.pusher.start()
            out.lines.append(f"pushing OTLP metrics to {metrics_url(args.otlp)} every {args.otlp_interval}")
            if args.otlp_events:
                from ingero.metrics.otlp_events import ChainLogPusher, logs_url, otlp_log_exporter

                out.events = ChainLogPusher(state, db_path, otlp_log_exporter(args.otlp), interval_s=interval_s)
                out.events.start()
                out.lines.append(f"pushing causal chains and slow GPU calls as OTLP logs to {logs_url(args.otlp)}")
        if args.prometheus:
            from ingero.metrics.prometheus import parse_prometheus_addr, serve_metrics

            host, port = parse_prometheus_addr(args.prometheus)
            out.server = serve_metrics(state, host, port, before=before)
            out.lines.append(f"Prometheus metrics on {out.server.url}")
    except BaseException:
        out.close()
        raise
    return out
