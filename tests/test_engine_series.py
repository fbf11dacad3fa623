"""The serving engines' series as the exporters see them (:mod:`ingero.metrics.engine_series`): the
latest value of each series, kinds from the samples' shapes, valid names, labels that never clash."""

from __future__ import annotations

from pathlib import Path

from ingero.identity import Identity
from ingero.metrics.engine_series import HOLD_NS, exported_name, families, latest
from ingero.store.db import open_readonly
from ingero.store.engine_metrics import EngineMetricRow
from ingero.store.writer import StoreWriter

S = 1_000_000_000
T = 1_790_000_000 * S


def write(path: Path, rows: list[EngineMetricRow]) -> list[tuple[str, int, str, str, dict[str, str], float]]:
    with StoreWriter(path, Identity("serve-node-03")) as w:
        w.write_batch(engine_metrics=rows)
    conn = open_readonly(path)
    try:
        return latest(conn)
    finally:
        conn.close()


def test_latest_values_carry_forward_and_an_exited_engine_drops_out(tmp_path: Path) -> None:
    m = '{"model_name":"m"}'
    rows: list[EngineMetricRow] = [
        (T, 1, "vllm", "vllm:num_requests_waiting", m, 3.0),
        (T + 5 * S, 1, "vllm", "vllm:num_requests_waiting", m, 7.0),  # changed: the newer row wins
        (T, 1, "vllm", "vllm:kv_cache_usage_perc", m, 0.5),  # unchanged since: carried forward
        (T - HOLD_NS - S, 2, "vllm", "vllm:num_requests_waiting", m, 9.0),  # an engine gone for over a minute
        (T + 10 * S, 1, "vllm", "vllm:num_requests_running", m, 32.0),
    ]
    got = {(pid, metric): v for _, pid, _, metric, _, v in write(tmp_path / "a.db", rows)}
    assert got == {
        (1, "vllm:num_requests_waiting"): 7.0,
        (1, "vllm:kv_cache_usage_perc"): 0.5,
        (1, "vllm:num_requests_running"): 32.0,
    }


def test_kinds_names_and_labels() -> None:
    lab = {"model": "r", "node": "from-the-engine"}
    rows = [
        ("", 5, "triton", "nv_inference_request_success", lab, 12.0),  # a counter without _total
        ("", 5, "triton", "nv_inference_pending_request_count", lab, 2.0),  # a gauge named _count
        ("", 5, "sglang", "sglang:x_bucket", {"le": "0.1"}, 1.0),
        ("", 5, "sglang", "sglang:x_bucket", {"le": "+Inf"}, 3.0),
        ("", 5, "sglang", "sglang:x_sum", {}, 0.4),
        ("", 5, "sglang", "sglang:x_count", {}, 3.0),
        ("", 5, "sglang", "sglang:x_created", {}, 1.7e9),
        ("", 5, "sglang", "sglang:only_sum_sum", {}, 1.0),  # a histogram with no buckets recorded
        ("", 5, "tgi", "tgi_queue_size", {}, 4.0),
        ("", 5, "tgi", "tgi:queue_size", {}, 5.0),  # sanitises like tgi_queue_size: the first one kept
    ]
    fams = {f.name: f for f in families(rows, "serve-node-03", "2")}
    c = fams["ingero_engine_nv_inference_request_success"]
    assert c.kind == "counter" and c.series[0].value == 12.0
    assert c.series[0].labels == {
        "node": "serve-node-03",
        "rank": "2",
        "engine": "triton",
        "engine_pid": "5",
        "model": "r",
        "exported_node": "from-the-engine",
    }
    assert fams["ingero_engine_nv_inference_pending_request_count"].kind == "gauge"
    h = fams["ingero_engine_sglang_x"]
    assert h.kind == "histogram" and h.published == "sglang:x"
    (s,) = h.series
    assert s.buckets == [(0.1, 1.0), (float("inf"), 3.0)] and (s.sum, s.count, s.created_s) == (0.4, 3.0, 1.7e9)
    assert fams["ingero_engine_sglang_only_sum_sum"].kind == "gauge"  # alone: its own name, a gauge
    assert [f.series[0].value for f in fams.values() if f.name == "ingero_engine_tgi_queue_size"] == [4.0]
    assert all(":" not in n for n in fams)
    assert exported_name("vllm:e2e-latency.s") == "ingero_engine_vllm_e2e_latency_s"


