"""``ingero fleet stragglers`` / ``fleet cost`` / ``explain --nodes`` end to end: real mTLS agents on
127.0.0.1 serving databases whose NCCL calls were written through the real writer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.cli.main import main
from tests.collective_sim import Job, Rank, simulate, write_calls_db
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, make_pki

NODES = ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]
LATE_MS = 100.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _fleet(pki: Pki, d: Path, job: Job) -> Iterator[list[str]]:
    specs = [AgentSpec(write_calls_db(d / f"{c.node}.db", c), c.node) for c in simulate(job)]
    with agents_in_thread(pki, specs) as servers:
        yield [f"{s.host}:{s.port}" for s in servers]


@pytest.fixture(scope="module")
def late3(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Four ranks, one per agent; gpu-node-03 (rank 2) computes 100 ms longer every step: far above what
    loopback agents' clock offsets are known to on a busy machine (each /time round trip can take 20 ms)."""
    job = Job([Rank(n, extra_ms=LATE_MS if n == "gpu-node-03" else 0.0) for n in NODES], steps=300)
    yield from _fleet(pki, tmp_path_factory.mktemp("late"), job)


def flags(pki: Pki, addrs: list[str]) -> list[str]:
    return [
        "--nodes",
        ",".join(addrs),
        "--ca-cert",
        str(pki.ca),
        "--client-cert",
        str(pki.client_cert),
        "--client-key",
        str(pki.client_key),
    ]


def test_stragglers_table_headline_and_outliers(late3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "stragglers", *flags(pki, late3)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("straggler: "))
    assert head.startswith(
        "straggler: gpu-node-03 (rank 2) arrived last at 300 of 300 ncclAllReduce calls (comm 9f3a…)"
    )
    assert "after the others" in head and "peers waited" in head
    rows = [line.split() for line in lines if line.startswith("gpu-node-0")]
    assert len(rows) == 4
    flagged = [r[0] for r in rows if r[-1] == "yes"]
    assert flagged == ["gpu-node-03"]
    assert any(line.startswith("cost: ") and "fleet.gpu_hourly_usd" in line for line in lines)


def test_stragglers_json_carries_the_per_rank_table(
    late3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fleet", "stragglers", *flags(pki, late3), "--json", "--metric", "wait"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "straggler" and doc["outlier"] == "gpu-node-03" and doc["source"] == "collectives"
    by_node = {r["node"]: r for r in doc["ranks"]}
    # loopback agents share one clock, but each measured offset is only known within its ± uncertainty
    clock = doc["straggler"]["collectives"]["uncertainty_ms"]
    assert by_node["gpu-node-03"]["last"] == 300
    assert by_node["gpu-node-03"]["median_lag_ms"] == pytest.approx(LATE_MS, abs=1.0 + clock)
    assert [r["node"] for r in doc["outliers"]["ranks"]] == ["gpu-node-03"]  # the one that never waits
    assert doc["straggler"]["collectives"]["comms"][0]["complete_calls"] == 300
    assert doc["answered"] == 4


def test_cost_prices_the_waiting(
    late3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["fleet", "cost", *flags(pki, late3), "--usd-per-gpu-hour", "3.6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["usd"] == pytest.approx(doc["wait_s"] / 3600 * 3.6, rel=1e-3)
    # three peers × 300 calls × ~100 ms (each loopback agent's clock offset is known within a few ms)
    assert doc["wait_s"] == pytest.approx(3 * 300 * LATE_MS / 1000, rel=0.25)
    assert doc["line"].startswith("cost: waiting in collectives burned $")
    cfg = tmp_path / "ingero.yaml"
    cfg.write_text("fleet:\n  gpu_hourly_usd:\n    default: 1.0\n    nodes: {gpu-node-01: 10.0}\n")
    assert main(["fleet", "cost", *flags(pki, late3), "--config", str(cfg), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rates = {r["node"]: r["usd_per_gpu_hour"] for r in doc["ranks"]}
    assert rates["gpu-node-01"] == 10.0 and rates["gpu-node-02"] == 1.0
    cfg.write_text("fleet:\n  gpu_hourly_usd: {default: -1}\n")
    assert main(["fleet", "cost", *flags(pki, late3), "--config", str(cfg)]) != 0
    assert "gpu_hourly_usd" in capsys.readouterr().err


def test_explain_nodes_verdict_comes_from_collectives(
    late3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", *flags(pki, late3)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("straggler: gpu-node-03 (rank 2) arrived last at 300 of 300")
    assert main(["explain", *flags(pki, late3), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["straggler"]["outlier"] == "gpu-node-03" and doc["straggler"]["source"] == "collectives"


def test_equal_ranks_and_no_collectives(
    pki: Pki, tmp_path: Path, samples: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # step-to-step jitter well above what the loopback agents' clock offsets are known to (±1-10 ms)
    for addrs in _fleet(pki, tmp_path, Job([Rank(n) for n in NODES], steps=200, jitter_ms=30.0, compute_ms=100.0)):
        assert main(["fleet", "stragglers", *flags(pki, addrs), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["kind"] == "no-straggler" and doc["outlier"] is None
        assert doc["outliers"]["ranks"] == []
    specs = [AgentSpec(samples / f"sample-gpu-node-0{i}.db", f"gpu-node-0{i}") for i in (1, 2, 3)]
    with agents_in_thread(pki, specs) as servers:
        addrs = [f"{s.host}:{s.port}" for s in servers]
        assert main(["fleet", "stragglers", *flags(pki, addrs)]) == 0
        out, err = capsys.readouterr()
        assert "no NCCL collectives in the window" in err
        assert out.startswith("straggler: ") or out.startswith("no straggler")


def test_tools_find_outlier_nodes_and_get_cost(late3: list[str], pki: Pki) -> None:
    """The registry's tools (what MCP, the HTTP tools API and the dashboard serve) on the same agents."""
    import trio

    from ingero.config import parse_node_list
    from ingero.tools import toolset
    from ingero.tools.registry import ToolEnv
    from tests.fleet_agents import client_settings

    env = ToolEnv(nodes=tuple(parse_node_list(",".join(late3))), fleet=client_settings(pki))

    async def main() -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
        out = await toolset.call("find_outlier_nodes", {}, env)
        by_wait = await toolset.call("find_outlier_nodes", {"metric": "wait", "threshold": 3.0}, env)
        cost = await toolset.call("get_cost", {"usd_per_gpu_hour": 2.0}, env)
        return out, by_wait, cost

    out, by_wait, cost = trio.run(main)
    assert str(out["headline"]).startswith("straggler: gpu-node-03 (rank 2) arrived last")
    assert [r["node"] for r in out["outliers"]["ranks"]] == ["gpu-node-03"]  # type: ignore[index]
    assert out["answered"] == 4 and out["straggler"]["source"] == "collectives"  # type: ignore[index]
    assert [r["node"] for r in by_wait["outliers"]["ranks"]] == ["gpu-node-03"]  # type: ignore[index]
    c = cost["cost"]
    assert c["usd"] == pytest.approx(c["wait_s"] / 3600 * 2.0, rel=1e-3)  # type: ignore[index]
    assert {r["node"] for r in c["ranks"]} == {"gpu-node-01", "gpu-node-02", "gpu-node-04"}  # type: ignore[index]
    with pytest.raises(Exception, match="metric"):
        trio.run(lambda: toolset.call("find_outlier_nodes", {"metric": "speed"}, env))
