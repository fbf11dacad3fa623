"""Fleet pieces that need no agent: skew arithmetic, straggler verdict, row/chain merging, settings."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import trio

from ingero.config import NodeSpec, is_loopback, parse_config_file, parse_node_list
from ingero.errors import ConfigError, UsageError
from ingero.explain.model import Chain
from ingero.explain.stats import host_summary, op_stats
from ingero.fleet.client import FleetClient
from ingero.fleet.merge import merge_chains, merge_rows
from ingero.fleet.outcome import Kind, NodeOutcome, failure_summary
from ingero.fleet.render import Progress, folded_failure_lines, query_footer, render_chains, unanswered_lines
from ingero.fleet.settings import ClientSettings, check_plaintext, settings_from
from ingero.fleet.skew import SkewEstimate, TimeSample, estimate, exceeds, warning
from ingero.fleet.straggler import NodeFigures, robust_z, verdict
from ingero.store.db import open_readonly
from tests.fleet_agents import closed_port

MS = 1_000_000
BASE = 1_775_218_715_095_237_062  # a 2026 Unix ns timestamp: far beyond float64's exact range


def spec(i: int) -> NodeSpec:
    return NodeSpec("127.0.0.1", 9000 + i)


def ok(i: int, node: str, data: object, kind: Kind = Kind.OK) -> NodeOutcome:
    return NodeOutcome(spec(i), kind, node, "", data)


# --- skew ---------------------------------------------------------------------------------------


def sample(offset_ns: int, out_ns: int, back_ns: int, server_ns: int = 20_000, t1: int = BASE) -> TimeSample:
    """A sample for an agent whose clock is ``offset_ns`` ahead, with the given one-way legs."""
    t2 = t1 + out_ns + offset_ns
    t3 = t2 + server_ns
    t4 = t3 - offset_ns + back_ns
    return TimeSample(t1, t2, t3, t4)


def test_ntp_formula_exact_for_symmetric_paths() -> None:
    s = sample(47 * MS, 300_000, 300_000)
    assert s.offset_ns == 47 * MS
    assert s.delay_ns == 600_000


def test_lowest_delay_sample_wins_and_bounds_hold() -> None:
    true = -200 * MS
    samples = [
        sample(true, 5 * MS, 1 * MS, t1=BASE),  # asymmetric, slow: offset off by 2 ms
        sample(true, 150_000, 250_000, t1=BASE + 10 * MS),  # the tightest
        sample(true, 2 * MS, 9 * MS, t1=BASE + 20 * MS),
    ]
    est = estimate(samples)
    assert est is not None
    assert est.delay_ns == 400_000
    assert est.samples == 3
    assert est.contains(true)  # |offset - true| = 50 µs <= uncertainty 200 µs
    assert abs(est.offset_ns - true) == 50_000
    for s in samples:  # every sample's interval contains the truth (causality), not only the winner's
        assert abs(s.offset_ns - true) <= s.delay_ns / 2


def test_negative_delay_samples_are_discarded() -> None:
    good = sample(10 * MS, 100_000, 100_000)
    broken = TimeSample(BASE, BASE + 5 * MS, BASE + 50 * MS, BASE + 1 * MS)  # agent spent longer than RTT
    est = estimate([broken, good], failed=2)
    assert est is not None
    assert est.offset_ns == good.offset_ns
    assert est.samples == 1 and est.failed == 3
    assert estimate([broken]) is None
    assert estimate([]) is None


def test_skew_wording_and_threshold() -> None:
    ahead = SkewEstimate(offset_ns=47.3 * MS, delay_ns=2 * MS, samples=4)
    assert ahead.describe("gpu-node-02") == "gpu-node-02 is ~47 ms ahead of this host (±1 ms)"
    behind = SkewEstimate(offset_ns=-3.25 * MS, delay_ns=0.5 * MS, samples=4)
    assert behind.describe("n3") == "n3 is ~3.2 ms behind this host (±0.2 ms)"
    assert behind.short() == "-3.2 ms ±0.2 ms"
    assert warning("n3", behind, 10.0) is None
    line = warning("gpu-node-02", ahead, 10.0)
    assert line is not None and line.startswith("gpu-node-02 is ~47 ms ahead of this host (±1 ms)")
    assert ahead.as_dict() == {
        "offset_ms": 47.3,
        "uncertainty_ms": 1.0,
        "rtt_ms": 2.0,
        "samples": 4,
        "failed": 0,
        "drift_ppm": None,  # no fleet pass, and under 3 samples: never a made-up number
        "drift_uncertainty_ppm": None,
        "fleet_median_ms": None,
        "z": None,
        "outlier": False,
    }


def test_skew_warning_only_when_offset_beyond_its_uncertainty() -> None:
    """|offset| − uncertainty > threshold: a 14 ms offset measured over a 10 ms round trip (±5 ms) could be
    9 ms — no warning at 10 ms; the same offset over a 2 ms round trip (±1 ms) is at least 13 ms — warned."""
    loose = SkewEstimate(offset_ns=-14 * MS, delay_ns=10 * MS, samples=2)
    tight = SkewEstimate(offset_ns=-14 * MS, delay_ns=2 * MS, samples=2)
    edge = SkewEstimate(offset_ns=15 * MS, delay_ns=10 * MS, samples=2)  # 15 − 5 = 10: not beyond
    assert not exceeds(loose, 10.0) and warning("n", loose, 10.0) is None
    assert exceeds(tight, 10.0)
    line = warning("n", tight, 10.0)
    assert line is not None and line.startswith("n is ~14 ms behind this host (±1 ms)")
    assert not exceeds(edge, 10.0) and exceeds(edge, 9.9)
    assert not exceeds(None, 0.0)


# --- straggler ------------------------------------------------------------------------------------


def test_robust_z_uses_median_and_mad() -> None:
    z = robust_z(np.array([18.4, 2.1, 1.9, 2.0]))
    # median 2.05, MAD median(|16.35, .05, .15, .05|) = 0.1
    assert z[0] == pytest.approx(0.6745 * 16.35 / 0.1)
    assert abs(z[1]) < 1 and abs(z[2]) < 2
    same = robust_z(np.array([2.0, 2.0, 9.0]))
    assert same[0] == 0 and math.isinf(same[2]) and same[2] > 0


def figs(node: str, events: int, avg_ms: float, **kw: float) -> NodeFigures:
    return NodeFigures(node=node, host_events=events, host_avg_ms=avg_ms, **kw)  # type: ignore[arg-type]


def test_verdict_names_the_outlier() -> None:
    v = verdict([figs("gpu-node-01", 847, 18.4), figs("gpu-node-02", 212, 2.1), figs("gpu-node-03", 205, 1.9)])
    assert v.outlier == "gpu-node-01"
    assert v.line == "gpu-node-01 is the outlier: 847 host events at 18.4 ms avg vs peers ~2 ms"
    metrics = {f.metric for f in v.findings}
    assert metrics == {"host_events", "host_avg_ms"}
    assert v.as_dict()["outlier"] == "gpu-node-01"


def test_verdict_needs_a_real_difference() -> None:
    # Robust z alone would flag 200 vs 160/164 (MAD 4): the 2x ratio guard keeps it quiet.
    v = verdict([figs("a", 200, 0.76), figs("b", 160, 20.0), figs("c", 164, 18.4)])
    assert v.outlier is None
    assert v.line.startswith("no straggler: the 3 nodes look alike (160–200 host events")
    one = verdict([figs("a", 10, 1.0)])
    assert one.outlier is None and "at least 2 nodes" in one.line


def test_verdict_on_gpu_op_tail_and_two_nodes() -> None:
    fleet = [
        figs("n1", 100, 1.0, op_p99_ms={"cuLaunchKernel": 63.0}),
        figs("n2", 100, 1.0, op_p99_ms={"cuLaunchKernel": 1.0}),
        figs("n3", 101, 1.0, op_p99_ms={"cuLaunchKernel": 1.1}),
        figs("n4", 99, 1.0, op_p99_ms={"cuLaunchKernel": 0.9}),
    ]
    v = verdict(fleet)
    assert v.outlier == "n1"
    assert v.line.startswith("n1 is the outlier: cuLaunchKernel p99 63 ms vs peers ~1 ms; 100 host events")
    two = verdict([figs("x", 900, 18.0), figs("y", 200, 2.0)])
    assert two.outlier == "x"
    assert verdict([figs("x", 300, 2.5), figs("y", 200, 2.0)]).outlier is None


def test_figures_from_real_ops_answer(samples: Path) -> None:
    """NodeFigures read exactly what the agent's /ops sends: OpStats.as_dict + HostSummary.as_dict."""
    conn = open_readonly(samples / "sample-gpu-node-02.db")
    try:
        body = {"ops": [s.as_dict() for s in op_stats(conn)], "host": host_summary(conn).as_dict()}
    finally:
        conn.close()
    f = NodeFigures.from_ops_body("gpu-node-02", body)
    assert f.host_events == 160
    assert f.host_avg_ms == pytest.approx(20.0205)
    assert f.gpu_api_calls == 40
    assert set(f.op_p99_ms) == {"cuMemAlloc"}
    assert f.op_p99_ms["cuMemAlloc"] == pytest.approx(0.149196)


