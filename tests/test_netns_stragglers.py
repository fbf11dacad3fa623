"""Stragglers across namespaces (root; CI runs these): four ranks of a job on the fake NCCL (a TCP
rendezvous: an all-reduce returns only when every rank has entered it), each rank in its own network
namespace with its own real ``ingero trace --pid`` agent serving mTLS there; gpu-node-03 computes
12 ms longer per step, gpu-node-04's agent runs under libfaketime 200 ms ahead. ``ingero fleet
stragglers`` in a client namespace must name gpu-node-03 with its lag, never the shifted node, and no
node explain may print a HIGH chain for waiting inside the collective. (Equal ranks, two ranks and a
clock uncertainty above the lag are asserted on recorded arrays in test_collectives.py and on traced
ranks in test_bpf_collectives.py.)"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ingero.tls.pki import create_ca, issue_cert, split_sans
from tests.bpf_support import build, build_program
from tests.conftest import ROOT

pytestmark = [pytest.mark.netns, pytest.mark.bpf]

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SUBNET = "10.214.0"
PORT = 8443
NODES = ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]
LATE, SHIFTED = "gpu-node-03", "gpu-node-04"
STEPS, COMPUTE_US, EXTRA_US = 120, 10_000, 12_000
SHIFT_S = 0.2
_ids = itertools.count()


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Job:
    tag: str
    work: Path
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    addrs: list[str] = field(default_factory=list)

    def ns(self, i: int) -> str:
        return f"ins{self.tag}n{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET}.1{i}"

    def build(self) -> None:
        hub = f"ins{self.tag}h"
        sh("ip", "netns", "add", hub)
        self.namespaces.append(hub)
        sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", hub, "link", "set", "br0", "up")
        for i in range(len(NODES) + 1):  # 0: the client
            name, ip = (f"ins{self.tag}c", f"{SUBNET}.1") if i == 0 else (self.ns(i), self.ip(i))
            sh("ip", "netns", "add", name)
            self.namespaces.append(name)
            a, b = f"vs{self.tag}x{i}", f"vs{self.tag}y{i}"
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            sh("ip", "link", "set", a, "netns", hub)
            sh("ip", "link", "set", b, "netns", name)
            sh("ip", "-n", hub, "link", "set", a, "master", "br0", "up")
            sh("ip", "-n", name, "link", "set", b, "name", "eth0")
            sh("ip", "-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
            sh("ip", "-n", name, "link", "set", "eth0", "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")

    def popen(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.procs.append(p)
        return p

    def client(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        argv = ["ip", "netns", "exec", f"ins{self.tag}c", sys.executable, "-m", "ingero", *args]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:  # a tracer detaches its uprobes on the way out: ~0.1 s each
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
            if p.stdout is not None:
                p.stdout.close()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=30)


@dataclass
class Ranks:
    job: Job
    exe: Path
    libdir: Path
    pids: list[int]
    go: Path
    procs: list[subprocess.Popen[str]]

    def run(self) -> None:
        self.go.touch()
        for p in self.procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0 and out.strip() == f"done {STEPS}", out


def start_ranks(job: Job, exe: Path, libdir: Path, name: str, extra: dict[str, int]) -> Ranks:
    """One rank per namespace, each waiting for its go file (so the agents can attach by pid first)."""
    go = job.work / f"go-{name}"
    env = {"FAKE_NCCL_ROOT": f"{job.ip(1)}:29500", "FAKE_NCCL_JOB": name}
    procs = []
    for i, node in enumerate(NODES, 1):
        argv = ["ip", "netns", "exec", job.ns(i), str(exe), str(libdir), str(i - 1), str(len(NODES)), str(STEPS),
                str(COMPUTE_US), str(extra.get(node, 0)), str(go)]  # fmt: skip
        procs.append(job.popen(argv, env))
    return Ranks(job, exe, libdir, [p.pid for p in procs], go, procs)


def job_pid(wrapper_pid: int) -> int:
    """`ip netns exec` execs the program: the wrapper's pid is the program's once it has started."""
    exe = Path(f"/proc/{wrapper_pid}/exe")
    for _ in range(500):
        with contextlib.suppress(OSError):
            if exe.resolve().name == "nccl_job":
                return wrapper_pid
        time.sleep(0.01)
    raise AssertionError("nccl_job did not start")


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[Job, Path, Ranks]]:
    if not FAKETIME_LIB.exists():
        pytest.skip("libfaketime (Debian 'faketime') not installed")
    built = build(tmp_path / "build")
    exe = build_program("nccl_job.c", tmp_path / "build-job")
    pki = tmp_path / "pki"
    create_ca(pki)
    issue_cert(pki, "node", "fleet", split_sans([f"{SUBNET}.1{i}" for i in range(1, len(NODES) + 1)]))
    issue_cert(pki, "client", "laptop")
    job = Job(f"{os.getpid() % 10000}{next(_ids)}", tmp_path)
    try:
        job.build()
        ranks = start_ranks(job, exe, built.dir, "late", {LATE: EXTRA_US})
        agents = []
        for i, node in enumerate(NODES, 1):
            ready = tmp_path / f"{node}.ready.json"
            # nsenter switches the network namespace only: `ip netns exec` would remount /sys, and bcc
            # needs the host's tracefs under it
            argv = ["nsenter", f"--net=/var/run/netns/{job.ns(i)}", sys.executable, "-m", "ingero", "trace",
                    "--db", str(tmp_path / f"{node}.db"), "--node", node, "--quiet", "--no-io", "--no-follow",
                    "--no-system-search", "--nccl-lib", str(built.nccl), "--cuda-lib", str(built.cudart),
                    "--driver-lib", str(built.cuda), "--pid", str(job_pid(ranks.pids[i - 1])),
                    "--listen", f"{job.ip(i)}:{PORT}", "--tls-cert", str(pki / "node-fleet.pem"),
                    "--tls-key", str(pki / "node-fleet-key.pem"), "--client-ca", str(pki / "ca.pem"),
                    "--ready-file", str(ready)]  # fmt: skip
            env = None
            if node == SHIFTED:
                env = {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": f"+{SHIFT_S}", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
            agents.append((job.popen(argv, env), ready, node))
            job.addrs.append(f"{node}={job.ip(i)}:{PORT}")
        for proc, ready, node in agents:
            wait_ready_file(proc, ready, node)
        yield job, pki, ranks
    finally:
        job.cleanup()
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert f"ins{job.tag}" not in leftover


def wait_ready_file(proc: subprocess.Popen[str], ready: Path, node: str, timeout_s: float = 240) -> None:
    """``ingero trace --ready-file`` writes it once the probes are attached and the API listens."""
    deadline = time.monotonic() + timeout_s
    while not (ready.exists() and ready.stat().st_size > 0):
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"agent {node} exited (rc={proc.returncode}): {out[-600:]}")
        assert time.monotonic() < deadline, f"agent {node} not ready within {timeout_s:g}s"
        time.sleep(0.1)


def tls(pki: Path) -> list[str]:
    return ["--ca-cert", str(pki / "ca.pem"), "--client-cert", str(pki / "client-laptop.pem"),
            "--client-key", str(pki / "client-laptop-key.pem")]  # fmt: skip


def test_four_traced_ranks_name_the_late_one(traced: tuple[Job, Path, Ranks]) -> None:
    job, pki, ranks = traced
    ranks.run()
    nodes = ",".join(job.addrs)
    r = job.client("fleet", "stragglers", "--nodes", nodes, *tls(pki), "--json", "--timeout", "20s")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["answered"] == 4, doc["nodes"]
    cv = doc["straggler"]["collectives"]
    assert doc["kind"] == "straggler" and doc["outlier"] == LATE, doc["headline"]
    assert doc["headline"].startswith(f"straggler: {LATE} (rank 2) arrived last at ")
    assert cv["lag_ms"] == pytest.approx(EXTRA_US / 1000, abs=3.0 + cv["uncertainty_ms"])
    assert cv["last_calls"] >= 0.9 * STEPS
    skews = {n["name"]: n["skew"] for n in doc["nodes"]}
    assert abs(skews[SHIFTED]["offset_ms"] - SHIFT_S * 1000) <= skews[SHIFTED]["uncertainty_ms"] + 1.0
    assert SHIFTED not in [o["node"] for o in doc["outliers"]["ranks"]]
    assert [o["node"] for o in doc["outliers"]["ranks"]] == [LATE]

    # no node explain calls waiting inside the collective a HIGH problem
    e = job.client("explain", "--nodes", nodes, *tls(pki), "--json", "--timeout", "60s")
    assert e.returncode == 0, e.stderr
    ex = json.loads(e.stdout)
    assert ex["straggler"]["outlier"] == LATE and ex["straggler"]["source"] == "collectives"
    waiting_high = [
        c for c in ex["chains"] if c.get("severity") == "HIGH" and str(c.get("cuda_op", "")).startswith("nccl")
    ]
    assert waiting_high == [], waiting_high
