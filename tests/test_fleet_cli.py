"""The fleet commands end to end: ``query --nodes``, ``explain --nodes``, ``fleet status`` against real
mTLS agents on 127.0.0.1; config discovery; exit codes; a real ``ingero serve`` under libfaketime."""

from __future__ import annotations

import csv
import io
import json
import os
import re
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
def fleet3_dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three nodes' databases, gpu-node-01 the straggler."""
    d = tmp_path_factory.mktemp("dbs")
    return {
        "gpu-node-01": write_db(d / "n1.db", straggler_events(850, 18.4, 1, tail=True), node="gpu-node-01"),
        "gpu-node-02": write_db(d / "n2.db", straggler_events(200, 2.0, 2), node="gpu-node-02"),
        "gpu-node-03": write_db(d / "n3.db", straggler_events(210, 2.1, 3), node="gpu-node-03"),
    }


@pytest.fixture(scope="module")
def fleet3(pki: Pki, fleet3_dbs: dict[str, Path]) -> Iterator[list[str]]:
    """Three agents over ``fleet3_dbs``; yields their host:port addresses."""
    specs = [AgentSpec(db, node, rank=i, world_size=3) for i, (node, db) in enumerate(fleet3_dbs.items())]
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
    # folded like clush -b: the nodes that failed the same way share one line
    assert f"{a}, {b}: refused — connection refused" in err.splitlines()[-1]
    assert sum(f"{a}, {b}: refused" in line for line in err.splitlines()) == 2  # the listing and the error


