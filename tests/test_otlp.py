"""OTLP/HTTP push through the OpenTelemetry exporter to a real receiver on loopback that decodes the
protobuf with ``opentelemetry-proto``; a collector that hangs or is down; the drop counter."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.errors import UsageError
from ingero.identity import Identity
from ingero.metrics import registry as r
from ingero.metrics.otlp import OtlpPusher, metrics_url, otlp_exporter, resource_for
from ingero.metrics.state import MetricState
from ingero.store import catalog


@dataclass
class Receiver:
    url: str
    requests: list[Any] = field(default_factory=list)  # the decoded Export*ServiceRequest messages
    arrived: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    release: threading.Event = field(default_factory=threading.Event)  # a hung collector until set
    paths: list[str] = field(default_factory=list)


@contextlib.contextmanager
def otlp_receiver(request_cls: Any, response_cls: Any) -> Iterator[Receiver]:
    """An OTLP/HTTP endpoint on loopback decoding with opentelemetry-proto's ``request_cls``."""
    rec = Receiver("")
    rec.release.set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            req = request_cls()
            req.ParseFromString(body)
            rec.paths.append(self.path)
            rec.requests.append(req)
            rec.arrived.release()
            rec.release.wait(30)
            out = response_cls().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    rec.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield rec
    finally:
        rec.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with otlp_receiver(ExportMetricsServiceRequest, ExportMetricsServiceResponse) as rec:
        yield rec


@pytest.fixture
def logs_receiver() -> Iterator[Receiver]:
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
        ExportLogsServiceRequest,
        ExportLogsServiceResponse,
    )

    with otlp_receiver(ExportLogsServiceRequest, ExportLogsServiceResponse) as rec:
        yield rec


def fed_state() -> MetricState:
    st = MetricState(Identity("gpu-node-05", rank=4), "trace")
    ev = np.zeros(300, dtype=EVENT_DTYPE)
    ev["source"], ev["op"], ev["pid"] = catalog.CUDA, 5, 77
    ev["duration"] = np.arange(300) * 1000 + 500  # 0.5 µs ... 299.5 µs
    ev["ts"] = np.arange(300) * 1_000_000
    st.observe(ev)
    return st


def attrs(kvs: Any) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def test_metrics_arrive_with_resource_attributes(receiver: Receiver) -> None:
    st = fed_state()
    env = {"K8S_POD_NAME": "trainer-0", "K8S_NAMESPACE": "ml", "K8S_NODE_NAME": "worker-7"}
    pusher = OtlpPusher(st, otlp_exporter(receiver.url), interval_s=3600, resource=resource_for(st, env))
    pusher.start()
    pusher.enqueue()
    assert receiver.arrived.acquire(timeout=30)
    pusher.close(flush=False)
    assert receiver.paths == ["/v1/metrics"]
    (rm,) = receiver.requests[0].resource_metrics
    res = attrs(rm.resource.attributes)
    assert res["service.name"] == "ingero"
    assert res["host.name"] == socket.gethostname()
    assert res["ingero.node"] == "gpu-node-05" and res["ingero.rank"] == 4
    assert res["k8s.pod.name"] == "trainer-0" and res["k8s.namespace.name"] == "ml"
    assert res["k8s.node.name"] == "worker-7"
    (sm,) = rm.scope_metrics
    assert sm.scope.name == "ingero"
    metrics = {m.name: m for m in sm.metrics}
    ev = metrics["ingero_events"]
    assert ev.sum.is_monotonic and ev.sum.aggregation_temporality == 2  # cumulative
    (dp,) = ev.sum.data_points
    assert attrs(dp.attributes) == {"node": "gpu-node-05", "rank": "4", "source": "CUDA", "op": "cudaStreamSync"}
    assert dp.as_double == 300
    assert dp.start_time_unix_nano == st.start_ns < dp.time_unix_nano
    hist = metrics["ingero_call_duration_seconds"]
    assert hist.unit == "s"
    (hp,) = hist.histogram.data_points
    assert list(hp.explicit_bounds) == list(r.DURATION_BUCKETS_S)
    assert hp.count == 300 == sum(hp.bucket_counts)
    durations = np.arange(300) * 1000 + 500
    bounds = np.array(r.DURATION_BUCKETS_S) * 1e9
    assert list(hp.bucket_counts) == np.bincount(np.searchsorted(bounds, durations), minlength=len(bounds) + 1).tolist()
    assert hp.sum == pytest.approx(durations.sum() / 1e9)
    assert hp.min == pytest.approx(0.5e-6) and hp.max == pytest.approx(299.5e-6)
    assert {m.name for m in sm.metrics} >= {"ingero_agent_info", "ingero_gpu_idle_seconds", "ingero_offcpu_seconds"}


