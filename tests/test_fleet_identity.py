"""One fleet, every node counted: the agent's name from its recording, a stable instance id, and the
client's de-duplication of the *same instance* only (twins that share a name are kept, made distinct).

End to end with real ``ingero serve`` processes (plaintext on loopback: identity is what is tested
here; TLS is the other fleet tests' subject) and with in-process mTLS agents for merge and export.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.cli.main import main
from ingero.fleet import local_agents
from ingero.identity import hostname_node, resolve_identity
from ingero.store.db import open_readonly, open_writable, recorded_node
from ingero.store.instance import agent_instance, stored_instance_id
from tests.conftest import INVESTIGATIONS, ROOT, SEED_QUERY, write_db
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, make_pki, straggler_events

RECORDINGS = [INVESTIGATIONS / f"sample-gpu-node-0{i}.db" for i in (1, 2, 3)]


# --- the agent's name and instance id --------------------------------------------------------


def test_name_precedence_flag_config_recording_hostname() -> None:
    assert resolve_identity("cli", "cfg", {}, recorded="rec").node == "cli"
    assert resolve_identity(None, "cfg", {}, recorded="rec").source == "config"
    rec = resolve_identity(None, None, {}, recorded="gpu-node-07")
    assert (rec.node, rec.source) == ("gpu-node-07", "recorded")
    host = resolve_identity(None, None, {}, recorded=None)
    assert (host.node, host.source) == (hostname_node(), "hostname")
    # a recorded name that is no valid node name (Ingero allows ':') is not used
    assert resolve_identity(None, None, {}, recorded="a:b").source == "hostname"


def test_recorded_node_is_the_one_node_of_a_recording(samples: Path) -> None:
    for i, path in enumerate(RECORDINGS, start=1):
        conn = open_readonly(path)
        assert recorded_node(conn) == f"gpu-node-0{i}"
        conn.close()
    cluster = open_readonly(samples / "sample-cluster.db")
    assert recorded_node(cluster) is None  # three nodes: no single recorded name
    cluster.close()


def test_instance_id_is_stored_stable_and_per_database(tmp_path: Path) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    for p in (a, b):
        open_writable(p).close()
    ida = stored_instance_id(sqlite3.connect(a))
    assert ida and len(ida) == 32
    open_writable(a).close()  # reopening (migrations, a new session) keeps it
    assert stored_instance_id(sqlite3.connect(a)) == ida
    assert stored_instance_id(sqlite3.connect(b)) not in (None, ida)
    # the agent's id: one database reached by two paths is one instance, two databases are two
    link = tmp_path / "link.db"
    link.symlink_to(a)
    ra, rl, rb = (open_readonly(p) for p in (a, link, b))
    assert agent_instance(ra, a, "n") == agent_instance(rl, link, "n") != agent_instance(rb, b, "n")
    assert agent_instance(ra, a, "n") != agent_instance(ra, a, "m")  # one database served under two names


def test_a_recording_without_an_id_is_named_by_its_file_and_never_written(samples: Path, tmp_path: Path) -> None:
    src = samples / "sample-gpu-node-01.db"
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    conn = open_readonly(src)
    assert stored_instance_id(conn) is None  # an Ingero recording carries none
    first = agent_instance(conn, src, "n")
    assert agent_instance(conn, src, "n") == first
    copy = tmp_path / "copy.db"
    shutil.copy(src, copy)
    assert agent_instance(open_readonly(copy), copy, "n") != first  # a copy is another database
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before


# --- end to end: real `ingero serve` agents --------------------------------------------------


def _serve(db: Path, ready: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ingero", "serve", "--db", str(db), "--no-tls", "--listen", "127.0.0.1:0",
         "--ready-file", str(ready), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


# Six real agent processes (3 s of CPU, the fast suite's largest fixture): run by make test, not test-fast,
# which keeps the identity units above and the in-process twin fleet below.
REAL_AGENTS = pytest.mark.slow


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, dict[str, object]]]]:
    """Real agents: the three recordings served without --node, and three copies of one recording
    (three databases that recorded the same node: cloned VMs)."""
    d = tmp_path_factory.mktemp("identity")
    dbs = {f"rec{i}": p for i, p in enumerate(RECORDINGS, start=1)}
    for i in (1, 2, 3):
        dbs[f"clone{i}"] = d / f"clone{i}.db"
        shutil.copy(RECORDINGS[1], dbs[f"clone{i}"])
    procs: list[subprocess.Popen[str]] = []
    out: dict[str, tuple[str, dict[str, object]]] = {}
    try:
        for name, db in dbs.items():
            procs.append(_serve(db, d / f"{name}.json"))
        for (name, _db), proc in zip(dbs.items(), procs, strict=True):
            _, doc = local_agents.wait_ready(proc, d / f"{name}.json", name)
            out[name] = (f"127.0.0.1:{doc['port']}", doc)
        yield out
    finally:
        local_agents.stop(procs)


def _query(addrs: list[str], capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict, str]:  # type: ignore[type-arg]
    code = main(["query", "--nodes", ",".join(addrs), "--plaintext", "--json", *extra, SEED_QUERY])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


@REAL_AGENTS
def test_agents_serving_recordings_answer_as_the_recorded_nodes(
    agents: dict[str, tuple[str, dict[str, object]]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert [agents[f"rec{i}"][1]["node"] for i in (1, 2, 3)] == ["gpu-node-01", "gpu-node-02", "gpu-node-03"]
    code, doc, err = _query([agents[f"rec{i}"][0] for i in (1, 2, 3)], capsys)
    assert code == 0, err
    assert doc["answered"] == 3 and doc["failed"] == 0
    assert {r[0] for r in doc["rows"]} == {"gpu-node-01", "gpu-node-02", "gpu-node-03"}
    assert "did not answer" not in err and "shared name" not in err


@REAL_AGENTS
def test_twins_are_all_kept_made_distinct_and_flagged_once(
    agents: dict[str, tuple[str, dict[str, object]]], capsys: pytest.CaptureFixture[str]
) -> None:
    addrs = [agents[f"clone{i}"][0] for i in (1, 2, 3)]
    one, _, _ = _query(addrs[:1], capsys)
    _, single, _ = _query(addrs[:1], capsys)
    code, doc, err = _query(addrs, capsys)
    assert one == 0 and code == 0, err
    assert doc["answered"] == 3
    assert len(doc["rows"]) == 3 * len(single["rows"])  # no row lost
    labels = {r[0] for r in doc["rows"]}
    assert labels == {f"gpu-node-02@{a}" for a in addrs}
    nodes = doc["nodes"]
    assert all(n["twin"] and n["agent_node"] == "gpu-node-02" for n in nodes)
    assert len({n["instance"] for n in nodes}) == 3
    warnings = [line for line in err.splitlines() if "shared name" in line]
    assert len(warnings) == 1 and "3 distinct agents" in warnings[0] and "--node" in warnings[0]


@REAL_AGENTS
def test_the_same_agent_listed_twice_or_at_two_addresses_is_counted_once(
    agents: dict[str, tuple[str, dict[str, object]]], capsys: pytest.CaptureFixture[str]
) -> None:
    addr, _ = agents["rec1"]
    port = addr.rsplit(":", 1)[1]
    _, single, _ = _query([addr], capsys)
    for listing in ([addr, addr], [addr, f"localhost:{port}"]):
        code, doc, err = _query([*listing, agents["rec2"][0]], capsys)
        assert code == 0, err  # partial success: the duplicate is reported, not an error
        kinds = [n["outcome"] for n in doc["nodes"]]
        assert kinds == ["ok", "duplicate", "ok"], kinds
        rows01 = [r for r in doc["rows"] if r[0] == "gpu-node-01"]
        assert len(rows01) == len(single["rows"])
        assert "not counted twice" in err
        strict = main(["query", "--nodes", ",".join([*listing]), "--plaintext", "--strict", SEED_QUERY])
        capsys.readouterr()
        assert strict == 5  # --strict: any node not answering (a duplicate included) exits 5


# --- explain, stragglers and export of twins (in-process mTLS agents) ------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def twin_fleet(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Three agents named 'vm' (cloned VMs), one of them the straggler (in the middle of the list)."""
    d = tmp_path_factory.mktemp("twins")
    dbs = [
        write_db(d / "a.db", straggler_events(200, 2.0, 2), node="vm"),
        write_db(d / "b.db", straggler_events(850, 18.4, 1, tail=True), node="vm"),
        write_db(d / "c.db", straggler_events(210, 2.1, 3), node="vm"),
    ]
    with agents_in_thread(pki, [AgentSpec(db, "vm") for db in dbs]) as servers:
        yield [f"{s.host}:{s.port}" for s in servers]


