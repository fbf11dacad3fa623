"""``ingero trace --socket-rw``: read(2)/write(2) on a socket are recorded as net_recv/net_send (the
fd looked up in the task's file table in the kernel), the same calls on a pipe or a regular file are
not, and without the option no read/write is recorded at all. Real tracepoints, the test-built fake
libcudart (its one cudaMalloc makes the workload a traced process).
"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ingero.identity import Identity
from ingero.store import catalog
from tests.bpf_support import build, build_program, record, trace_options

pytestmark = pytest.mark.bpf

ROUNDS = 30
SEND, RECV = catalog.op_id("net_send"), catalog.op_id("net_recv")


def _trace(tmp: Path, socket_rw: bool) -> tuple[Path, int, dict[str, int]]:
    built = build(tmp / "bpf-build")
    exe = build_program("breadth.c", tmp / "prog")
    opts = trace_options(
        tmp / f"rw-{socket_rw}.db",
        Identity("rw-node"),
        built.overrides(),
        socket_rw=socket_rw,
    )

    def workload(_: Any) -> tuple[int, dict[str, int]]:
        p = subprocess.run([str(exe), "netrw", str(built.dir), str(ROUNDS)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        words = p.stdout.split()
        fds = {k: int(words[words.index(k) + 1]) for k in ("fds", "pipe", "file")}
        fds["peer"] = int(words[words.index("fds") + 2])
        fds["pipe_w"] = int(words[words.index("pipe") + 2])
        return 0, fds

    _, (_, fds) = record(opts, workload)
    pid = _only_pid(opts.db_path)
    return opts.db_path, pid, fds


def _only_pid(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        (pid,) = c.execute(
            "SELECT DISTINCT pid FROM events WHERE source = ? AND op = ?", catalog.op_id("cudaMalloc")
        ).fetchone()
    return int(pid)


def _net(db: Path, pid: int) -> list[tuple[int, int, int, int, int]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return c.execute(
            "SELECT op, arg0, arg1, ret_code, duration FROM events WHERE pid = ? AND source = ?", (pid, catalog.NET)
        ).fetchall()


def test_socket_read_write_recorded_and_files_and_pipes_not(tmp_path: Path) -> None:
    db, pid, fds = _trace(tmp_path, socket_rw=True)
    rows = _net(db, pid)
    sends = [r for r in rows if r[0] == SEND[1]]
    recvs = [r for r in rows if r[0] == RECV[1]]
    assert len(sends) == len(recvs) == ROUNDS
    assert {(r[1], r[2], r[3]) for r in sends} == {(700, fds["fds"], 0)}  # bytes, the socket's fd, no error
    assert {(r[1], r[2], r[3]) for r in recvs} == {(700, fds["peer"], 0)}
    assert all(r[4] > 0 for r in rows)
    assert not {r[2] for r in rows} & {fds["pipe"], fds["pipe_w"], fds["file"]}


def test_without_the_option_read_and_write_are_not_recorded(tmp_path: Path) -> None:
    db, pid, _ = _trace(tmp_path, socket_rw=False)
    assert _net(db, pid) == []
