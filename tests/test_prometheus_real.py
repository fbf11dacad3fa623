"""A real Prometheus scraping three ``ingero serve --prometheus`` agents that serve the generated
cluster (investigations/, written by the demo scenarios); the shipped rules checked and unit-tested
with promtool; every Grafana panel query run on that Prometheus."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.metrics import registry as r
from tests.conftest import INVESTIGATIONS
from tests.prometheus_support import (
    DASHBOARD,
    RULE_TESTS,
    RULES,
    needs_prometheus,
    running_prometheus,
    wait_until,
)

pytestmark = needs_prometheus
NODES = ("gpu-node-01", "gpu-node-02", "gpu-node-03")
_URL = re.compile(r"Prometheus metrics on http://([^/]+)/metrics")


def start_agent(db: Path, node: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """``ingero serve`` with ``--prometheus 127.0.0.1:0``; (process, the metrics host:port it reports)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ingero",
            "serve",
            "--db",
            str(db),
            "--node",
            node,
            "--listen",
            "127.0.0.1:0",
            "--no-tls",
            "--prometheus",
            "127.0.0.1:0",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        m = _URL.search(line)
        if m:
            return proc, m.group(1)
    proc.wait()
    raise AssertionError(f"agent {node} did not start: {''.join(seen)}")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def agents() -> Iterator[dict[str, str]]:
    procs: list[subprocess.Popen[str]] = []
    addrs: dict[str, str] = {}
    try:
        for i, node in enumerate(NODES, 1):
            proc, addr = start_agent(INVESTIGATIONS / f"sample-gpu-node-0{i}.db", node)
            procs.append(proc)
            addrs[node] = addr
        yield addrs
    finally:
        for p in procs:
            stop(p)


def sql(node: str, query: str) -> list[tuple[object, ...]]:
    db = INVESTIGATIONS / f"sample-gpu-node-0{NODES.index(node) + 1}.db"
    conn = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    try:
        return conn.execute(query).fetchall()
    finally:
        conn.close()