def _tls(pki: Pki) -> list[str]:
    return ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]


def test_explain_names_the_twin_straggler_by_its_address(
    twin_fleet: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["explain", "--nodes", ",".join(twin_fleet), *_tls(pki), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["straggler"]["outlier"] == f"vm@{twin_fleet[1]}"
    assert {c["node"] for c in doc["chains"]} <= {f"vm@{a}" for a in twin_fleet}
    assert any(c["node"] == f"vm@{twin_fleet[1]}" for c in doc["chains"])
    assert sum("shared name" in line for line in err.splitlines()) == 1


def test_export_of_twins_keeps_one_track_per_instance(
    twin_fleet: list[str], pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "fleet.json"
    code = main(["export", "--nodes", ",".join(twin_fleet), *_tls(pki), "-o", str(out_file)])
    _, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out_file.read_text())
    names = {
        e["args"]["name"]
        for e in doc["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name" and "vm@" in str(e.get("args", {}).get("name"))
    }
    assert {next(a for a in twin_fleet if a in n) for n in names} == set(twin_fleet)


# --- offline merge of twins ------------------------------------------------------------------


def test_merge_keeps_twin_recordings_apart_and_still_refuses_a_copy(tmp_path: Path) -> None:
    from ingero.errors import StoreError
    from ingero.store.merge import merge_databases

    a = write_db(tmp_path / "a.db", straggler_events(200, 2.0, 2), node="vm")
    b = write_db(tmp_path / "b.db", straggler_events(210, 2.1, 3), node="vm")
    counts = [sqlite3.connect(p).execute("SELECT count(*) FROM events").fetchone()[0] for p in (a, b)]
    report = merge_databases([a, b], tmp_path / "m.db")
    conn = sqlite3.connect(tmp_path / "m.db")
    by_node = dict(conn.execute("SELECT node, count(*) FROM events GROUP BY node").fetchall())
    assert by_node == {"vm": counts[0], "vm@b": counts[1]}  # no row lost, each under its own name
    assert conn.execute("SELECT count(*) FROM events WHERE id NOT LIKE node || ':%'").fetchone()[0] == 0
    assert {r[0] for r in conn.execute("SELECT node FROM sessions")} == {"vm", "vm@b"}
    assert [i["path"] for i in report.as_dict()["inputs"]] == [str(a), str(b)]  # the user's files, not copies
    assert sum("kept as node 'vm@b'" in w for w in report.warnings) == 1
    assert not list(tmp_path.glob(".m.db.twins-*"))  # the renamed copy is gone
    # the same database twice is a copy, not a twin: refused as before (or --dedupe keeps one copy)
    with pytest.raises(StoreError, match="duplicate its events"):
        merge_databases([a, a], tmp_path / "m2.db")
    assert merge_databases([a, a], tmp_path / "m3.db", dedupe=True).events == counts[0]