# --- merging --------------------------------------------------------------------------------------


def qbody(node: str, cols: list[str], rows: list[list[object]], truncated: bool = False) -> dict[str, object]:
    return {"ok": True, "node": node, "columns": cols, "rows": rows, "truncated": truncated, "elapsed_ms": 1.0}


def test_merge_rows_node_first_and_mismatch_skipped() -> None:
    outcomes = [
        ok(2, "gpu-node-02", qbody("gpu-node-02", ["source", "cnt"], [[3, 62], [5, 98]])),
        ok(1, "gpu-node-01", qbody("gpu-node-01", ["source", "cnt"], [[3, 99]])),
        ok(3, "gpu-node-03", qbody("gpu-node-03", ["src", "n"], [[3, 58]])),
        NodeOutcome(spec(4), Kind.TIMEOUT, None, "no answer within 5s"),
    ]
    r = merge_rows(outcomes)
    assert r.columns == ["node", "source", "cnt"]
    assert r.rows == [["gpu-node-01", 3, 99], ["gpu-node-02", 3, 62], ["gpu-node-02", 5, 98]]
    assert outcomes[2].kind is Kind.SCHEMA and "differ" in outcomes[2].reason
    assert [o.label for o in r.answered] == ["gpu-node-02", "gpu-node-01"]
    assert query_footer(r).startswith("3 rows from 2 node(s)")
    lines = unanswered_lines(r.outcomes)
    assert lines[0].startswith("gpu-node-03 (127.0.0.1:9003): schema — columns (src, n) differ")
    assert lines[1] == "127.0.0.1:9004: timeout — no answer within 5s"
    assert "127.0.0.1:9004: timeout" in failure_summary(r.outcomes)
    meta = r.meta()
    assert meta["answered"] == 2 and meta["failed"] == 2
    assert {n["node"]: n["rows"] for n in meta["nodes"]}["gpu-node-02"] == 2


