"""Metrics from a real recording (bcc uprobes on the CUDA-shaped fixture libraries): the same workload
traced twice, once plainly and once with ``/metrics`` scraped by a real Prometheus and an OTLP push to
a collector that never answers. Both recordings hold the same events; the metrics equal the
recording's exact aggregates; the export drops are counted."""

from __future__ import annotations

import shutil
import socket
import sqlite3
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from ingero.agent.trace.tracer import TraceReady
from ingero.identity import Identity
from ingero.metrics import registry as r
from ingero.metrics.otlp import OtlpPusher, otlp_exporter
from ingero.metrics.prometheus import serve_metrics
from ingero.metrics.state import MetricState, op_labels
from ingero.metrics.trace_hook import TraceMetrics
from ingero.store import catalog
from tests.bpf_support import Built, build, record, trace_options
from tests.prometheus_support import running_prometheus, wait_until

pytestmark = pytest.mark.bpf
GPU_SOURCES = (catalog.CUDA, catalog.DRIVER, catalog.NCCL)


def run_counts(built: Built) -> dict[str, int]:
    p = subprocess.run([str(built.workload), "counts", str(built.dir)], capture_output=True, text=True, check=True)
    calls = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if parts[0] != "comm":
            calls[parts[0]] = int(parts[1])
    return calls


def per_op(db: Path) -> dict[tuple[int, int], int]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT source, op, sum(count) FROM event_aggregates WHERE source IN (1, 4, 8) GROUP BY 1, 2"
        ).fetchall()
    finally:
        conn.close()
    return {(s, o): n for s, o, n in rows}


def test_metrics_of_a_recording_agent(tmp_path: Path) -> None:
    built = build(tmp_path / "build")
    identity = Identity("bpf-metrics", rank=3)
    plain = trace_options(
        tmp_path / "plain.db",
        identity,
        built.overrides(),
    )
    summary_plain, calls_plain = record(plain, lambda ready: run_counts(built))

    # A collector that accepts connections and never reads or answers.
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    state = MetricState(identity, "trace")
    observed = replace(plain, db_path=tmp_path / "observed.db", observer=TraceMetrics(state, tmp_path / "observed.db"))
    pusher = OtlpPusher(
        state, otlp_exporter(f"http://127.0.0.1:{hung.getsockname()[1]}", timeout_s=2), interval_s=0.02, queue_max=2
    )
    server = serve_metrics(state, "127.0.0.1", 0)
    prom_dir = tmp_path / "prom"
    have_prometheus = shutil.which("prometheus") is not None
    scraped: dict[str, float] = {}

    def action(ready: TraceReady) -> dict[str, int]:
        out = run_counts(built)
        wait_until("OTLP drops while the collector hangs", lambda: pusher.dropped > 0)
        if have_prometheus:
            with running_prometheus(prom_dir, {"bpf-metrics": f"127.0.0.1:{server.port}"}, rules=False) as prom:
                q = 'ingero_events_total{op="ncclAllReduce",node="bpf-metrics"}'
                (s,) = wait_until("a scrape with the workload's calls", lambda: prom.query(f"{q} > 0"))
                scraped["ncclAllReduce"] = float(s["value"][1])
                (c,) = prom.query('ingero_collectives_total{comm_rank="3",comm_size="8",rank="3"}')
                scraped["comm"] = float(c["value"][1])
        return out

    pusher.start()
    try:
        summary_observed, calls_observed = record(observed, action)
    finally:
        pusher.close(flush=False)
        server.close()
        hung.close()

    # The same events recorded with and without the exporters (and none lost by the kernel).
    assert calls_observed == calls_plain
    assert per_op(observed.db_path) == per_op(plain.db_path)
    for s in (summary_plain, summary_observed):
        assert s.stats.get("events_dropped_ring", 0) == 0
    # Metrics = the recording's exact aggregates, op by op.
    snap = state.snapshot()
    events = {(smp.labels[2], smp.labels[3]): smp.value for smp in snap.samples if smp.metric is r.EVENTS}
    for (source, op), n in per_op(observed.db_path).items():
        assert events[op_labels(source << 8 | op)] == n
    assert events[("NCCL", "ncclAllReduce")] == calls_plain["ncclAllReduce"] == 19
    hist = {h.labels[3]: h for h in snap.histograms}
    sync = hist["cudaStreamSync"]  # 50 calls sleeping 2 ms each
    assert sync.count == calls_plain["cudaStreamSync"] == 50
    assert sync.sum >= 0.1 and sync.min >= 0.002
    assert sum(sync.counts[: r.DURATION_BUCKETS_S.index(0.001) + 1]) == 0
    # Collectives per communicator and rank: ncclCommInitRank(8 ranks, rank 3) is named by its
    # cluster-wide id (16 hex digits); ncclCommInitAll's two (no shared id) by creation order.
    coll = {smp.labels[2:]: smp.value for smp in snap.samples if smp.metric is r.COLLECTIVES}
    on_first = sum(calls_plain[op] for op in calls_plain if op.startswith("nccl") and "Init" not in op) - 5
    ((first, value),) = [(label, v) for (label, rank, size), v in coll.items() if (rank, size) == ("3", "8")]
    assert value == on_first and len(first) == 16 and int(first, 16) != 0
    assert [v for (label, rank, size), v in coll.items() if size == "2" and rank == "1"] == [5]  # ncclReduce
    # The hung collector cost drops, counted.
    dropped = [smp.value for smp in snap.samples if smp.metric is r.EXPORT_DROPPED]
    assert dropped and dropped[0] > 0 and pusher.sent == 0
    if have_prometheus:
        assert scraped == {"ncclAllReduce": 19, "comm": on_first}
