"""Real uprobes and tracepoints: one recording of CUDA-shaped workloads, checked from every side.

The module fixture compiles the fake libcudart/libcuda/libnccl and the workload with gcc, then traces
(in this process, through the real bcc programs) four things in a row:

1. a CPU hog pinned (at higher priority) to the CPU of a workload whose cudaLaunchKernel spins 1 ms of
   CPU: baseline calls, then calls under contention — sched_switch evidence, and explain names the hog;
2. the ``counts`` workload: distinctive numbers of each CUDA runtime / driver / NCCL call, known sleeps;
3. the real ``libcudart.so.12`` from the nvidia-cuda-runtime-cu12 wheel, called through ctypes
   (no GPU here: cudaMalloc returns an error code, which must be recorded);
4. fsync'd writes: block I/O evidence.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ingero.agent.trace.tracer import TraceReady, TraceSummary
from ingero.identity import Identity
from ingero.store.catalog import CUDA, DRIVER, HOST, NCCL
from tests.bpf_support import CUDART_CTYPES, REAL_CUDART, Built, build, pin, record, run_beside_cpu_hog, trace_options

pytestmark = pytest.mark.bpf

CTYPES_CALLS = 211
HOG_CPU = 0


@dataclass
class Recording:
    db: Path
    built: Built
    summary: TraceSummary
    counts: dict[str, tuple[int, int]]  # op -> (calls, last return code) as the workload reported
    comms: list[int]
    counts_pid: int
    ctypes_pid: int
    ctypes_rc: int
    io_file: Path
    contention_pid: int
    hog_pid: int
    nested_pid: int

    def conn(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)

    def one(self, sql: str, *params: Any) -> Any:
        with self.conn() as c:
            return c.execute(sql, params).fetchone()

    def all(self, sql: str, *params: Any) -> list[Any]:
        with self.conn() as c:
            return c.execute(sql, params).fetchall()


def _phases(built: Built, tmp: Path, ready: TraceReady) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. CPU contention: baseline, then a higher-priority hog on the same CPU.
    work = subprocess.Popen(
        [str(built.workload), "contention", str(built.dir), "1500", "150", "1000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pin(work, HOG_CPU)
    assert work.stdout is not None and work.stdin is not None
    assert work.stdout.readline().strip() == "ready"
    out["contention_pid"], out["hog_pid"] = work.pid, run_beside_cpu_hog(work, built.hog, HOG_CPU)
    # 2. Distinctive call counts with known sleeps.
    p = subprocess.Popen([str(built.workload), "counts", str(built.dir)], stdout=subprocess.PIPE, text=True)
    stdout, _ = p.communicate(timeout=120)
    assert p.returncode == 0
    counts: dict[str, tuple[int, int]] = {}
    for line in stdout.splitlines():
        parts = line.split()
        if parts[0] == "comm":
            out["comms"] = [int(x, 16) for x in parts[1:]]
        else:
            counts[parts[0]] = (int(parts[1]), int(parts[2]))
    out["counts"], out["counts_pid"] = counts, p.pid
    # 3. The real libcudart through ctypes.
    p = subprocess.Popen(
        [sys.executable, str(CUDART_CTYPES), str(REAL_CUDART), str(CTYPES_CALLS)], stdout=subprocess.PIPE, text=True
    )
    stdout, _ = p.communicate(timeout=120)
    assert p.returncode == 0, stdout
    out["ctypes_pid"], out["ctypes_rc"] = p.pid, int(stdout.split()[-1])
    # Nested probed calls (cudaMallocManaged -> cudaMalloc), as libcudart calls libcuda.
    p = subprocess.Popen([str(built.workload), "nested", str(built.dir), "64"], stdout=subprocess.PIPE, text=True)
    stdout, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and stdout.split() == ["nested", "64", "0"]
    out["nested_pid"] = p.pid
    # 4. fsync'd writes (on the disk the tests run from, not a tmpfs).
    io_file = tmp / "io.dat"
    subprocess.run([str(built.workload), "io", str(io_file), "8", str(1 << 20)], check=True, capture_output=True)
    out["io_file"] = io_file
    return out


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recording]:
    if REAL_CUDART is None:
        pytest.fail("nvidia-cuda-runtime-cu12 is not installed in the venv (it is a dev dependency)")
    built = build(tmp_path_factory.mktemp("bpf-build"))
    work = tmp_path_factory.mktemp("bpf-trace")
    overrides = built.overrides()
    overrides["cudart"].append(str(REAL_CUDART))
    opts = trace_options(
        work / "trace.db",
        Identity("bpf-node"),
        overrides,
    )
    io_dir = Path(__file__).resolve().parents[1] / ".pytest_cache" / "bpf-io"
    io_dir.mkdir(parents=True, exist_ok=True)
    summary, out = record(opts, lambda ready: _phases(built, io_dir, ready))
    yield Recording(
        db=opts.db_path,
        built=built,
        summary=summary,
        counts=out["counts"],
        comms=out["comms"],
        counts_pid=out["counts_pid"],
        ctypes_pid=out["ctypes_pid"],
        ctypes_rc=out["ctypes_rc"],
        io_file=out["io_file"],
        contention_pid=out["contention_pid"],
        hog_pid=out["hog_pid"],
        nested_pid=out["nested_pid"],
    )
    out["io_file"].unlink(missing_ok=True)


# --- exact counts ---------------------------------------------------------------------------------

ALWAYS_STORED = {
    # op reported by the workload -> (source, op id)
    "cudaFree": (CUDA, 2),
    "cudaMallocManaged": (CUDA, 8),
    "cudaMemcpy": (CUDA, 4),
    "cudaStreamSync": (CUDA, 5),
    "cudaDeviceSync": (CUDA, 6),
    "cuMemAlloc": (DRIVER, 5),
    "cuMemcpy": (DRIVER, 2),
    "cuCtxSynchronize": (DRIVER, 4),
    "ncclAllReduce": (NCCL, 1),
    "ncclBroadcast": (NCCL, 2),
    "ncclReduce": (NCCL, 3),
    "ncclAllGather": (NCCL, 4),
    "ncclReduceScatter": (NCCL, 5),
    "ncclSend": (NCCL, 6),
    "ncclRecv": (NCCL, 7),
}


def test_every_call_is_recorded_exactly_once(recording: Recording) -> None:
    r, pid = recording, recording.counts_pid
    for name, (source, op) in ALWAYS_STORED.items():
        calls, rc = r.counts[name]
        assert rc == 0
        n = r.one("SELECT count(*) FROM events WHERE pid = ? AND source = ? AND op = ?", pid, source, op)[0]
        assert n == calls, name
    # cudaMalloc: 1,237 successes and 7 failures with cudaErrorMemoryAllocation (2).
    rows = dict(r.all("SELECT ret_code, count(*) FROM events WHERE pid = ? AND source = 1 AND op = 1 GROUP BY 1", pid))
    assert rows == {0: 1237, 2: 7}
    assert r.counts["cudaMalloc_error"] == (7, 2)


def test_high_rate_ops_are_counted_exactly_in_aggregates(recording: Recording) -> None:
    r, pid = recording, recording.counts_pid
    for name, (source, op) in {
        "cuLaunchKernel": (DRIVER, 1),
        "cudaLaunchKernel": (CUDA, 3),
        "cudaMemcpyAsync": (CUDA, 7),
        "cuMemcpyAsync": (DRIVER, 3),
    }.items():
        calls = r.counts[name][0]
        total, stored = r.one(
            "SELECT sum(count), sum(stored) FROM event_aggregates WHERE pid = ? AND source = ? AND op = ?",
            pid,
            source,
            op,
        )
        rows = r.one("SELECT count(*) FROM events WHERE pid = ? AND source = ? AND op = ?", pid, source, op)[0]
        assert total == calls, name
        assert stored == rows <= calls
    assert r.counts["cuLaunchKernel"][0] == 4111
    # Aggregates count the always-stored ops too, stored == count.
    assert r.one(
        "SELECT sum(count), sum(stored) FROM event_aggregates WHERE pid = ? AND source = 1 AND op = 1", pid
    ) == (
        1244,
        1244,
    )


def test_known_sleeps_and_arguments(recording: Recording) -> None:
    r, pid = recording, recording.counts_pid
    ms = 1_000_000
    for (source, op), sleep in {(CUDA, 5): 2 * ms, (CUDA, 6): 3 * ms, (DRIVER, 4): 1 * ms}.items():
        lo, hi = r.one(
            "SELECT min(duration), max(duration) FROM events WHERE pid = ? AND source = ? AND op = ?", pid, source, op
        )
        assert sleep <= lo and hi < sleep + 250 * ms
    # Fast calls: well under a millisecond at the median.
    med = r.all("SELECT duration FROM events WHERE pid = ? AND source = 4 AND op = 5 ORDER BY duration", pid)
    assert med[len(med) // 2][0] < ms
    assert r.all("SELECT DISTINCT arg0 FROM events WHERE pid = ? AND source = 1 AND op = 5", pid) == [(2000,)]  # stream
    assert r.all("SELECT DISTINCT arg0, arg1 FROM events WHERE pid = ? AND source = 1 AND op = 4", pid) == [
        (1 << 20, 1)
    ]
    assert r.all("SELECT DISTINCT arg0, arg1 FROM events WHERE pid = ? AND source = 4 AND op = 2 ORDER BY 2", pid) == [
        (1000, 1),
        (2000, 2),
    ]
    assert r.all("SELECT DISTINCT arg0 FROM events WHERE pid = ? AND source = 4 AND op = 5", pid) == [(8192,)]
    assert r.all("SELECT DISTINCT arg0 FROM events WHERE pid = ? AND source = 1 AND op = 3", pid) == [(0x4242,)]


def test_nccl_bytes_communicators_and_ranks(recording: Recording) -> None:
    r, pid = recording, recording.counts_pid
    comm, comm_all0, comm_all1 = recording.comms
    expect = {
        1: (4096, comm),
        2: (1000, comm),
        3: (800, comm_all1),
        4: (512, comm),
        5: (512, comm),
        6: (40, comm),
        7: (40, comm),
    }
    for op, (nbytes, c) in expect.items():
        assert r.all(
            f"SELECT DISTINCT arg0, arg1 FROM events WHERE pid = ? AND source = {NCCL} AND op = ?", pid, op
        ) == [(nbytes, c)]
    comms = {row[0]: row[1:] for row in r.all("SELECT comm, rank, nranks, node FROM nccl_comms WHERE pid = ?", pid)}
    assert comms == {comm: (3, 8, "bpf-node"), comm_all0: (0, 2, "bpf-node"), comm_all1: (1, 2, "bpf-node")}
    # The documented join: rank of every collective.
    ranks = r.all(
        "SELECT DISTINCT c.rank FROM events e JOIN nccl_comms c ON c.comm = e.arg1 AND c.pid = e.pid "
        f"WHERE e.pid = ? AND e.source = {NCCL} AND e.op = 1",
        pid,
    )
    assert ranks == [(3,)]


def test_stacks_are_hashed_and_symbolized(recording: Recording) -> None:
    r, pid = recording, recording.counts_pid
    rows = r.all(
        "SELECT DISTINCT s.hash, s.ips, s.frames FROM events e JOIN stack_traces s ON s.hash = e.stack_hash "
        "WHERE e.pid = ? AND e.source = 1 AND e.op = 1",
        pid,
    )
    assert rows, "cudaMalloc events carry a stack"
    from ingero.agent.trace.stacks import stack_hash

    for h, ips, frames in rows:
        ip_list = [int(x, 16) for x in json.loads(ips)]
        assert stack_hash(ip_list) == h
        fr = json.loads(frames)
        assert len(fr) == len(ip_list)
        assert fr[0]["f"] == "workload" and fr[0]["s"].startswith("counts+0x"), fr
    # Every stored GPU event of this process has a stack.
    assert r.one("SELECT count(*) FROM events WHERE pid = ? AND source IN (1, 4, 8) AND stack_hash = 0", pid) == (0,)


def test_nested_calls_are_paired_with_their_own_returns(recording: Recording) -> None:
    rows = recording.all(
        "SELECT op, timestamp, duration, arg0 FROM events WHERE pid = ? AND source = 1 ORDER BY timestamp",
        recording.nested_pid,
    )
    outer = [(t, d) for op, t, d, a in rows if op == 8 and a == 12345]
    inner = [(t, d) for op, t, d, a in rows if op == 1 and a == 12345]
    assert len(outer) == len(inner) == 64
    for (t0, d0), (t1, d1) in zip(outer, inner, strict=True):
        assert t0 <= t1 and t1 + d1 <= t0 + d0  # cudaMalloc ran inside cudaMallocManaged


def test_real_libcudart_from_the_wheel(recording: Recording) -> None:
    r = recording
    assert r.ctypes_rc != 0  # no GPU, no driver: cudaMalloc fails
    rows = r.all(
        "SELECT ret_code, count(*), min(arg0), max(arg0) FROM events WHERE pid = ? AND source = 1 AND op = 1 GROUP BY 1",
        r.ctypes_pid,
    )
    assert rows == [(r.ctypes_rc, CTYPES_CALLS, 1 << 20, 1 << 20)]
    # Called from Python through libffi: the stack starts in the ctypes machinery.
    frames = r.one(
        "SELECT s.frames FROM events e JOIN stack_traces s ON s.hash = e.stack_hash WHERE e.pid = ? AND e.source = 1 LIMIT 1",
        r.ctypes_pid,
    )
    assert frames is not None and json.loads(frames[0])


# --- host evidence --------------------------------------------------------------------------------


def test_cpu_hog_produces_sched_switch_evidence(recording: Recording) -> None:
    r = recording
    n, preempted = r.one(
        "SELECT count(*), sum(arg0 IN (0, 256)) FROM events WHERE source = 3 AND op = 1 AND pid = ?",
        r.contention_pid,
    )
    assert n >= 20 and preempted >= 20
    # arg1 names the task that ran just before the workload came back: the hog, again and again.
    by_preemptor = dict(
        r.all("SELECT arg1, count(*) FROM events WHERE source = 3 AND op = 1 AND pid = ? GROUP BY 1", r.contention_pid)
    )
    assert by_preemptor.get(r.hog_pid, 0) >= 20, by_preemptor
    names = dict(r.all("SELECT pid, name FROM process_names WHERE pid IN (?, ?)", r.hog_pid, r.contention_pid))
    assert names == {r.hog_pid: "cpu_hog", r.contention_pid: "workload"}
    # The hog's start is recorded (process_exec for every process).
    assert r.one("SELECT count(*) FROM events WHERE source = 3 AND op = 5 AND pid = ?", r.hog_pid)[0] >= 1


def test_explain_names_the_cpu_hog(recording: Recording) -> None:
    from ingero.explain.engine import explain
    from ingero.store.db import open_readonly

    conn = open_readonly(recording.db)
    try:
        # the contention workload's process (the same recording also holds the other phases' workloads)
        report = explain(conn, pid=recording.contention_pid)
    finally:
        conn.close()
    cpu = [c for c in report.chains if c.cuda_op == "cudaLaunchKernel" and "sched_switch" in c.root_cause]
    assert cpu, [c.as_dict() for c in report.chains]
    chain = cpu[0]
    assert chain.family.endswith("cpu") and any("taskset" in r for r in chain.recommendations)
    # named from sched_switch arg1: the task that ran in the workload's place
    assert any(t.op == "preemption" and "cpu_hog" in t.detail for t in chain.timeline), chain.as_dict()
    assert "cpu_hog" in chain.root_cause, chain.as_dict()


def test_fsync_writes_produce_block_io(recording: Recording) -> None:
    r = recording
    n, sectors, lat = r.one(
        "SELECT count(*), sum(arg0), max(duration) FROM events WHERE source = 5 AND op = 2 AND ret_code = 0"
    )
    assert n >= 8 and sectors * 512 >= 8 << 20 and lat > 0
    assert r.one("SELECT sum(count) FROM event_aggregates WHERE source = 5 AND op = 2")[0] == n


# --- the session --------------------------------------------------------------------------------


def test_session_row_and_counters(recording: Recording) -> None:
    r = recording
    sid, started, stopped, flags, node = r.one("SELECT id, started_at, stopped_at, flags, node FROM sessions")
    assert stopped > started and node == "bpf-node" and "stack=site" in flags
    stats = dict(r.all("SELECT key, value FROM session_stats WHERE session_id = ?", sid))
    assert stats["events_dropped_ring"] == 0
    assert stats["events_seen"] == r.one("SELECT sum(count) FROM event_aggregates")[0]
    assert stats["events_stored"] == r.one("SELECT count(*) FROM events")[0]
    # fake libcudart (26 functions), libcuda (16), libnccl (10) + the real libcudart (42, with _ptsz variants)
    assert stats["probes_attached"] == sum(len(lib["functions"]) for lib in r.summary.libraries) == 26 + 16 + 10 + 42
    assert stats == {**r.summary.stats}
    assert r.one("SELECT count(*) FROM system_snapshots")[0] >= 3
    page = r.one("SELECT count(*), sum(arg0) FROM events WHERE source = ? AND op = 3", HOST)
    assert page[0] >= 1 and page[1] > 0  # per-second page allocation summaries of the traced processes
    # every other process (the kernel's per-CPU `page_allocs_rest` slot): aggregated under pid 0 in whole pages,
    # never an event row
    rest = r.one("SELECT sum(count), sum(stored), sum(sum_arg0) FROM event_aggregates WHERE op = 3 AND pid = 0")
    assert rest[0] > 0 and rest[1] == 0 and rest[2] >= 4096 * rest[0] and rest[2] % 4096 == 0
    assert r.one("SELECT count(*) FROM events WHERE source = ? AND op = 3 AND pid = 0", HOST)[0] == 0