def test_a_hung_collector_never_blocks_and_drops_are_counted(receiver: Receiver) -> None:
    st = fed_state()
    receiver.release.clear()  # the collector accepts requests and never answers (until released)
    pusher = OtlpPusher(st, otlp_exporter(receiver.url, timeout_s=30), interval_s=3600, queue_max=2)
    pusher.start()
    pusher.enqueue()
    assert receiver.arrived.acquire(timeout=30)  # the sender is now stuck inside the exporter
    for _ in range(10):
        pusher.enqueue()  # returns at once: the queue keeps the newest two
    assert pusher.dropped == 8
    dropped = [s for s in st.snapshot().samples if s.metric is r.EXPORT_DROPPED]
    assert [(s.labels[-1], s.value) for s in dropped] == [("otlp", 8.0)]
    # Recording goes on meanwhile: the state takes batches while the exporter hangs.
    st.observe(np.zeros(5, dtype=EVENT_DTYPE))
    receiver.release.set()
    assert receiver.arrived.acquire(timeout=30) and receiver.arrived.acquire(timeout=30)  # the two queued
    pusher.close(flush=False)
    assert pusher.sent == 3 and pusher.dropped == 8  # the stuck one, then the two queued


def test_a_dead_collector_counts_failures(receiver: Receiver) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    st = fed_state()
    pusher = OtlpPusher(st, otlp_exporter(f"http://127.0.0.1:{port}", timeout_s=0.5), interval_s=3600, queue_max=4)
    pusher.start()
    pusher.enqueue()
    pusher.close(flush=False)  # waits for the sender to give up on the one it holds
    assert pusher.sent == 0 and pusher.dropped >= 1
    assert not receiver.requests


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("http://otelcol:4318", "http://otelcol:4318/v1/metrics"),
        ("otelcol:4318", "http://otelcol:4318/v1/metrics"),
        ("https://c.example/custom/path", "https://c.example/custom/path"),
    ],
)
def test_metrics_url(text: str, want: str) -> None:
    assert metrics_url(text) == want


def test_metrics_url_rejects_other_schemes() -> None:
    with pytest.raises(UsageError):
        metrics_url("grpc://otelcol:4317")


def test_causal_chains_are_pushed_once_as_log_records(logs_receiver: Receiver) -> None:
    import sqlite3

    from ingero.metrics.otlp_events import ChainLogPusher, logs_url, otlp_log_exporter
    from tests.conftest import INVESTIGATIONS

    url = logs_receiver.url
    db = INVESTIGATIONS / "sample-gpu-node-01.db"
    st = MetricState(Identity("gpu-node-01", rank=0), "serve")
    assert logs_url(url) == url + "/v1/logs"
    pusher = ChainLogPusher(st, db, otlp_log_exporter(url))
    n = pusher.push_once()
    assert pusher.push_once() == 0  # nothing new: nothing sent twice
    conn = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    want = conn.execute("SELECT id, upper(severity), summary FROM causal_chains ORDER BY detected_at, id").fetchall()
    conn.close()
    assert want and n == len(want) and pusher.sent == 1 and pusher.dropped == 0
    assert logs_receiver.paths == ["/v1/logs"]
    (req,) = logs_receiver.requests
    (rl,) = req.resource_logs
    assert attrs(rl.resource.attributes)["service.name"] == "ingero"
    (sl,) = rl.scope_logs
    recs = [(attrs(x.attributes)["ingero.chain.id"], x.severity_text, x.body.string_value) for x in sl.log_records]
    sev = {"HIGH": "ERROR", "MEDIUM": "WARN", "LOW": "INFO"}
    assert recs == [(cid, sev[s], summary) for cid, s, summary in want]
    assert all(x.event_name == "ingero.causal_chain" for x in sl.log_records)