def test_a_summary_and_a_histogram_render_as_valid_exposition() -> None:
    """TGI's Rust exporter publishes some latencies as summaries (quantile labels): rendered as a summary,
    parsed back by prometheus_client's own parser with every sample intact."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ingero.metrics.prometheus import engine_family

    rows = [
        ("n", 9, "tgi", "tgi_request_duration", {"quantile": "0.5"}, 0.2),
        ("n", 9, "tgi", "tgi_request_duration", {"quantile": "0.99"}, 1.5),
        ("n", 9, "tgi", "tgi_request_duration_sum", {}, 40.0),
        ("n", 9, "tgi", "tgi_request_duration_count", {}, 100.0),
        ("n", 9, "tgi", "tgi_request_count", {}, 100.0),
    ]
    fams = families(rows, "n", "")

    class Fixed:
        def collect(self) -> list[object]:
            return [engine_family(f) for f in fams]

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Fixed())  # type: ignore[arg-type]
    parsed = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    summ = parsed["ingero_engine_tgi_request_duration"]
    assert summ.type == "summary"
    got = {(s.name, s.labels.get("quantile")): s.value for s in summ.samples}
    assert got == {
        ("ingero_engine_tgi_request_duration", "0.5"): 0.2,
        ("ingero_engine_tgi_request_duration", "0.99"): 1.5,
        ("ingero_engine_tgi_request_duration_sum", None): 40.0,
        ("ingero_engine_tgi_request_duration_count", None): 100.0,
    }
    assert parsed["ingero_engine_tgi_request_count"].type == "counter"  # a TGI counter: no _total published


def test_rank_labels_agree_with_the_event_totals_in_prometheus_and_otlp(tmp_path: Path) -> None:
    """A merged recording (three nodes' event totals) with engines on two of its nodes, served by one of
    them with rank 1: every node's engine series carry the rank its event totals carry — the agent's on its
    own node, empty on the others (the recording does not say their rank) — in the Prometheus text and in
    the OTLP data points alike."""
    import shutil
    import sqlite3

    from ingero.metrics.dbfeed import DatabaseFeed, attach_database
    from ingero.metrics.otlp import metrics_data, resource_for
    from ingero.metrics.state import MetricState
    from tests.test_metrics_dbfeed import CLUSTER
    from tests.test_metrics_state import series

    db = tmp_path / "cluster.db"
    shutil.copy(CLUSTER, db)
    conn = sqlite3.connect(db)
    with conn:
        for k, node in enumerate(("gpu-node-01", "gpu-node-02")):
            conn.execute(
                "INSERT INTO engine_metrics (ts, node, pid, engine, metric, labels, value) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (T, node, 100 + k, "vllm", "vllm:num_requests_waiting", '{"model_name":"m"}', 3.0 + k),
            )
    conn.close()
    st = MetricState(Identity("gpu-node-02", rank=1), "serve")
    DatabaseFeed(st, db).refresh(force=True)
    attach_database(st, db)

    events: dict[str, set[str]] = {}
    engines: dict[str, set[str]] = {}
    for (name, labels), _ in series(st).items():
        d = dict(labels)
        if name == "ingero_events_total":
            events.setdefault(d["node"], set()).add(d["rank"])
        elif name.startswith("ingero_engine_"):
            engines.setdefault(d["node"], set()).add(d["rank"])
    assert events == {"gpu-node-01": {""}, "gpu-node-02": {"1"}, "gpu-node-03": {""}}
    assert engines == {"gpu-node-01": {""}, "gpu-node-02": {"1"}}

    otlp: dict[str, set[str]] = {}
    (rm,) = metrics_data(st.snapshot(), resource_for(st)).resource_metrics
    for m in rm.scope_metrics[0].metrics:
        if m.name in ("ingero_events", "ingero_engine_vllm_num_requests_waiting"):
            for dp in m.data.data_points:
                a = dict(dp.attributes or {})
                otlp.setdefault(f"{m.name}@{a['node']}", set()).add(str(a["rank"]))
    assert otlp == {
        **{f"ingero_events@{n}": r for n, r in events.items()},
        **{f"ingero_engine_vllm_num_requests_waiting@{n}": r for n, r in engines.items()},
    }
