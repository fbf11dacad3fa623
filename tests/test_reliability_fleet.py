"""A hostile fleet on loopback, and the fleet client's memory measured from outside (issue 17.5).

Nodes: dead (port refused), black hole (a listening socket that never accepts or reads: the TLS
handshake never completes), slow (dribbles its answer past the timeout), huge (announces 500 MB),
endless (a chunked stream that never ends), a JSON bomb (valid JSON that would grow ~20x when
parsed), malformed (not JSON), a duplicate (a second agent claiming a good node's identity) and
three good agents. Every one is a real TLS agent (``serve_api``) but the black hole and the dead port.

The client runs in a subprocess, so that its peak resident memory (``VmHWM``) is its own: once
against the good agents only (the baseline: interpreter, imports, TLS) and once against the whole
hostile fleet. The shared answer budget is set to 24 MiB with the default 16 MiB cap per answer;
four nodes that each send more than the cap would be ≥ 64 MiB held at once without a shared
budget (the client before issue 17.5 peaked at 316 MB with two such nodes). The bound asserted on
the difference is the budget (24 MiB) + one answer joined into one bytes object at the end of its
read (≤ 16 MiB) + TLS/h11 buffers of ten connections (≤ 1 MiB each) + 16 MiB allocator slack
= 66 MiB.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SAMPLES
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, closed_port, make_pki, stream

pytestmark = [pytest.mark.reliability, pytest.mark.slow]  # waits out its hostile nodes' timeouts (4 s)

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
BUDGET = 24 * MIB
BOUND = BUDGET + 16 * MIB + 10 * MIB + 16 * MIB
SQL = "SELECT source, count(*) AS n FROM events GROUP BY source"

CLIENT = r"""
import json, sys
from ingero.config import parse_node_list
from ingero.fleet.operations import query_sync
from ingero.fleet.settings import ClientSettings

cfg = json.loads(sys.argv[1])
settings = ClientSettings(
    ca_cert=cfg["ca"], client_cert=cfg["cert"], client_key=cfg["key"], timeout_s=cfg["timeout_s"],
    max_total_bytes=cfg["budget"],
)
result = query_sync(parse_node_list(cfg["nodes"]), settings, cfg["sql"])
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({
    "peak_kib": peak_kib,
    "outcomes": [[o.spec.addr, str(o.kind), o.node, o.reason] for o in result.outcomes],
    "rows": result.rows,
}))
"""


def run_client(pki: Pki, nodes: list[str], timeout_s: float) -> dict[str, object]:
    cfg = {
        "ca": str(pki.ca),
        "cert": str(pki.client_cert),
        "key": str(pki.client_key),
        "timeout_s": timeout_s,
        "budget": BUDGET,
        "nodes": ",".join(nodes),
        "sql": SQL,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, json.dumps(cfg)], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc: dict[str, object] = json.loads(proc.stdout)
    return doc


def zeros(total: int | None) -> Iterator[bytes]:
    """1 MiB chunks of JSON-ish filler, ``total`` bytes in all (None: for ever)."""
    chunk = b"[" + b"0," * (MIB // 2 - 1) + b"0"
    sent = 0
    while total is None or sent < total:
        yield chunk
        sent += len(chunk)


def bomb() -> Iterator[bytes]:
    """A valid /query answer of ~12 MiB whose rows would take ~250 MB as Python objects."""
    rows = b",".join([b"[0]"] * (3 * MIB))
    yield b'{"ok": true, "node": "bomb", "columns": ["n"], "rows": [' + rows + b'], "truncated": false}'


def dribble() -> Iterator[bytes]:
    while True:
        yield b" "


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def hostile_fleet(pki: Pki) -> Iterator[dict[str, str]]:
    samples = SAMPLES
    db = samples / "sample-gpu-node-02.db"
    q = "/api/v1/query"
    specs = {
        "good-1": AgentSpec(samples / "sample-gpu-node-01.db", "good-1"),
        "good-2": AgentSpec(db, "good-2"),
        "good-3": AgentSpec(samples / "sample-gpu-node-03.db", "good-3"),
        "duplicate": AgentSpec(db, "good-2"),
        "huge-1": AgentSpec(db, "huge-1", wrapper=stream(q, lambda: zeros(500 * MIB), length=500 * MIB)),
        "huge-2": AgentSpec(db, "huge-2", wrapper=stream(q, lambda: zeros(500 * MIB), length=500 * MIB)),
        "endless-1": AgentSpec(db, "endless-1", wrapper=stream(q, lambda: zeros(None))),
        "endless-2": AgentSpec(db, "endless-2", wrapper=stream(q, lambda: zeros(None))),
        "bomb": AgentSpec(db, "bomb", wrapper=stream(q, bomb)),
        "slow": AgentSpec(db, "slow", wrapper=stream(q, dribble, pause_s=0.05)),
        "malformed": AgentSpec(db, "malformed", wrapper=stream(q, lambda: iter([b'{"ok": true, "rows": [[1, 2'] * 1))),
    }
    with (
        agents_in_thread(pki, list(specs.values())) as servers,
        socket.socket() as black_hole,
    ):
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(16)  # connections complete in the kernel's backlog; nobody accepts or reads
        addrs = {name: f"127.0.0.1:{s.port}" for name, s in zip(specs, servers, strict=True)}
        addrs["black-hole"] = f"127.0.0.1:{black_hole.getsockname()[1]}"
        addrs["dead"] = f"127.0.0.1:{closed_port()}"
        yield addrs


def test_hostile_fleet_each_node_its_outcome_and_memory_bounded(pki: Pki, hostile_fleet: dict[str, str]) -> None:
    good = [hostile_fleet[n] for n in ("good-1", "good-2", "good-3")]
    baseline = run_client(pki, good, timeout_s=5.0)
    by_addr = {a: kind for a, kind, _, _ in baseline["outcomes"]}  # type: ignore[attr-defined]
    assert sorted(by_addr.values()) == ["ok", "ok", "ok"]

    hostile = run_client(pki, list(hostile_fleet.values()), timeout_s=4.0)
    kinds = {name: None for name in hostile_fleet}
    reasons: dict[str, str] = {}
    names = {addr: name for name, addr in hostile_fleet.items()}
    for addr, kind, _node, reason in hostile["outcomes"]:  # type: ignore[attr-defined]
        kinds[names[addr]] = kind
        reasons[names[addr]] = reason
    assert kinds == {
        "good-1": "ok",
        "good-2": "ok",
        "good-3": "ok",
        "duplicate": "duplicate",
        "huge-1": "too_large",
        "huge-2": "too_large",
        "endless-1": "too_large",
        "endless-2": "too_large",
        "bomb": "too_large",
        "slow": "timeout",
        "malformed": "protocol",
        "black-hole": "timeout",
        "dead": "refused",
    }, reasons
    assert "not counted twice" in reasons["duplicate"]
    assert "budget" in reasons["bomb"]
    # the good nodes' rows are merged, and the duplicate's are not counted a second time
    assert hostile["rows"] == baseline["rows"]
    assert {r[0] for r in hostile["rows"]} == {"good-1", "good-2", "good-3"}  # type: ignore[attr-defined]

    grew = (int(hostile["peak_kib"]) - int(baseline["peak_kib"])) * 1024  # type: ignore[call-overload]
    print(f"peak: baseline {int(baseline['peak_kib']) // 1024} MiB, hostile {int(hostile['peak_kib']) // 1024} MiB")  # type: ignore[call-overload]
    assert grew < BOUND, f"client peak grew by {grew / MIB:.0f} MiB over the good-only run (bound {BOUND / MIB:.0f})"