def test_merge_rows_folds_a_selected_node_column(samples: Path) -> None:
    """The seed query selects node itself: its values equal each agent's identity, so no duplicate."""
    from tests.conftest import SEED_QUERY

    outcomes = []
    for i in (1, 2, 3):
        db = open_readonly(samples / f"sample-gpu-node-0{i}.db")
        cur = db.execute(SEED_QUERY)
        cols = [d[0] for d in cur.description]
        rows = [list(r) for r in cur]
        db.close()
        outcomes.append(ok(i, f"gpu-node-0{i}", qbody(f"gpu-node-0{i}", cols, rows)))
    r = merge_rows(outcomes)
    assert r.columns == ["node", "source", "cnt", "avg_us"]
    assert len(r.rows) == 8  # as on sample-cluster.db
    assert {row[0] for row in r.rows} == {"gpu-node-01", "gpu-node-02", "gpu-node-03"}
    # an agent serving a merged database: values differ from its identity → kept as db_node
    mixed = [ok(1, "laptop", qbody("laptop", ["node", "n"], [["gpu-node-01", 1], ["gpu-node-02", 2]]))]
    r2 = merge_rows(mixed)
    assert r2.columns == ["node", "db_node", "n"]
    assert r2.rows[1] == ["laptop", "gpu-node-02", 2]


def test_merge_rows_rejects_malformed_answers() -> None:
    outcomes = [
        ok(1, "a", qbody("a", ["x", "y"], [[1]])),
        ok(2, "b", {"ok": True, "node": "b", "rows": []}),
        ok(3, "c", qbody("c", ["x", "y"], [[1, 2]], truncated=True), Kind.TRUNCATED),
    ]
    outcomes[2].reason = "row limit 1"
    r = merge_rows(outcomes)
    assert [o.kind for o in outcomes] == [Kind.SCHEMA, Kind.SCHEMA, Kind.TRUNCATED]
    assert r.rows == [["c", 1, 2]]
    assert r.truncated == [outcomes[2]]


