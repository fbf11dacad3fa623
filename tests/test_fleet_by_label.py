"""``explain --by`` / ``--annotation`` / ``--annotations`` with ``--nodes``: real agents (mTLS on loopback)
over three recordings whose steps are labelled; one node's step 12 waits on its forked workers. Each
node's answer must equal the same explain run on that node's database alone; a down node and an agent
older than the parameters are each one line, never a crash."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ingero.agent.api import endpoints
from ingero.cli.main import main
from ingero.explain.by_label import by_label
from ingero.store.db import open_readonly
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, closed_port, make_pki
from tests.test_explain_by_label import labelled_run
from tests.test_explain_ledger import ingero_layout, workers

NODES = ("gpu-a", "gpu-b", "gpu-c")
SLOW_STEP = 12
# the slow node first / last in node order, its recording as ingero writes it or as Ingero does (no
# prev_state on sched_switch, wakeups as the waker's events)
SLOW = [("gpu-a", "recorded"), ("gpu-c", "ingero")]
Fleet = tuple[dict[str, Path], list[str], Pki, str]
OLD_CHAINS_PARAMS = (*endpoints.WINDOW_PARAMS, "per_process")  # what /chains took before these flags


@pytest.fixture(scope="module", params=SLOW, ids=[f"{n}-{layout}" for n, layout in SLOW])
def fleet(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """The three nodes' databases, the CLI flags that reach their agents, their PKI and the slow node."""
    slow_node, layout = request.param
    tmp = tmp_path_factory.mktemp("fleet")
    pki = make_pki(tmp / "pki")
    dbs: dict[str, Path] = {}
    for i, node in enumerate(NODES):
        dbs[node] = tmp / f"{node}.db"
        slow = node == slow_node
        labelled_run(dbs[node], 40 + i, workers if slow else None, 0.03 if slow else 0.0, node=node, bad=SLOW_STEP)
        if slow and layout == "ingero":
            dbs[node] = ingero_layout(dbs[node], tmp / f"{node}-ingero.db", wakeups=True)
    with agents_in_thread(pki, [AgentSpec(dbs[n], n) for n in NODES]) as servers:
        yield dbs, [",".join(f"{s.host}:{s.port}" for s in servers), *_tls(pki)], pki, slow_node


def _tls(pki: Pki) -> list[str]:
    return ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _local(db: Path) -> dict[str, Any]:
    conn = open_readonly(db)
    try:
        return by_label(conn, "step").as_dict()
    finally:
        conn.close()