def test_slow_gpu_calls_are_pushed_once_as_log_records(tmp_path: Path, logs_receiver: Receiver) -> None:
    from ingero.metrics.otlp_events import ChainLogPusher, otlp_log_exporter
    from ingero.store.writer import StoreWriter

    url = logs_receiver.url
    sync, launch = catalog.op_id("cudaStreamSync"), catalog.op_id("cuLaunchKernel")
    st = MetricState(Identity("gpu-node-09", rank=0), "trace")
    ev = np.zeros(2000, dtype=EVENT_DTYPE)  # what the recorder saw: medians 1 ms and ≤ 10 µs
    ev["source"][:1000], ev["op"][:1000], ev["duration"][:1000] = *sync, 1_000_000
    ev["source"][1000:], ev["op"][1000:], ev["duration"][1000:] = *launch, 8_000
    ev["pid"], ev["ts"] = 4242, 1
    st.observe(ev)
    assert st.op_medians_ns(catalog.GPU_API_SOURCES) == {
        sync[0] << 8 | sync[1]: 1_000_000,
        launch[0] << 8 | launch[1]: 10_000,
    }

    def row(t: int, src_op: tuple[int, int], dur: int, pid: int = 4242) -> tuple[int, ...]:
        return (10**18 + t, pid, pid + 1, *src_op, dur, 0, 0, 0, 0, 0x1234, 0)

    db = tmp_path / "slow.db"
    with StoreWriter(db, Identity("gpu-node-09")) as w:
        w.write_batch([row(1, sync, 90_000_000)])  # history: stored before the pusher started, never pushed
        pusher = ChainLogPusher(st, db, otlp_log_exporter(url))
        pusher.poll()  # what start() does first: the rows stored so far are history
        w.write_batch(
            [
                row(2, sync, 5_000_000),  # 5x its median: not slow
                row(3, sync, 25_000_000),  # slow
                row(4, launch, 500_000),  # 50x its median but under the 1 ms floor
                row(5, launch, 2_000_000),  # slow
                row(6, catalog.op_id("cudaMemcpy"), 100_000_000),  # no median yet: not judged
                row(7, catalog.op_id("sched_switch"), 50_000_000),  # not a GPU call
            ]
        )
        assert pusher.push_once() == 2
        assert pusher.push_once() == 0  # nothing new: nothing sent twice
    assert logs_receiver.paths == ["/v1/logs"]
    (req,) = logs_receiver.requests
    (rl,) = req.resource_logs
    (sl,) = rl.scope_logs
    recs = [attrs(x.attributes) for x in sl.log_records]
    assert [(a["ingero.op"], a["ingero.duration_us"], a["ingero.median_us"]) for a in recs] == [
        ("cudaStreamSync", 25_000, 1_000),
        ("cuLaunchKernel", 2_000, 10),
    ]
    assert all(a["ingero.node"] == "gpu-node-09" and a["ingero.pid"] == 4242 and a["ingero.tid"] == 4243 for a in recs)
    assert recs[0]["ingero.stack_hash"] == "0000000000001234"
    first = sl.log_records[0]
    assert first.event_name == "ingero.slow_call" and first.severity_text == "WARN"
    assert first.body.string_value.startswith("cudaStreamSync took 25ms") and "pid 4242" in first.body.string_value
    assert first.time_unix_nano == 10**18 + 3


def test_engine_series_arrive_typed_with_the_node(tmp_path: Path, receiver: Receiver) -> None:
    """A recording of a stand-in vLLM (trace --inference): its gauges, counters and histograms are pushed
    under ingero_engine_* with the node, the engine and its own labels, and the values the recording
    holds last; other families of the page (process_*) never were recorded."""
    from ingero.metrics.dbfeed import attach_database
    from ingero.store.db import open_readonly
    from ingero.store.engine_metrics import load_rows
    from tests.engine_standin import TTFT_BUCKETS, recording

    db = recording(tmp_path / "serve.db", "serve-node-07", [(4242, "vllm", "kv_pressure")], 12)
    st = MetricState(Identity("serve-node-07"), "serve")
    attach_database(st, db)
    pusher = OtlpPusher(st, otlp_exporter(receiver.url), interval_s=3600)
    pusher.start()
    pusher.enqueue()
    assert receiver.arrived.acquire(timeout=30)
    pusher.close(flush=False)
    (scope,) = receiver.requests[0].resource_metrics[0].scope_metrics
    got = {m.name: m for m in scope.metrics if m.name.startswith("ingero_engine_")}
    conn = open_readonly(db)
    try:
        last = {(m, lb): v for _, _, _, _, m, lb, v in load_rows(conn)}  # oldest first: the last value wins
    finally:
        conn.close()
    model = '{"model_name":"llama-3-8b"}'

    (kv,) = got["ingero_engine_vllm_kv_cache_usage_perc"].gauge.data_points
    a = attrs(kv.attributes)
    assert a == {
        "node": "serve-node-07",
        "rank": "",
        "engine": "vllm",
        "engine_pid": "4242",
        "model_name": "llama-3-8b",
    }
    assert kv.as_double == last[("vllm:kv_cache_usage_perc", model)] == 0.985

    pre = got["ingero_engine_vllm_num_preemptions"].sum
    assert pre.is_monotonic and pre.aggregation_temporality == 2  # cumulative
    assert pre.data_points[0].as_double == last[("vllm:num_preemptions_total", model)] > 0
    created = last[("vllm:num_preemptions_created", model)]
    assert pre.data_points[0].start_time_unix_nano == round(created * 1e9)  # the engine's own start

    (h,) = got["ingero_engine_vllm_time_to_first_token_seconds"].histogram.data_points
    assert list(h.explicit_bounds) == list(TTFT_BUCKETS)
    assert sum(h.bucket_counts) == h.count == last[("vllm:time_to_first_token_seconds_count", model)]
    assert h.sum == pytest.approx(last[("vllm:time_to_first_token_seconds_sum", model)])
    assert not any("process_" in n or n.endswith("_created") for n in got)