def chain(node: str, severity: str, summary: str, at: int) -> dict[str, object]:
    c = Chain(
        id=f"{node}:x{at}",
        node=node,
        detected_at=at,
        severity=severity,
        summary=summary,
        root_cause="CPU contention",
        explanation="",
        recommendations=["pin the trainer with taskset"],
    )
    return c.as_dict()


def test_merge_chains_sorted_and_verdict() -> None:
    def body(node: str, chains: list[dict[str, object]], events: int, avg: float) -> dict[str, object]:
        return {
            "chains": {"ok": True, "node": node, "window": None, "chains": chains, "stored": []},
            "ops": {"ok": True, "node": node, "ops": [], "host": {"host_events": events, "host_avg_ms": avg}},
        }

    outcomes = [
        ok(
            2,
            "gpu-node-02",
            body("gpu-node-02", [chain("gpu-node-02", "MEDIUM", "cuMemAlloc p99 410x p50", 5)], 210, 2.0),
        ),
        ok(
            1,
            "gpu-node-01",
            body(
                "gpu-node-01", [chain("gpu-node-01", "MEDIUM", "m", 1), chain("gpu-node-01", "HIGH", "h", 2)], 847, 18.4
            ),
        ),
        ok(3, "gpu-node-03", body("gpu-node-03", [], 190, 2.2)),
        NodeOutcome(spec(4), Kind.REFUSED, None, "connection refused"),
    ]
    fc = merge_chains(outcomes)
    assert [(c.severity, c.node) for c in fc.chains] == [
        ("HIGH", "gpu-node-01"),
        ("MEDIUM", "gpu-node-01"),
        ("MEDIUM", "gpu-node-02"),
    ]
    assert fc.verdict.outlier == "gpu-node-01"
    text = render_chains(fc)
    assert text.startswith("FLEET DIAGNOSIS — 3 causal chains across 3 node(s), 1 HIGH")
    assert "1. [HIGH]   gpu-node-01  h\n    root cause: CPU contention\n" in text
    assert "    fix:\n      1. pin the trainer with taskset" in text
    assert text.endswith("straggler: gpu-node-01 is the outlier: 847 host events at 18.4 ms avg vs peers ~2.1 ms")
    doc = fc.as_dict()
    assert doc["answered"] == 3 and doc["failed"] == 1 and doc["straggler"]["outlier"] == "gpu-node-01"


# --- settings, config, progress ---------------------------------------------------------------------


