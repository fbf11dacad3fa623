"""A fleet in network namespaces (root; CI runs these): four ``ingero serve`` agents, each in its own
namespace, on a bridge in a hub namespace, asked by ``ingero`` in a client namespace. Nothing is
added to the host's own namespace. This kernel has no netem: the slow link is a TBF rate limit, the
hung node is SIGSTOPped, the black-holed one has a DROP rule, the clock-shifted one runs under
libfaketime (+50 ms), the dead one is killed. Namespaces and processes are removed even when a test
fails (the fixture records each as it is made)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ingero.fleet import local_agents
from ingero.tls.pki import create_ca, issue_cert, split_sans
from tests.conftest import ROOT, SEED_QUERY

pytestmark = pytest.mark.netns

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SUBNET = "10.213.0"
PORT = 8443
NODES = ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]
_ids = itertools.count()


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Agent:
    node: str
    ns: str
    ip: str
    proc: subprocess.Popen[str]
    ready: Path

    @property
    def addr(self) -> str:
        return f"{self.ip}:{PORT}"


@dataclass
class NetFleet:
    tag: str
    work: Path
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    agents: dict[str, Agent] = field(default_factory=dict)

    @property
    def hub(self) -> str:
        return f"ing{self.tag}h"

    @property
    def client(self) -> str:
        return f"ing{self.tag}c"

    def add_ns(self, name: str, ip: str, index: int) -> None:
        """A namespace with eth0 = ip/24, wired to the hub's bridge through a veth pair."""
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        a, b = f"vi{self.tag}x{index}", f"vi{self.tag}y{index}"
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        sh("ip", "link", "set", a, "netns", self.hub)
        sh("ip", "link", "set", b, "netns", name)
        sh("ip", "-n", self.hub, "link", "set", a, "master", "br0", "up")
        sh("ip", "-n", name, "link", "set", b, "name", "eth0")
        sh("ip", "-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", name, "link", "set", "eth0", "up")
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        sh("ip", "netns", "add", self.hub)
        self.namespaces.append(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        self.add_ns(self.client, f"{SUBNET}.1", 0)
        for i, _node in enumerate(NODES, 1):
            self.add_ns(f"ing{self.tag}n{i}", f"{SUBNET}.1{i}", i)

    def start_agent(self, i: int, db: Path, pki: Path, env: dict[str, str] | None = None) -> Agent:
        node, ns, ip = NODES[i - 1], f"ing{self.tag}n{i}", f"{SUBNET}.1{i}"
        ready = self.work / f"{node}.ready.json"
        argv = [
            "ip", "netns", "exec", ns, sys.executable, "-m", "ingero", "serve", "--db", str(db), "--node", node,
            "--listen", f"{ip}:{PORT}", "--tls-cert", str(pki / "node-fleet.pem"),
            "--tls-key", str(pki / "node-fleet-key.pem"), "--client-ca", str(pki / "ca.pem"),
            "--ready-file", str(ready),
        ]  # fmt: skip
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.procs.append(proc)
        agent = Agent(node, ns, ip, proc, ready)
        self.agents[node] = agent
        return agent

    def client_run(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        argv = ["ip", "netns", "exec", self.client, sys.executable, "-m", "ingero", *args]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a SIGSTOPped agent must be able to die
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("netns-pki")
    create_ca(d)
    ips = [f"{SUBNET}.1{i}" for i in range(1, len(NODES) + 1)]
    issue_cert(d, "node", "fleet", split_sans(ips))
    issue_cert(d, "client", "laptop")
    return d


@pytest.fixture
def netfleet(tmp_path: Path, pki: Path, samples: Path) -> Iterator[NetFleet]:
    """Four agents in four namespaces: 01 healthy, 02 behind a slow (TBF) link, 03 at +50 ms, 04 up."""
    nf = NetFleet(f"{os.getpid() % 10000}{next(_ids)}", tmp_path)
    try:
        nf.build()
        sh("ip", "netns", "exec", f"ing{nf.tag}n2", "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
           "rate", "256kbit", "burst", "4kb", "latency", "500ms")  # fmt: skip
        faketime = {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": "+0.05", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        dbs = [samples / f"sample-gpu-node-0{i}.db" for i in (1, 2, 3, 3)]
        agents = [nf.start_agent(i, db, pki, faketime if i == 3 else None) for i, db in enumerate(dbs, 1)]
        for agent in agents:
            local_agents.wait_ready(agent.proc, agent.ready, agent.node)
        yield nf
    finally:
        nf.cleanup()
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert f"ing{nf.tag}" not in leftover


def tls(pki: Path) -> list[str]:
    return ["--ca-cert", str(pki / "ca.pem"), "--client-cert", str(pki / "client-laptop.pem"),
            "--client-key", str(pki / "client-laptop-key.pem")]  # fmt: skip


def named_nodes(nf: NetFleet) -> str:
    return ",".join(f"{a.node}={a.addr}" for a in nf.agents.values())


@pytest.mark.skipif(not FAKETIME_LIB.exists(), reason="libfaketime (Debian 'faketime') not installed")
def test_fleet_across_namespaces(netfleet: NetFleet, pki: Path) -> None:
    nf = netfleet
    dead = nf.agents["gpu-node-04"]
    dead.proc.kill()
    dead.proc.wait(timeout=10)

    q = nf.client_run("query", "--nodes", named_nodes(nf), *tls(pki), "--json", "--timeout", "5s", SEED_QUERY)
    assert q.returncode == 0, q.stderr
    doc = json.loads(q.stdout)
    assert {r[0] for r in doc["rows"]} == {"gpu-node-01", "gpu-node-02", "gpu-node-03"}
    assert doc["answered"] == 3 and doc["failed"] == 1
    gone = next(n for n in doc["nodes"] if not n["answered"])
    assert gone["name"] == "gpu-node-04" and gone["outcome"] == "refused"
    assert f"gpu-node-04 ({dead.addr}): refused — connection refused" in q.stderr
    assert re.search(r"ingero: warning: gpu-node-03 is ~\d+ ms ahead of this host \(±[\d.]+ ms\)", q.stderr)
    assert "gpu-node-01 is" not in q.stderr and "gpu-node-02 is" not in q.stderr

    st = nf.client_run("fleet", "status", "--nodes", named_nodes(nf), *tls(pki), "--json")
    assert st.returncode == 0, st.stderr
    nodes = {n["name"]: n for n in json.loads(st.stdout)["nodes"]}
    shifted = nodes["gpu-node-03"]["skew"]
    assert abs(shifted["offset_ms"] - 50.0) <= shifted["uncertainty_ms"] + 0.001, shifted
    for healthy in ("gpu-node-01", "gpu-node-02"):
        s = nodes[healthy]["skew"]
        assert abs(s["offset_ms"]) <= s["uncertainty_ms"] + 0.001, (healthy, s)
    assert nodes["gpu-node-04"]["outcome"] == "refused"


def test_hung_and_black_holed_nodes_time_out(netfleet: NetFleet, pki: Path) -> None:
    nf = netfleet
    hung = nf.agents["gpu-node-01"]
    os.kill(hung.proc.pid, signal.SIGSTOP)  # `ip netns exec` execs: this is the agent itself
    holed = nf.agents["gpu-node-04"]
    sh("ip", "netns", "exec", holed.ns, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(PORT), "-j", "DROP")
    q = nf.client_run("query", "--nodes", named_nodes(nf), *tls(pki), "--json", "--timeout", "2s", SEED_QUERY)
    assert q.returncode == 0, q.stderr
    doc = json.loads(q.stdout)
    outcome = {n["name"]: n["outcome"] for n in doc["nodes"]}
    assert outcome == {"gpu-node-01": "timeout", "gpu-node-02": "ok", "gpu-node-03": "ok", "gpu-node-04": "timeout"}
    assert {r[0] for r in doc["rows"]} == {"gpu-node-02", "gpu-node-03"}
    strict = nf.client_run("query", "--nodes", named_nodes(nf), *tls(pki), "--timeout", "1s", "--strict", "SELECT 1")
    assert strict.returncode == 5
    assert "gpu-node-01" in strict.stderr and "timeout" in strict.stderr
