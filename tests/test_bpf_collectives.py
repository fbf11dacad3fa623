"""Collective identity under real uprobes: ranks of a job on the fake NCCL (tests/bpf_fixtures/fake_nccl.c,
a TCP rendezvous: every all-reduce returns only when all ranks have entered it) traced by one real
tracer; the recording's /collectives arrays, joined, name the rank given extra compute per step."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from ingero.fleet.collectives import NodeCalls, analyze
from ingero.identity import Identity
from ingero.store import catalog
from ingero.store.db import open_readonly
from ingero.store.nccl import read_calls
from ingero.store.window import Window
from tests.bpf_support import build, build_program, record, trace_options

pytestmark = pytest.mark.bpf

STEPS = 40
COMPUTE_US = 4000
EXTRA_US = 9000  # rank 1's extra compute per step


def fake_unique_id(root: str, job: str) -> bytes:
    """fake_nccl.c's ncclGetUniqueId, in Python: "fakenccl", IPv4, port, a stream seeded by the job."""
    host, port = root.rsplit(":", 1)
    out = bytearray(b"fakenccl")
    out += bytes(int(x) for x in host.split("."))
    out += int(port).to_bytes(2, "big")
    x = 0x243F6A8885A308D3
    for ch in job.encode():
        x = ((x ^ ch) * 0x100000001B3) & catalog.U64
    for _ in range(14, 128):
        x ^= (x << 13) & catalog.U64
        x ^= x >> 7
        x ^= (x << 17) & catalog.U64
        out.append((x >> 24) & 0xFF)
    return bytes(out)


def run_job(exe: Path, libdir: Path, work: Path, root: str, job: str, extra: list[int]) -> list[int]:
    go = work / f"go-{job}"
    env = {**os.environ, "FAKE_NCCL_ROOT": root, "FAKE_NCCL_JOB": job}
    n = len(extra)
    procs = [
        subprocess.Popen(
            [str(exe), str(libdir), str(r), str(n), str(STEPS), str(COMPUTE_US), str(extra[r]), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(n)
    ]
    go.touch()
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and out.strip() == f"done {STEPS}", out
    return [p.pid for p in procs]


def test_traced_job_names_the_late_rank(tmp_path: Path) -> None:
    built = build(tmp_path / "build")
    exe = build_program("nccl_job.c", tmp_path / "build-job")
    root, job = "127.0.0.1:29617", "bpf-collectives"
    opts = trace_options(
        tmp_path / "trace.db",
        Identity("bpf-node"),
        built.overrides(),
    )
    _, pids = record(opts, lambda ready: run_job(exe, built.dir, tmp_path, root, job, [0, EXTRA_US, 0]))

    conn = sqlite3.connect(opts.db_path)
    comm_ids = {r[0] for r in conn.execute("SELECT comm_id FROM nccl_comms WHERE pid IN (?, ?, ?)", pids)}
    want = catalog.as_sqlite_int(catalog.nccl_comm_id(fake_unique_id(root, job)))
    assert comm_ids == {want}  # every rank hashed the same 128-byte id, in the kernel
    ranks = conn.execute("SELECT pid, rank, nranks FROM nccl_comms WHERE pid IN (?, ?, ?) ORDER BY rank", pids)
    assert [(p, r, n) for p, r, n in ranks] == [(pids[0], 0, 3), (pids[1], 1, 3), (pids[2], 2, 3)]
    rows = conn.execute(
        "SELECT pid, seq, op, datatype, redop, count, bytes, peer, duration FROM nccl_calls ORDER BY pid, seq"
    ).fetchall()
    assert len(rows) == 3 * STEPS
    for pid in pids:
        mine = [r for r in rows if r[0] == pid]
        assert [r[1] for r in mine] == list(range(STEPS))
        assert {r[2:8] for r in mine} == {(1, 7, 0, 1 << 20, 4 << 20, -1)}  # all-reduce, float32, sum, 4 MiB
        assert all(r[8] > 0 for r in mine)
    conn.close()

    ro = open_readonly(opts.db_path)
    body = read_calls(ro, Window())
    ro.close()
    assert body["comms"] == [{"id": f"{catalog.nccl_comm_id(fake_unique_id(root, job)):016x}", "nranks": 3}]
    v = analyze([NodeCalls.from_body("bpf-node", body)])
    assert v.kind == "straggler" and v.rank == 1, v.line
    assert v.last_calls >= STEPS - 2
    assert v.lag_ms == pytest.approx(EXTRA_US / 1000, abs=3.0)
    waiter = next(r for r in v.ranks if r.rank == 0)
    assert waiter.wait_s > 0.5 * STEPS * EXTRA_US / 1e6  # the waiters wait; the late rank does not
    assert next(r for r in v.ranks if r.rank == 1).wait_s < waiter.wait_s / 5


def test_traced_hung_rank_is_named_from_calls_in_flight(tmp_path: Path) -> None:
    """Rank 2 is stopped (SIGSTOP) mid-job: the others sit in an all-reduce it never enters. Their calls
    never return, yet the entry records put them in nccl_calls (duration −1) and the verdict names rank 2."""
    import signal
    import time

    from ingero.fleet.collective_ops import collective_verdict

    built = build(tmp_path / "build")
    exe = build_program("nccl_job.c", tmp_path / "build-job")
    root, job = "127.0.0.1:29619", "bpf-hung"
    go = tmp_path / "go-hung"
    env = {**os.environ, "FAKE_NCCL_ROOT": root, "FAKE_NCCL_JOB": job}
    procs = [
        subprocess.Popen([str(exe), str(built.dir), str(r), "3", "100000", str(COMPUTE_US), "0", str(go)], env=env)
        for r in range(3)
    ]
    opts = trace_options(
        tmp_path / "trace.db",
        Identity("bpf-node"),
        built.overrides(),
    )

    def act(_ready: object) -> None:
        go.touch()
        time.sleep(1.0)
        procs[2].send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # ranks 0 and 1 now wait in an all-reduce rank 2 never enters

    try:
        record(opts, act)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    conn = sqlite3.connect(opts.db_path)
    flying = conn.execute(
        "SELECT c.rank FROM nccl_calls n JOIN nccl_comms c USING (node, pid, comm) WHERE duration < 0"
    )
    assert {r[0] for r in flying} >= {0, 1}
    conn.close()
    ro = open_readonly(opts.db_path)
    body = read_calls(ro, Window())
    ro.close()
    v = collective_verdict([NodeCalls.from_body("bpf-node", body)])
    assert v.kind == "hung" and v.rank == 2, v.line
    assert "never entered ncclAllReduce #" in v.line
    assert v.peers_wait_s >= 1.0  # two peers, each stuck ~1 s before the trace stopped (waits run to now)
