"""ingero export --nodes: traces fetched from real agents on 127.0.0.1 (mTLS), clocks aligned by offset."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ingero.cli.main import main
from ingero.store.writer import EventRow
from tests.conftest import write_db
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, make_pki, shift_clock
from tests.test_export import check_trace_invariants, slices

T0 = 1_775_218_800_000_000_000
MS = 1_000_000
SKEW_NS = 250 * MS  # gpu-node-02's clock runs 250 ms ahead


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _events(shift: int, pid: int) -> list[EventRow]:
    """The same job on every node: a cuLaunchKernel every 2 ms and an off-CPU period; ``shift`` is the
    node's clock error at recording time."""
    rows: list[EventRow] = []
    for i in range(50):
        t = T0 + shift + i * 2 * MS
        rows.append((t, pid, pid, 4, 1, 300_000, 0, 0xF00, 0, 0, 0, 0))
        rows.append((t + 900_000, pid, pid, 3, 1, 200_000, 0, 0, 0, 0, 0, 0))
    return rows


def test_fleet_export_aligns_clocks(tmp_path: Path, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    dbs = [
        write_db(tmp_path / "a.db", _events(0, 100), node="gpu-node-01", rank=0, world_size=3),
        write_db(tmp_path / "b.db", _events(SKEW_NS, 200), node="gpu-node-02", rank=1, world_size=3),
        write_db(tmp_path / "c.db", _events(0, 300), node="gpu-node-03", rank=2, world_size=3),
    ]
    specs = [
        AgentSpec(dbs[0], "gpu-node-01", rank=0, world_size=3),
        AgentSpec(dbs[1], "gpu-node-02", rank=1, world_size=3, wrapper=shift_clock(SKEW_NS)),
        AgentSpec(dbs[2], "gpu-node-03", rank=2, world_size=3),
    ]
    out = tmp_path / "fleet.json"
    with agents_in_thread(pki, specs) as servers:
        nodes = ",".join(f"127.0.0.1:{s.port}" for s in servers)
        tls = ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]
        empty = tmp_path / "empty.yaml"
        empty.write_text("")
        code = main(["export", "--config", str(empty), "--nodes", nodes, *tls, "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert re.search(r"gpu-node-02 is ~2\d\d ms ahead of this host .*corrected in the export", err), err
    doc = json.loads(out.read_text())
    check_trace_invariants(doc)
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert procs == {1: "gpu-node-01 (rank 0)", 2: "gpu-node-02 (rank 1)", 3: "gpu-node-03 (rank 2)"}
    meta = doc["metadata"]
    assert meta["source"] == "fleet" and "clock offset" in meta["clock_correction"]
    offsets = {n["node"]: n for n in meta["nodes"]}
    b = offsets["gpu-node-02"]
    assert abs(b["clock_offset_ns"] - SKEW_NS) <= b["clock_offset_uncertainty_ns"] + MS
    # after correction the three nodes' launches line up (within the offset's uncertainty)
    first = {pid: min(e["ts"] for e in slices(doc, pid=pid, name="cuLaunchKernel")) for pid in (1, 2, 3)}
    # (each node's offset is only known within its own ± uncertainty: two nodes differ by at most the sum)
    unc = {pid: offsets[f"gpu-node-0{pid}"]["clock_offset_uncertainty_ns"] for pid in (1, 2, 3)}
    assert abs(first[2] - first[1]) * 1000 <= unc[1] + unc[2] + MS
    assert abs(first[3] - first[1]) * 1000 <= unc[1] + unc[3] + MS
    for pid in (1, 2, 3):
        assert len(slices(doc, pid=pid, name="cuLaunchKernel")) == 50
        assert len(slices(doc, pid=pid, name="off-CPU")) == 50


def test_fleet_export_pages_and_survives_a_dead_node(
    tmp_path: Path, pki: Pki, samples: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ingero.export import fleet_source

    monkeypatch.setattr(fleet_source, "PAGE_ROWS", 37)  # many pages per node, ties on timestamps included
    specs = [
        AgentSpec(samples / "sample-gpu-node-02.db", "gpu-node-02"),
        AgentSpec(samples / "sample-gpu-node-03.db", "gpu-node-03"),
    ]
    out = tmp_path / "t.json"
    with agents_in_thread(pki, specs) as servers:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        nodes = ",".join([*(f"127.0.0.1:{s.port}" for s in servers), f"127.0.0.1:{dead}"])
        tls = ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]
        empty = tmp_path / "empty.yaml"
        empty.write_text("")
        code = main(["export", "--config", str(empty), "--nodes", nodes, *tls, "-o", str(out), "--timeout", "10s"])
        err = capsys.readouterr().err
        assert code == 0, err
        assert f"127.0.0.1:{dead}" in err  # the dead node is named
        strict = main(["export", "--config", str(empty), "--nodes", nodes, *tls, "-o", str(out), "--strict"])
        assert strict == 4
    doc = json.loads(out.read_text())
    check_trace_invariants(doc)
    events = [e for e in doc["traceEvents"] if e["ph"] in ("X", "i") and e["cat"] != "causal_chain"]
    assert len(events) == 400  # every event of both nodes, through 11 pages each
    assert len(slices(doc, cat="causal_chain")) == 2
    assert len(doc["metadata"]["unreachable"]) == 1
