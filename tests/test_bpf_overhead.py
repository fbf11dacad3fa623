"""Socket calls of traced processes through per-process libc uprobes (net_probes.c): a traced process's
send/recv calls are recorded with their bytes and fd, a process the agent does not trace gets no probe
at all (its calls are not recorded), a child enrolled by a fork is probed from the next sync on, and an
exited process's probes go. Real uprobes, ``bpf_fixtures/socket_trips.c``; the cost figures are in
bench/bench_overhead.py (never timed here).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from ingero.agent.trace.tracer import TraceReady
from ingero.identity import Identity
from ingero.store import catalog
from tests.bpf_support import build, build_program, record, trace_options

pytestmark = pytest.mark.bpf

TRIPS = 40
SEND, RECV = catalog.op_id("net_send"), catalog.op_id("net_recv")
# A parent that starts socket_trips on request and relays its lines (its child is enrolled by the fork).
PARENT = """
import subprocess, sys
sys.stdin.readline()
child = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
child.stdin.write(sys.stdin.readline())
child.stdin.flush()
print(child.stdout.read().strip(), flush=True)
sys.exit(child.wait())
"""


class Trips:
    """socket_trips in wait mode: started, then told to run its loop."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ready(self) -> tuple[int, int, int]:
        """(pid, send fd, receive fd) of the looping process."""
        assert self.proc.stdout is not None
        words = self.proc.stdout.readline().split()
        assert words and words[0] == "ready", words
        return int(words[1]), int(words[2]), int(words[3])

    def go(self) -> str:
        out, _ = self.proc.communicate("go\n", timeout=60)
        assert self.proc.returncode == 0, out
        return out


def _net(db: Path, pid: int) -> list[tuple[int, int, int, int, int]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return c.execute(
            "SELECT op, arg0, arg1, ret_code, duration FROM events WHERE pid = ? AND source = ?", (pid, catalog.NET)
        ).fetchall()


def _check_recorded(rows: list[tuple[int, int, int, int, int]], fds: tuple[int, int]) -> None:
    sends = [r for r in rows if r[0] == SEND[1]]
    recvs = [r for r in rows if r[0] == RECV[1]]
    assert len(sends) == len(recvs) == TRIPS
    assert {(r[1], r[2], r[3]) for r in sends} == {(64, fds[0], 0)}  # bytes, the socket's fd, no error
    assert {(r[1], r[2], r[3]) for r in recvs} == {(64, fds[1], 0)}
    assert all(r[4] > 0 for r in rows)


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program("socket_trips.c", tmp_path_factory.mktemp("trips"))


@pytest.mark.parametrize("mode", [[], ["msg"]], ids=["sendto-recvfrom", "sendmsg-recvmsg"])
def test_a_traced_process_socket_calls_are_recorded_with_bytes_and_fd(
    exe: Path, tmp_path: Path, mode: list[str]
) -> None:
    built = build(tmp_path / "bpf-build")
    traced = Trips([str(exe), str(TRIPS), *mode, "wait"])
    pid, fd0, fd1 = traced.ready()
    opts = trace_options(tmp_path / "t.db", Identity("ovh"), built.overrides(), pids=[pid])

    def workload(ready: TraceReady) -> set[int]:
        probed = ready.socket_pids()  # a --pid target's probes go on before readiness
        traced.go()
        untraced = subprocess.run([str(exe), str(TRIPS), *mode], capture_output=True, text=True, timeout=60)
        assert untraced.returncode == 0
        return probed

    summary, probed = record(opts, workload)
    assert probed == {pid}
    _check_recorded(_net(opts.db_path, pid), (fd0, fd1))
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as c:
        (others,) = c.execute(
            "SELECT count(*) FROM events WHERE source = ? AND pid != ?", (catalog.NET, pid)
        ).fetchone()
    assert others == 0  # the untraced run of the same loop: not recorded
    assert summary.stats["events_dropped_ring"] == 0


def test_children_are_probed_from_the_next_sync_and_untraced_processes_never(exe: Path, tmp_path: Path) -> None:
    built = build(tmp_path / "bpf-build")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(exe), str(TRIPS), "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    untraced = Trips([str(exe), str(TRIPS), "wait"])
    upid, _, _ = untraced.ready()
    opts = trace_options(tmp_path / "f.db", Identity("ovh"), built.overrides(), pids=[parent.pid])

    def workload(ready: TraceReady) -> dict[str, Any]:
        assert parent.stdin is not None and parent.stdout is not None
        probes = ready.control
        assert ready.socket_pids() == {parent.pid}
        parent.stdin.write("start\n")
        parent.stdin.flush()
        words = parent.stdout.readline().split()
        child, fd0, fd1 = int(words[1]), int(words[2]), int(words[3])
        trio.from_thread.run(probes.rescan)  # the sync: the forked child is a target now
        assert ready.socket_pids() == {parent.pid, child}
        untraced.go()  # meanwhile an untraced process loops: no probe, no rows
        parent.stdin.write("go\n")
        parent.stdin.flush()
        parent.communicate(timeout=60)
        assert parent.returncode == 0
        trio.from_thread.run(probes.rescan)  # both exited: their probes go
        return {"child": child, "fds": (fd0, fd1), "after": ready.socket_pids()}

    summary, got = record(opts, workload)
    _check_recorded(_net(opts.db_path, got["child"]), got["fds"])
    assert _net(opts.db_path, upid) == []
    assert got["after"] == set()
    assert summary.stats["events_dropped_ring"] == 0


LATE_DLOPEN = """
import ctypes, sys
sys.stdin.readline()
lib = ctypes.CDLL(sys.argv[1])
print("loaded", flush=True)
sys.stdin.readline()
p = ctypes.c_void_p()
for _ in range(int(sys.argv[2])):
    lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(4096))
print("done", flush=True)
"""


def test_follow_mode_probes_a_library_a_running_process_maps_later(tmp_path: Path) -> None:
    """The rescan reads again only the processes whose address space changed: a process scanned
    before it dlopens libcudart is probed at the next rescan."""
    built = build(tmp_path / "bpf-build")
    opts = trace_options(tmp_path / "late.db", Identity("ovh"), {}, follow=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", LATE_DLOPEN, str(built.cudart), "123"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def action(ready: TraceReady) -> int:
        assert proc.stdin is not None and proc.stdout is not None
        trio.from_thread.run(ready.control.rescan)  # scanned: no GPU library mapped yet
        trio.from_thread.run(ready.control.rescan)
        proc.stdin.write("load\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "loaded"
        trio.from_thread.run(ready.control.rescan)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        assert proc.wait(timeout=60) == 0
        return proc.pid

    _, pid = record(opts, action)
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as conn:
        ref = catalog.lookup_op("cudaMalloc")
        n = conn.execute(
            "SELECT sum(count) FROM event_aggregates WHERE pid = ? AND source = ? AND op = ?", (pid, ref.source, ref.op)
        ).fetchone()
    assert n == (123,)