def test_promtool_checks_the_shipped_rules_and_configs() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
    for config in ("prometheus.yml", "federate.yml"):
        out = subprocess.run(
            ["promtool", "check", "config", str(RULES.parent / config)], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_rule_tests_fire_the_straggler_alert(tmp_path: Path) -> None:
    out = subprocess.run(["promtool", "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # The same tests with no straggler (gpu-node-03 waits as long as its peers) must fail: the alert
    # the tests expect at 15m no longer fires.
    text = RULE_TESTS.read_text().replace("values: '0+0.6x30'", "values: '0+18x30'")
    assert text != RULE_TESTS.read_text()
    (tmp_path / RULES.name).write_text(RULES.read_text())
    (tmp_path / RULE_TESTS.name).write_text(text)
    out = subprocess.run(["promtool", "test", "rules", str(tmp_path / RULE_TESTS.name)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "IngeroRankStraggler" in out.stdout + out.stderr


@pytest.mark.slow
def test_prometheus_scrapes_three_agents(agents: dict[str, str], tmp_path: Path) -> None:
    with running_prometheus(tmp_path / "prom", agents) as prom:
        wait_until("three targets up", lambda: prom.targets_up(3))
        wait_until(
            "a scrape of every agent",
            lambda: len(prom.query('ingero_events_total{op="cudaStreamSync"}')) == 3,
        )
        # Events per node and op: the values of each node's event_aggregates, under the right labels.
        got = {s["metric"]["node"]: s for s in prom.query('ingero_events_total{op="cudaStreamSync"}')}
        assert set(got) == set(NODES)
        for node, s in got.items():
            labels = s["metric"]
            assert labels["agent"] == node and labels["job"] == "ingero" and labels["source"] == "CUDA"
            assert "pid" not in labels
            (want,) = sql(node, "SELECT sum(count) FROM event_aggregates WHERE source = 1 AND op = 5")[0]
            assert float(s["value"][1]) == want
        # Latency histograms: gpu-node-01 (CPU contention) has the worst cudaStreamSync tail.
        p99 = {
            s["metric"]["node"]: float(s["value"][1])
            for s in prom.query(
                'histogram_quantile(0.99, sum by (node, le) (ingero_call_duration_seconds_bucket{op="cudaStreamSync"}))'
            )
        }
        assert set(p99) == set(NODES)
        assert p99["gpu-node-01"] > 2 * max(p99["gpu-node-02"], p99["gpu-node-03"])
        # Off-CPU time of the traced processes, and chains by severity, as the database has them.
        for node in NODES:
            (offcpu,) = sql(node, "SELECT coalesce(sum(duration), 0) FROM events WHERE source = 3 AND op = 1")[0]
            (s,) = prom.query(f'sum(ingero_offcpu_seconds_total{{node="{node}"}})')
            assert float(s["value"][1]) == pytest.approx(int(offcpu) / 1e9)
            chains = dict(sql(node, "SELECT upper(severity), count(*) FROM causal_chains GROUP BY 1"))
            for sev in r.SEVERITIES:
                (c,) = prom.query(f'ingero_causal_chains{{node="{node}",severity="{sev}"}}')
                assert float(c["value"][1]) == chains.get(sev, 0)
        # The shipped rules loaded and evaluate.
        groups = {g["name"] for g in prom.get("/api/v1/rules")["groups"]}
        assert groups == {"ingero-recording", "ingero-alerts"}
        # Every Grafana panel query parses and runs on this Prometheus; the ones over data this
        # cluster has (no NCCL, nothing lost) return series for all three nodes.
        dash = json.loads(DASHBOARD.read_text())
        wait_until(
            "two scrapes of every agent (rates)",
            lambda: len(prom.query("sum by (node) (rate(ingero_events_total[1m]))")) == 3,
        )
        with_data = 0
        for panel in dash["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$node", ".*").replace("$__rate_interval", "1m")
                result = prom.query(expr)
                if result:
                    with_data += 1
                    assert {s["metric"].get("node") for s in result} <= set(NODES)
        assert with_data >= 8


def engine_recording(tmp_path: Path) -> Path:
    """A node serving a stand-in vLLM (its page in full) and SGLang, recorded by trace --inference."""
    from tests.engine_standin import recording

    engines = [(4242, "vllm", "kv_pressure"), (5151, "sglang", "healthy_busy")]
    return recording(tmp_path / "serve.db", "serve-node-01", engines, 12, full=True)


def exposition(db: Path) -> str:
    """What ``--prometheus`` serves for the recording ``db`` (``ingero serve``'s collector)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from ingero.identity import Identity
    from ingero.metrics.dbfeed import attach_database
    from ingero.metrics.prometheus import IngeroCollector
    from ingero.metrics.state import MetricState

    st = MetricState(Identity("serve-node-01"), "serve")
    attach_database(st, db)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(IngeroCollector(st.snapshot))
    return generate_latest(reg).decode()


def test_promtool_checks_the_engine_series(tmp_path: Path) -> None:
    """The engines' series re-exported by --prometheus pass promtool's lint: valid names (no colon),
    counters with _total, histograms whole. Triton's own pending_request_count is the one name promtool
    would rename, and it is kept as Triton publishes it."""
    from ingero.identity import Identity
    from ingero.store.writer import StoreWriter

    db = engine_recording(tmp_path)
    text = exposition(db)
    assert "ingero_engine_vllm_num_requests_running{" in text and "ingero_engine_sglang_token_usage{" in text
    assert "# TYPE ingero_engine_vllm_e2e_request_latency_seconds histogram" in text
    assert "# TYPE ingero_engine_vllm_num_aborted_requests_total counter" in text
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

    triton = [(time.time_ns(), 99, "triton", "nv_inference_pending_request_count", '{"model":"r"}', 3.0)]
    with StoreWriter(db, Identity("serve-node-01")) as w:
        w.write_batch(engine_metrics=triton)
    again = subprocess.run(["promtool", "check", "metrics"], input=exposition(db), capture_output=True, text=True)
    problems = (again.stdout + again.stderr).strip().splitlines()
    assert problems == [
        'ingero_engine_nv_inference_pending_request_count non-histogram and non-summary metrics should not have "_count" suffix'
    ]


@pytest.mark.slow
def test_prometheus_scrapes_the_engine_series(tmp_path: Path) -> None:
    """A real Prometheus scraping `ingero serve --prometheus` on a serving node's recording: the engines'
    gauges, counters and histograms arrive with the node, and PromQL's histogram_quantile and rate work on
    them as on the engine's own."""
    db = engine_recording(tmp_path)
    conn = sqlite3.connect(db)
    try:
        (waiting,) = conn.execute(
            "SELECT value FROM engine_metrics WHERE metric = 'vllm:num_requests_waiting' ORDER BY ts DESC LIMIT 1"
        ).fetchone()
        (ttft_count,) = conn.execute(
            "SELECT value FROM engine_metrics WHERE metric = 'vllm:time_to_first_token_seconds_count' "
            "ORDER BY ts DESC LIMIT 1"
        ).fetchone()
    finally:
        conn.close()
    proc, addr = start_agent(db, "serve-node-01")
    try:
        with running_prometheus(tmp_path / "prom", {"serve-node-01": addr}, rules=False) as prom:
            wait_until("the engine series", lambda: prom.query("ingero_engine_vllm_num_requests_waiting"))
            (s,) = prom.query("ingero_engine_vllm_num_requests_waiting")
            labels = s["metric"]
            assert labels["node"] == "serve-node-01" and labels["engine"] == "vllm" and labels["engine_pid"] == "4242"
            assert labels["model_name"] == "llama-3-8b" and float(s["value"][1]) == waiting
            (c,) = prom.query("ingero_engine_vllm_time_to_first_token_seconds_count")
            assert float(c["value"][1]) == ttft_count
            (q,) = prom.query(
                "histogram_quantile(0.5, sum by (node, le) (ingero_engine_vllm_time_to_first_token_seconds_bucket))"
            )
            assert 0.01 < float(q["value"][1]) <= 0.1  # kv_pressure's first tokens: 90 ms
            assert prom.query('ingero_engine_sglang_num_running_reqs{node="serve-node-01",engine_pid="5151"}')
            meta = prom.get("/api/v1/metadata")
            assert (
                meta["ingero_engine_vllm_num_preemptions"][0]["type"] == "counter"
            )  # the family, as Prometheus keys it
            assert meta["ingero_engine_vllm_time_to_first_token_seconds"][0]["type"] == "histogram"
            assert meta["ingero_engine_vllm_num_requests_waiting"][0]["type"] == "gauge"
            wait_until(
                "two scrapes (rate)",
                lambda: prom.query("rate(ingero_engine_vllm_request_success_total[1m])"),
            )
    finally:
        stop(proc)