def test_by_step_names_the_slow_nodes_step_with_its_cause(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    dbs, (nodes, *tls), _pki, slow = fleet
    rc, out, _ = _run(capsys, ["explain", "--nodes", nodes, *tls, "--by", "step", "--json"])
    assert rc == 0
    doc = json.loads(out)
    assert doc["answered"] == 3 and doc["key"] == "step"
    rows = doc["values"]
    assert next(iter(rows[0])) == "node" and len(rows) == 3 * 20
    for node, db in dbs.items():  # each node's part is what its database alone says
        local = _local(db)
        assert [{k: v for k, v in r.items() if k != "node"} for r in rows if r["node"] == node] == local["values"]
        assert doc["by_node"][node]["median_ns"] == local["median_ns"]
    named = [(r["node"], r["value"], r["cause"]) for r in rows if r["cause"]]
    assert named == [(slow, str(SLOW_STEP), "asleep_workers")]

    rc, out, _ = _run(capsys, ["explain", "--nodes", nodes, *tls, "--by", "step"])
    assert rc == 0
    assert f"slowest: step {SLOW_STEP} on {slow}," in out.splitlines()[0]
    line = next(x for x in out.splitlines() if x.split()[:3] == [slow, "step", f"{SLOW_STEP}:"])
    assert "asleep on forked workers (input starvation)" in line
    assert sum(1 for x in out.splitlines() if " lost: " in x) == 1
    assert all(sum(1 for x in out.splitlines() if x.split()[:1] == [n]) == 21 for n in NODES)  # median + 20 steps

    rc, out, _ = _run(capsys, ["explain", "--nodes", nodes, *tls, "--by", "step", "--node", "gpu-c", "--json"])
    assert rc == 0 and {r["node"] for r in json.loads(out)["values"]} == {"gpu-c"}


def test_annotation_explains_each_nodes_span(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    dbs, (nodes, *tls), _pki, slow = fleet
    sel = f"step={SLOW_STEP}"
    rc, out, _ = _run(capsys, ["explain", "--nodes", nodes, *tls, "--annotation", sel, "--json"])
    assert rc == 0
    doc = json.loads(out)
    assert set(doc["label"]) == set(NODES)
    for node, db in dbs.items():
        _, local_out, _ = _run(capsys, ["explain", "--db", str(db), "--annotation", sel, "--json"])
        local = json.loads(local_out)
        assert doc["label"][node]["value"] == local["label"]
        window = next(n["window"] for n in doc["nodes"] if n["node"] == node)
        assert window == local["window"]  # the span, not the recording
        mine = sorted((c["family"], c["severity"]) for c in doc["chains"] if c["node"] == node)
        assert mine == sorted((c["family"], c["severity"]) for c in local["chains"])
        assert [r for r in doc["ledger"] if r["node"] == node] == local["ledger"]
    assert doc["label"][slow]["value"]["cause"] == "asleep_workers"
    assert all(doc["label"][n]["value"]["cause"] is None for n in NODES if n != slow)

    rc, out, _ = _run(capsys, ["explain", "--nodes", nodes, *tls, "--annotation", sel])
    assert rc == 0
    head = out.splitlines()[:3]
    assert [x.split()[0] for x in head] == list(NODES)
    for node, line in zip(NODES, head, strict=True):
        assert ("asleep on forked workers" in line) is (node == slow) and (" lost: " in line) is (node == slow)
    assert "FLEET DIAGNOSIS" in out
    rc, _, err = _run(capsys, ["explain", "--nodes", nodes, *tls, "--annotation", "step=25"])
    assert rc == 2 and err.count("\n") == 1 and "no span of step=25 on any of the 3 node(s)" in err
    rc, out, _ = _run(capsys, ["explain", "--nodes", nodes, *tls, "--annotation", sel, "--node", slow, "--json"])
    assert rc == 0 and set(json.loads(out)["label"]) == {slow}


def test_annotations_summarise_each_node(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    dbs, (nodes, *tls), _pki, _slow = fleet
    rc, out, _ = _run(capsys, ["explain", "--nodes", nodes, *tls, "--annotations", "--json"])
    assert rc == 0
    doc = json.loads(out)
    for node, db in dbs.items():
        _, local_out, _ = _run(capsys, ["explain", "--db", str(db), "--annotations", "--json"])
        assert doc["labels"][node] == json.loads(local_out)["labels"]
        assert doc["labels"][node]["keys"]["step"]["distinct"] == 20
    rc, out, _ = _run(capsys, ["explain", "--nodes", nodes, *tls, "--annotations"])
    assert rc == 0 and all(f"{n}: labels (ingero annotate, 20 annotation(s), 20 span(s)" in out for n in NODES)


def test_a_down_node_and_an_older_agent_are_one_line_each(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real agent whose /chains takes only the parameters it took before (what an older ingero
    answers: 400, unknown parameter) and a port nobody listens on, beside the three nodes."""
    dbs, (nodes, *tls), pki, _slow = fleet
    with monkeypatch.context() as m:
        m.setattr(endpoints, "CHAINS_PARAMS", OLD_CHAINS_PARAMS)
        old = agents_in_thread(pki, [AgentSpec(dbs["gpu-a"], "gpu-old")])
        servers = old.__enter__()
    try:
        more = f"{nodes},{servers[0].host}:{servers[0].port},127.0.0.1:{closed_port()}"
        for flag in (["--by", "step"], ["--annotation", f"step={SLOW_STEP}"], ["--annotations"]):
            rc, out, err = _run(capsys, ["explain", "--nodes", more, *tls, *flag])
            assert rc == 0, err
            assert "Traceback" not in err and all(n in out for n in NODES)
            lines = [x for x in err.splitlines() if "gpu-old" in x]
            assert len(lines) == 1 and "an older ingero" in lines[0] and f"explain {flag[0]}" in lines[0], err
            assert "2 of 5 node(s) did not answer" in err
        rc, _, err = _run(capsys, ["explain", "--nodes", more, *tls, "--by", "step", "--strict"])
        assert rc == 5
    finally:
        old.__exit__(None, None, None)


def test_a_bad_selector_is_refused_before_anything_is_sent(capsys: pytest.CaptureFixture[str]) -> None:
    port = closed_port()
    rc = main(["explain", "--nodes", f"127.0.0.1:{port}", "--annotation", "step"])
    assert rc == 2 and "expected KEY=VALUE" in capsys.readouterr().err
