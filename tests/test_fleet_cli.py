"""The fleet commands end to end: ``query --nodes``, ``explain --nodes``, ``fleet status`` against real
mTLS agents on 127.0.0.1; config discovery; exit codes; a real ``ingero serve`` under libfaketime."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.cli.main import main
from ingero.fleet import local_agents
from tests.conftest import ROOT, SEED_QUERY, write_db
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, closed_port, make_pki, straggler_events

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def fleet3(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Three agents, gpu-node-01 the straggler; yields their host:port addresses."""
    d = tmp_path_factory.mktemp("dbs")
    specs = [
        AgentSpec(
            write_db(d / "n1.db", straggler_events(850, 18.4, 1, tail=True), node="gpu-node-01"),
            "gpu-node-01",
            rank=0,
            world_size=3,
        ),
        AgentSpec(
            write_db(d / "n2.db", straggler_events(200, 2.0, 2), node="gpu-node-02"),
            "gpu-node-02",
            rank=1,
            world_size=3,
        ),
        AgentSpec(
            write_db(d / "n3.db", straggler_events(210, 2.1, 3), node="gpu-node-03"),
            "gpu-node-03",
            rank=2,
            world_size=3,
        ),
    ]
    with agents_in_thread(pki, specs) as servers:
        yield [f"{s.host}:{s.port}" for s in servers]


def tls_flags(pki: Pki) -> list[str]:
    return ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]


def dead_addr() -> str:
    return f"127.0.0.1:{closed_port()}"


def test_query_table_with_footer(fleet3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["query", "--nodes", ",".join(fleet3), *tls_flags(pki), SEED_QUERY])
    out, err = capsys.readouterr()
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["node", "source", "cnt", "avg_us"]
    body = [line.split() for line in lines[2:]]
    assert [r[0] for r in body] == ["gpu-node-01"] * 3 + ["gpu-node-02"] * 3 + ["gpu-node-03"] * 3
    assert {(r[0], r[1], r[2]) for r in body} >= {("gpu-node-01", "4", "300"), ("gpu-node-02", "3", "100")}
    assert "9 rows from 3 node(s)" in err
    assert "did not answer" not in err