def test_bad_sql_is_one_query_error_not_n_node_failures(
    fleet3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = dead_addr()
    code = main(["query", "--nodes", ",".join([*fleet3, dead]), *tls_flags(pki), "SELEC count(*) FROM events"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("ingero: error:")]
    assert len(errors) == 1 and "syntax error" in errors[0] and "said by 3 of 4 node(s)" in errors[0], err
    assert f"not asked: {dead}: refused" in err
    # a statement that fails on only some nodes stays per-node (e.g. a table only newer agents have)
    assert query_error_free(fleet3, pki, capsys)


def query_error_free(fleet3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]) -> bool:
    code = main(["query", "--nodes", ",".join(fleet3), *tls_flags(pki), "SELECT count(*) AS n FROM events"])
    capsys.readouterr()
    return code == 0


def test_explain_nodes_honours_local_flags(
    fleet3: list[str], fleet3_dbs: dict[str, Path], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    """--op, --node, --chains, --per-process and --since select exactly the chains local explain selects on
    each database."""
    nodes = ",".join(fleet3)

    def chains(argv: list[str]) -> set[tuple[str, str]]:
        assert main(argv) == 0, capsys.readouterr().err
        doc = json.loads(capsys.readouterr().out)
        return {(c["node"], c["summary"]) for c in doc["chains"]}

    def local(*flags: str) -> set[tuple[str, str]]:
        """What local explain names on each node's database, all together."""
        return set().union(*(chains(["explain", "--db", str(db), *flags, "--json"]) for db in fleet3_dbs.values()))

    def fleet(*flags: str) -> set[tuple[str, str]]:
        return chains(["explain", "--nodes", nodes, *tls_flags(pki), *flags, "--json"])

    flags = ["--since", "10m", "--op", "cuLaunchKernel"]
    assert fleet(*flags) == local(*flags) and fleet(*flags)
    only = fleet(*flags, "--node", "gpu-node-01")
    assert only == {c for c in local(*flags) if c[0] == "gpu-node-01"} and only
    assert fleet("--op", "cudaMalloc") == set()
    assert fleet("--chains") == local("--chains")
    assert main(["explain", "--nodes", nodes, *tls_flags(pki), "--node", "nobody"]) == 2
    assert "no node 'nobody' answered" in capsys.readouterr().err
    assert fleet("--per-process") == local("--per-process") and local("--per-process")
    assert main(["explain", "--nodes", nodes, *tls_flags(pki), "--pid", "4242"]) == 2
    assert "--pid works on a local --db only" in capsys.readouterr().err


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
    # the straggler's chain comes first (its severity is the explain engine's call)
    assert re.match(r"1\. \[(HIGH|MEDIUM|LOW)\]\s+gpu-node-01  cuLaunchKernel p99=", chain_heads[0]), chain_heads
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
        "drift_ppm",
        "events",
        "first",
        "last",
        "shipping",
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
    assert re.search(r"ingero: warning: shifted is ~\d+ ms ahead of this host \(±", out.stderr), out.stderr


def test_ctrl_c_during_a_fan_out_is_one_line_and_exit_130(pki: Pki) -> None:
    """SIGINT while the query waits on a black-holed node: one line naming Ctrl-C, exit 130, no traceback."""
    import signal
    import socket

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(4)
        hole.settimeout(60)
        proc = subprocess.Popen(
            [sys.executable, "-m", "ingero", "query", "--nodes", f"127.0.0.1:{hole.getsockname()[1]}",
             "--timeout", "60s", *tls_flags(pki), "SELECT 1"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            conn, _ = hole.accept()  # the client has connected: it is inside the fan-out now
            with conn:
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["ingero: interrupted (Ctrl-C)"], err


def thread_lines(text: str) -> dict[tuple[str, int], str]:
    """The GPU-thread lines of an explain text report (local or fleet), unwrapped, by (node, tid): a
    node's lines follow its name."""
    lines: dict[tuple[str, int], str] = {}
    node, last = "", None
    for line in text.splitlines():
        if line and not line.startswith(" ") and ":" not in line:
            node = line.strip()
        if line.startswith("  GPU thread "):
            last = (node, int(line.split()[2]))
            lines[last] = line.strip()
        elif last and line.startswith("    "):  # the line wrapped
            lines[last] += " " + line.strip()
        else:
            last = None
    return lines


def test_explain_nodes_prints_each_nodes_ledger_as_local_explain_does(
    fleet3: list[str], fleet3_dbs: dict[str, Path], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fleet report's wall-time ledger: per node, one line per GPU thread, word for word what
    ``explain --db`` prints for that node's database (the same formatter over the agent's rows)."""
    assert main(["explain", "--nodes", ",".join(fleet3), *tls_flags(pki)]) == 0
    out = capsys.readouterr().out
    head, _, rest = out.partition("WALL-TIME LEDGER — where each GPU thread's time went, on 3 nodes\n")
    assert head.startswith("FLEET DIAGNOSIS") and "root cause: " in head  # after the chains,
    assert rest and rest.index("straggler: ") > 0  # before the verdict
    fleet = thread_lines(rest.split("\nstraggler: ")[0])
    local: dict[tuple[str, int], str] = {}
    for db in fleet3_dbs.values():
        assert main(["explain", "--db", str(db)]) == 0
        local |= thread_lines(capsys.readouterr().out)
    assert [node for node, _ in fleet] == list(fleet3_dbs) and fleet == local
    for line in fleet.values():
        assert re.fullmatch(r"GPU thread 4242 \(pid 4242\): \d+ms = \d+ % GPU calls.* \+ \d+ % preempted.*", line)
    # the JSON rows behind them add up to their wall time
    assert main(["explain", "--nodes", ",".join(fleet3), *tls_flags(pki), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ledger"]
    assert sorted(r["node"] for r in rows) == list(fleet3_dbs)
    assert all(sum(r["buckets"].values()) == r["wall_ns"] > 0 for r in rows)


def test_fleet_ledger_lines_past_the_node_cap_show_the_least_busy_gpus(
    fleet3: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    from ingero.explain.ledger import LedgerRow
    from ingero.fleet.render import ledger_lines

    assert main(["explain", "--nodes", ",".join(fleet3), *tls_flags(pki), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ledger"]
    assert all(LedgerRow.from_dict(r).as_dict() == r for r in rows)  # the agents' rows, read back whole
    share = {r["node"]: (r["buckets"]["gpu_steady"] + r["buckets"]["gpu_slow"]) / r["wall_ns"] for r in rows}
    busiest = max(share, key=share.__getitem__)
    lines = ledger_lines(rows, most_nodes=2)
    assert lines[0] == "WALL-TIME LEDGER — where each GPU thread's time went, on 2 nodes"
    shown = [line for line in lines if line.startswith("gpu-node-")]
    assert shown == sorted(set(share) - {busiest})
    assert lines[-1] == "... 1 more node with busier GPU threads (--json shows the whole ledger)"
    assert ledger_lines([]) == []
