"""Tracer breadth with real uprobes and tracepoints: the CUDA calls beyond the core set, kernel launch
dimensions, CUDA Graphs (Ingero's source 8), allocation pointers (leak tracking) and socket I/O.

One recording (module fixture) of ``bpf_fixtures/breadth.c`` against the test-built fake libcudart /
libcuda — known counts and arguments — plus the real ``libcudart.so.12`` of the nvidia-cuda-runtime-cu12
wheel called through ctypes (no GPU: each call returns an error code, which must be recorded).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from ingero.agent.trace.tracer import TraceReady
from ingero.explain.engine import explain
from ingero.identity import Identity
from ingero.store import catalog
from ingero.store.allocations import live_bytes
from tests.bpf_support import FIXTURES, REAL_CUDART, Built, build, build_program, record, trace_options

pytestmark = pytest.mark.bpf

REAL_CALLS = 37
LEAK_CALLS = 240
NET_ROUNDS = 25
UNTRACED_SOCKETS = """
import os, socket
a, b = socket.socketpair()
for _ in range(50):
    a.send(b"x" * 100)  # sendto(2) / recvfrom(2), as the traced workload's
    b.recv(100)
print(os.getpid())
"""


@dataclass
class Rec:
    db: Path
    pids: dict[str, int]
    out: dict[str, str]
    real: dict[str, tuple[int, int]]

    def all(self, sql: str, *params: Any) -> list[Any]:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True) as c:
            return c.execute(sql, params).fetchall()

    def ops(self, pid: int, name: str) -> list[tuple[int, int, int, int]]:
        """(arg0, arg1, ret_code, duration) of one op's events of one process."""
        ref = catalog.lookup_op(name)
        return self.all(
            "SELECT arg0, arg1, ret_code, duration FROM events WHERE pid = ? AND source = ? AND op = ? ORDER BY timestamp",
            pid,
            ref.source,
            ref.op,
        )