def test_settings_from_config_and_flags(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cfg_file = tmp_path / "ingero.yaml"
    cfg_file.write_text(
        "fleet:\n  nodes: [a:1, {name: n2, addr: 'b:2'}]\n  ca_cert: ca.pem\n  token: t0\n"
        "  timeout: 2s\n  fanout: 8\n  skew_threshold: 25ms\n  plaintext: false\n"
    )
    cfg = parse_config_file(cfg_file)
    s = settings_from(cfg.fleet, config_path=cfg.path, env={})
    assert (s.timeout_s, s.fanout, s.skew_threshold_ms, s.token, s.ca_cert) == (2.0, 8, 25.0, "t0", str(ca))
    s2 = settings_from(cfg.fleet, timeout="250ms", fanout=3, token="t1", env={"INGERO_TOKEN": "t2"})
    assert (s2.timeout_s, s2.fanout, s2.token) == (0.25, 3, "t1")
    assert settings_from(None, env={"INGERO_TOKEN": "t2"}).token == "t2"
    # one precedence rule, as the agent's: flag > environment > config file
    assert settings_from(cfg.fleet, env={"INGERO_TOKEN": "t2"}).token == "t2"
    with pytest.raises(UsageError, match="line break"):
        settings_from(None, env={"INGERO_TOKEN": "s3cret\n"})
    with pytest.raises(UsageError):
        settings_from(None, fanout=0)
    with pytest.raises(UsageError, match="needs its key"):
        settings_from(None, client_cert=str(ca))
    bad = tmp_path / "bad.yaml"
    bad.write_text("fleet:\n  fanuot: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: fleet.fanuot: unknown key"):
        parse_config_file(bad)


def test_plaintext_only_to_loopback() -> None:
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("[::1]") and is_loopback("LOCALHOST") and is_loopback("localhost.localdomain")
    assert not is_loopback("10.0.0.1") and not is_loopback("gpu-node-01")
    plain = ClientSettings(plaintext=True)
    check_plaintext(parse_node_list("127.0.0.1:1,localhost:2"), plain)
    with pytest.raises(UsageError, match=r"refusing plain HTTP to non-loopback node 10\.0\.0\.1:8080 and 1 more"):
        check_plaintext(parse_node_list("127.0.0.1:1,10.0.0.1:8080,gpu-node-02:8080"), plain)
    check_plaintext(parse_node_list("10.0.0.1:8080"), plain.with_(allow_plaintext_remote=True))
    with pytest.raises(UsageError):
        FleetClient(parse_node_list("10.0.0.1:8080"), plain)


def test_refused_nodes_are_outcomes_not_exceptions() -> None:
    """Real sockets: ports with nobody listening end as 'refused' outcomes, all of them."""
    nodes = [NodeSpec("127.0.0.1", closed_port()) for _ in range(3)]
    seen: list[NodeOutcome] = []

    async def main() -> list[NodeOutcome]:
        async with FleetClient(nodes, ClientSettings(plaintext=True, timeout_s=5)) as fc:
            return await fc.request_all("GET", "/api/v1/health", on_outcome=seen.append)

    outcomes = trio.run(main)
    assert [o.kind for o in outcomes] == [Kind.REFUSED] * 3
    assert all("connection refused" in o.reason for o in outcomes)
    assert all(o.skew is None and o.skew_error for o in outcomes)
    assert len(seen) == 3


def test_progress_line_only_on_a_terminal() -> None:
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    p = Progress(2, out)
    p(NodeOutcome(spec(1), Kind.OK, "a"))
    p(NodeOutcome(spec(2), Kind.TIMEOUT, None, "slow"))
    p.clear()
    assert "2/2 nodes done, 1 failed" in out.getvalue()
    assert out.getvalue().endswith("\r\x1b[2K")
    quiet = io.StringIO()
    Progress(1, quiet)(NodeOutcome(spec(1), Kind.OK, "a"))
    assert quiet.getvalue() == ""


def test_failures_fold_like_clush_and_duplicates_are_flagged() -> None:
    from ingero.fleet.client import flag_duplicates

    refused = "connection refused (is the agent running? ingero serve / ingero trace --listen)"
    outs = [NodeOutcome(spec(i), Kind.REFUSED, None, refused) for i in range(8)]
    outs.append(NodeOutcome(spec(8), Kind.TIMEOUT, None, "no answer within 5s"))
    lines = folded_failure_lines(outs)
    assert lines == [
        ", ".join(f"127.0.0.1:{9000 + i}" for i in range(6)) + f" and 2 more: refused — {refused}",
        "127.0.0.1:9008: timeout — no answer within 5s",
    ]
    nodes = flag_duplicates([ok(0, "a", {}), ok(1, "b", {}), ok(2, "a", {"rows": [[1]]}), ok(3, "a", {})])
    assert [o.kind for o in nodes] == [Kind.OK, Kind.OK, Kind.DUPLICATE, Kind.DUPLICATE]
    assert nodes[2].data is None and "127.0.0.1:9000" in nodes[2].reason and not nodes[2].answered


def test_a_nodes_malformed_ledger_rows_are_dropped_and_its_good_ones_printed() -> None:
    from ingero.explain.ledger import BUCKETS, LedgerRow, describe

    buckets = dict.fromkeys(BUCKETS, 0) | {
        "gpu_steady": 600_000_000,
        "host_code": 300_000_000,
        "preempted": 100_000_000,
    }
    good = LedgerRow("gpu-node-01", 3187, 3187, 0, 1_000_000_000, buckets, 42, {"host_code": 0})
    good.name = "python3 train.py"
    bad: list[object] = [{"buckets": "x"}, {"buckets": {"gpu_steady": "abc"}}, {"tid": []}, "not a row"]
    body = {
        "chains": {"ok": True, "node": "gpu-node-01", "window": None, "chains": [], "ledger": [good.as_dict(), *bad]},
        "ops": {"ok": True, "node": "gpu-node-01", "ops": [], "host": {"host_events": 10, "host_avg_ms": 1.0}},
    }
    fc = merge_chains([ok(1, "gpu-node-01", body)])
    assert fc.ledger == [good.as_dict()] and LedgerRow.from_dict(fc.ledger[0]).as_dict() == good.as_dict()
    text = render_chains(fc)
    line = "  GPU thread 3187 (python3 train.py): 1s = 60 % GPU calls + 30 % own host code + 10 % preempted"
    assert f"gpu-node-01\n{line}\n" in text and line.endswith(describe(good))
