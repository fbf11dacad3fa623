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


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _fleet(pki: Pki, d: Path, job: Job) -> Iterator[list[str]]:
    specs = [AgentSpec(write_calls_db(d / f"{c.node}.db", c), c.node) for c in simulate(job)]
    with agents_in_thread(pki, specs) as servers:
        yield [f"{s.host}:{s.port}" for s in servers]


@pytest.fixture(scope="module")
def late3(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Four ranks, one per agent; gpu-node-03 (rank 2) computes 12 ms longer every step."""
    job = Job([Rank(n, extra_ms=12.0 if n == "gpu-node-03" else 0.0) for n in NODES], steps=300)
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
    assert by_node["gpu-node-03"]["median_lag_ms"] == pytest.approx(12.0, abs=1.0 + clock)
    assert [r["node"] for r in doc["outliers"]["ranks"]] == ["gpu-node-03"]  # the one that never waits
    assert doc["straggler"]["collectives"]["comms"][0]["complete_calls"] == 300
    assert doc["answered"] == 4


def test_cost_prices_the_waiting(
    late3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["fleet", "cost", *flags(pki, late3), "--usd-per-gpu-hour", "3.6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["usd"] == pytest.approx(doc["wait_s"] / 3600 * 3.6, rel=1e-3)
    # three peers × 300 calls × ~12 ms (each loopback agent's clock offset is known within a few ms)
    assert 0.5 * 3 * 300 * 0.012 < doc["wait_s"] < 1.5 * 3 * 300 * 0.012
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
    # step-to-step jitter well above what the loopback agents' clock offsets are known to (±1-3 ms)
    for addrs in _fleet(pki, tmp_path, Job([Rank(n) for n in NODES], steps=200, jitter_ms=6.0)):
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