def _phases(exe: Path, built: Built, ready: TraceReady) -> tuple[dict[str, int], dict[str, str], dict[str, Any]]:
    pids: dict[str, int] = {}
    outs: dict[str, str] = {}
    phases = (
        ("calls", 0),
        ("leak", LEAK_CALLS),
        ("healthy", LEAK_CALLS),
        ("asyncleak", LEAK_CALLS),
        ("net", NET_ROUNDS),
    )
    for mode, n in phases:
        p = subprocess.Popen(
            [str(exe), mode, str(built.dir), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        first = ""
        if mode == "net":  # enrolled by its cudaMalloc; its socket calls are probed from the agent's next sync
            assert p.stdout is not None
            first = p.stdout.readline()
            trio.from_thread.run(ready.control.rescan)
        stdout, _ = p.communicate("go\n", timeout=120)
        assert p.returncode == 0, stdout
        pids[mode], outs[mode] = p.pid, first + stdout
    # socket traffic of a process that never calls the GPU: not traced, must not be recorded
    untraced = subprocess.run([sys.executable, "-c", UNTRACED_SOCKETS], capture_output=True, text=True, timeout=60)
    assert untraced.returncode == 0, untraced.stderr
    pids["untraced"] = int(untraced.stdout)
    p = subprocess.Popen(
        [sys.executable, str(FIXTURES / "cudart_breadth_ctypes.py"), str(REAL_CUDART), str(REAL_CALLS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    stdout, _ = p.communicate(timeout=120)
    assert p.returncode == 0, stdout
    pids["real"] = p.pid
    real = {line.split()[0]: (int(line.split()[1]), int(line.split()[2])) for line in stdout.splitlines()}
    return pids, outs, real


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rec]:
    if REAL_CUDART is None:
        pytest.fail("nvidia-cuda-runtime-cu12 is not installed in the venv (it is a dev dependency)")
    built = build(tmp_path_factory.mktemp("bpf-build"))
    exe = build_program("breadth.c", tmp_path_factory.mktemp("breadth-build"))
    work = tmp_path_factory.mktemp("breadth-trace")
    overrides = built.overrides()
    overrides["cudart"].append(str(REAL_CUDART))
    opts = trace_options(
        work / "trace.db",
        Identity("breadth-node"),
        overrides,
    )
    _, (pids, outs, real) = record(opts, lambda ready: _phases(exe, built, ready))
    yield Rec(opts.db_path, pids, outs, real)


def test_more_cuda_calls_counts_and_arguments(rec: Rec) -> None:
    pid = rec.pids["calls"]
    expect = {  # op -> (calls, arg0, arg1) as breadth.c makes them
        "cudaMemcpy2D": (11, 6000, 1),
        "cudaMemcpy2DAsync": (12, 700, 2),
        "cudaMemcpyPeer": (13, 4096, 3 << 16 | 1),
        "cudaMemcpyPeerAsync": (14, 8192, 0 << 16 | 2),
        "cudaHostAlloc": (20, 65536, 2),
        "cudaMallocHost": (21, 32768, 0),
    }
    for name, (n, a0, a1) in expect.items():
        rows = rec.ops(pid, name)
        assert len(rows) == n, name
        assert {(r[0], r[1], r[2]) for r in rows} == {(a0, a1, 0)}, name
    # cudaMemset covers the 1-D (15 x 1111 bytes) and 2-D (17 x 30 x 10) forms
    assert sorted({r[0] for r in rec.ops(pid, "cudaMemset")}) == [300, 1111]
    assert len(rec.ops(pid, "cudaMemset")) == 15 + 17
    assert [r[0] for r in rec.ops(pid, "cudaMemsetAsync")] == [2222] * 16
    sync = rec.ops(pid, "cudaEventSynchronize")
    assert len(sync) == 18 and all(r[0] == 2000 and r[3] >= 2_000_000 for r in sync)  # the 2 ms sleep
    query = rec.ops(pid, "cudaEventQuery")
    notready = int(rec.out["calls"].split("notready ")[1].split()[0])
    assert len(query) == 19 and sum(r[2] == 600 for r in query) == notready == 9


def test_launch_grid_and_block_dimensions(rec: Rec) -> None:
    pid = rec.pids["calls"]
    for name, grid, block in (("cudaLaunchKernel", 6, (128, 2, 1)), ("cuLaunchKernel", 5, (32, 4, 2))):
        rows = rec.ops(pid, name)
        assert len(rows) in range(1, 24), name
        assert {catalog.launch_dims(r[1]) for r in rows} == {(grid, block)}, name


def test_cuda_graphs_stored_as_source_8_with_handles(rec: Rec) -> None:
    pid = rec.pids["calls"]
    graphs = [
        tuple(int(x, 16) for x in line.split()[1:])
        for line in rec.out["calls"].splitlines()
        if line.startswith("graph ")
    ]
    cugraph = next(
        tuple(int(x, 16) for x in line.split()[1:])
        for line in rec.out["calls"].splitlines()
        if line.startswith("cugraph ")
    )
    assert len(graphs) == 3
    begin = rec.ops(pid, "cudaStreamBeginCapture")
    assert [(r[0], r[1]) for r in begin] == [(0x77, 0)] * 3 + [(0x88, 1)]
    end = rec.ops(pid, "cudaStreamEndCapture")
    assert [(r[0], r[1]) for r in end] == [(0x77, g) for g, _ in graphs] + [(0x88, cugraph[0])]
    inst = rec.ops(pid, "cudaGraphInstantiate")
    assert [(r[0], r[1]) for r in inst] == [*graphs, cugraph]
    launches = rec.ops(pid, "cudaGraphLaunch")
    assert [(r[0], r[1]) for r in launches] == [(e, 0x77) for _, e in graphs for _ in range(8)] + [
        (cugraph[1], 0x88)
    ] * 2
    # Ingero's SQL: source 8 joins the sources/ops tables by Ingero's op names
    names = rec.all(
        "SELECT DISTINCT o.name FROM events e JOIN ops o ON o.source_id = e.source AND o.op_id = e.op "
        "JOIN sources s ON s.id = e.source WHERE s.name = 'CUDA_GRAPH' AND e.pid = ?",
        pid,
    )
    assert {n for (n,) in names} == {"graphBeginCapture", "graphEndCapture", "graphInstantiate", "graphLaunch"}


def test_allocation_pointers_and_live_bytes(rec: Rec) -> None:
    leak, healthy = rec.pids["leak"], rec.pids["healthy"]
    first = int(rec.out["leak"].split("first ")[1].split()[0], 16)
    mallocs = rec.ops(leak, "cudaMalloc")
    assert len(mallocs) == LEAK_CALLS and mallocs[0][1] == first
    assert len({r[1] for r in mallocs}) == LEAK_CALLS  # every pointer recorded, all distinct
    frees = rec.ops(leak, "cudaFree")
    assert [r[0] for r in frees] == [r[1] for r in mallocs[::4]]  # cudaFree's arg0 is the pointer
    with sqlite3.connect(f"file:{rec.db}?mode=ro", uri=True) as conn:
        grown = live_bytes(conn, leak)
        flat = live_bytes(conn, healthy)
    assert int(grown.live[-1]) == (LEAK_CALLS - LEAK_CALLS // 4) << 20
    assert int(flat.live.max()) == 1 << 20 and int(flat.live[-1]) == 0


def test_explain_names_the_leak_and_not_the_healthy_loop(rec: Rec) -> None:
    with sqlite3.connect(f"file:{rec.db}?mode=ro", uri=True) as conn:
        leak = explain(conn, pid=rec.pids["leak"])
        healthy = explain(conn, pid=rec.pids["healthy"])
        async_leak = explain(conn, pid=rec.pids["asyncleak"])
    for report, words in ((leak, "cudaMalloc without cudaFree"), (async_leak, "cudaMallocAsync without cudaFreeAsync")):
        chains = [c for c in report.chains if c.family == "gpu-leak"]
        assert len(chains) == 1
        assert words in chains[0].summary
        assert chains[0].evidence["live_bytes"] == (LEAK_CALLS - LEAK_CALLS // 4) << 20
        assert chains[0].evidence["top_stacks"]  # where the leaked memory was allocated
    assert not [c for c in healthy.chains if c.family == "gpu-leak"]


def test_stream_ordered_allocations_pointers_and_live_bytes(rec: Rec) -> None:
    pid = rec.pids["asyncleak"]
    mallocs, frees = rec.ops(pid, "cudaMallocAsync"), rec.ops(pid, "cudaFreeAsync")
    assert len(mallocs) == LEAK_CALLS and len({r[1] for r in mallocs}) == LEAK_CALLS
    assert {r[0] for r in mallocs} == {1 << 20}
    assert [r[0] for r in frees] == [r[1] for r in mallocs[::4]]
    with sqlite3.connect(f"file:{rec.db}?mode=ro", uri=True) as conn:
        assert int(live_bytes(conn, pid).live[-1]) == (LEAK_CALLS - LEAK_CALLS // 4) << 20


def test_socket_send_and_recv_bytes_and_latency(rec: Rec) -> None:
    pid = rec.pids["net"]
    fd0, fd1 = (int(x) for x in rec.out["net"].split("fds ")[1].split()[:2])
    sends, recvs = rec.ops(pid, "net_send"), rec.ops(pid, "net_recv")
    assert sorted({(r[0], r[1]) for r in sends}) == sorted({(1000, fd0), (300, fd1)})
    assert sorted({(r[0], r[1]) for r in recvs}) == sorted({(1000, fd1), (300, fd0)})
    assert len(sends) == len(recvs) == 2 * NET_ROUNDS
    assert all(r[2] == 0 and r[3] > 0 for r in sends + recvs)
    # block I/O and exec are host-wide by design; socket I/O is the traced processes' only
    assert rec.all("SELECT count(*) FROM events WHERE pid = ? AND source = ?", rec.pids["untraced"], catalog.NET) == [
        (0,)
    ]


def test_real_libcudart_new_calls(rec: Rec) -> None:
    pid = rec.pids["real"]
    for name, (n, rc) in rec.real.items():
        assert rc != 0  # no GPU here
        rows = rec.ops(pid, name)
        assert len(rows) == n == REAL_CALLS, name
        assert {r[2] for r in rows} == {rc}, name
    assert {r[0] for r in rec.ops(pid, "cudaMemcpy2D")} == {6000}
    assert {(r[0], r[1]) for r in rec.ops(pid, "cudaHostAlloc")} == {(65536, 2)}