def test_query_json_csv_and_partial_failure(fleet3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    dead = dead_addr()
    nodes = ",".join([*fleet3, dead])
    assert main(["query", "--nodes", nodes, *tls_flags(pki), "--json", "--limit", "2", SEED_QUERY]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["columns"] == ["node", "source", "cnt", "avg_us"]
    assert len(doc["rows"]) == 6  # --limit is per node
    assert doc["answered"] == 3 and doc["failed"] == 1 and doc["truncated"] is True
    failed = [n for n in doc["nodes"] if not n["answered"]]
    assert failed[0]["addr"] == dead and failed[0]["outcome"] == "refused"
    assert f"{dead}: refused — connection refused" in err
    assert all(n["skew"]["samples"] >= 1 for n in doc["nodes"] if n["answered"])

    assert main(["query", "--nodes", nodes, *tls_flags(pki), "--csv", "--strict", SEED_QUERY]) == 5
    out, err = capsys.readouterr()
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["node", "source", "cnt", "avg_us"] and len(rows) == 10
    assert "--strict" in err


def test_no_node_answering_is_an_error_listing_each(pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = dead_addr(), dead_addr()
    code = main(["query", "--nodes", f"{a},{b}", *tls_flags(pki), "--timeout", "2s", "SELECT 1"])
    _, err = capsys.readouterr()
    assert code == 4
    assert "ingero: error: none of the 2 node(s) answered" in err
    assert f"{a}: refused" in err.splitlines()[-1] and f"{b}: refused" in err.splitlines()[-1]


def test_config_file_drives_the_fleet(
    fleet3: list[str], pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "fleet.yaml"
    entries = "\n".join(f"    - {{name: n{i}, addr: '{a}'}}" for i, a in enumerate(fleet3))
    cfg.write_text(
        f"fleet:\n  nodes:\n{entries}\n  ca_cert: {pki.ca}\n  client_cert: {pki.client_cert}\n"
        f"  client_key: {pki.client_key}\n  timeout: 3s\n  skew_threshold: 25ms\n"
    )
    assert main(["query", "--config", str(cfg), "SELECT count(*) AS n FROM events"]) == 0
    out, err = capsys.readouterr()
    assert [line.split() for line in out.splitlines()[2:]] == [
        ["gpu-node-01", "1150"],
        ["gpu-node-02", "500"],
        ["gpu-node-03", "510"],
    ]
    assert "3 rows from 3 node(s)" in err
    # $INGERO_CONFIG is honoured too, and a bad key is one line naming file and key
    bad = tmp_path / "bad.yaml"
    bad.write_text("fleet:\n  nodes: ['127.0.0.1:1']\n  fanout: -3\n")
    os.environ["INGERO_CONFIG"] = str(bad)
    try:
        assert main(["fleet", "status"]) == 2
    finally:
        del os.environ["INGERO_CONFIG"]
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"ingero: error: {bad}: fleet.fanout: expected a positive integer")


def test_explain_names_the_straggler(fleet3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", "--nodes", ",".join(fleet3), *tls_flags(pki), "--since", "10m"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith("FLEET DIAGNOSIS")
    assert "straggler: gpu-node-01 is the outlier: 850 host events at " in out
    chain_heads = [line for line in out.splitlines() if line[:1].isdigit() and ". [" in line]
    sev = [h.split("[", 1)[1].split("]")[0] for h in chain_heads]
    order = {"HIGH": 0, "MEDIUM": 1, "LOW": 2}
    assert chain_heads and sev == sorted(sev, key=order.__getitem__)
    assert chain_heads[0].startswith("1. [HIGH]   gpu-node-01  cuLaunchKernel p99=")
    assert "root cause: " in out and "fix:" in out
    assert "from 3 node(s)" in err
    assert main(["explain", "--nodes", ",".join(fleet3), *tls_flags(pki), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["straggler"]["outlier"] == "gpu-node-01"
    assert doc["answered"] == 3
    assert {c["node"] for c in doc["chains"]} <= {"gpu-node-01", "gpu-node-02", "gpu-node-03"}


def test_fleet_status_rows(fleet3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    dead = dead_addr()
    assert main(["fleet", "status", "--nodes", ",".join([*fleet3, dead]), *tls_flags(pki), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_node = {n["node"] or n["addr"]: n for n in doc["nodes"]}
    assert by_node["gpu-node-02"]["info"]["rank"] == 1 and by_node["gpu-node-02"]["info"]["world_size"] == 3
    assert by_node["gpu-node-01"]["info"]["tls"] == "mtls"
    assert by_node[dead]["outcome"] == "refused"
    assert main(["fleet", "status", "--nodes", ",".join(fleet3), *tls_flags(pki)]) == 0
    out, err = capsys.readouterr()
    header = out.splitlines()[0].split()
    assert header == [
        "reachable",
        "node",
        "addr",
        "rank",
        "version",
        "rtt_ms",
        "skew",
        "events",
        "first",
        "last",
        "tls",
    ]
    assert "gpu-node-03" in out and "2/3" in out and "mtls" in out
    assert "3 of 3 node(s) reachable" in err


def test_plaintext_to_remote_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "--nodes", "10.0.0.1:8080", "--plaintext", "SELECT 1"]) == 2
    assert "refusing plain HTTP to non-loopback node 10.0.0.1:8080" in capsys.readouterr().err


@pytest.mark.skipif(not FAKETIME_LIB.exists(), reason="libfaketime (Debian 'faketime') not installed")
def test_skew_warning_names_a_shifted_real_agent(pki: Pki, samples: Path, tmp_path: Path) -> None:
    """A real `ingero serve` under libfaketime (+50 ms): the warning names it, the estimate holds."""
    ready = tmp_path / "ready.json"
    env = {**os.environ, "LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": "+0.05", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "ingero", "serve", "--db", str(samples / "sample-gpu-node-03.db"), "--node", "shifted",
         "--listen", "127.0.0.1:0", "--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key),
         "--client-ca", str(pki.ca), "--ready-file", str(ready)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _, addr = local_agents.wait_ready(agent, ready, "shifted")
        out = subprocess.run(
            [sys.executable, "-m", "ingero", "fleet", "status", "--json", "--nodes", f"{addr['host']}:{addr['port']}",
             *tls_flags(pki)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        local_agents.stop([agent])
    assert out.returncode == 0, out.stderr
    node = json.loads(out.stdout)["nodes"][0]
    skew = node["skew"]
    assert abs(skew["offset_ms"] - 50.0) <= skew["uncertainty_ms"] + 0.001, skew
    assert "ingero: warning: shifted is ~50 ms ahead of this host (±" in out.stderr
