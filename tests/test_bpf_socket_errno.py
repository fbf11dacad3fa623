"""A traced process's failing socket calls carry the call's errno, negative, on both paths: libc
uprobes (the default: libc returns -1 and the return probe reads errno from the thread's TLS) and the
syscall tracepoints of ``--socket-rw`` (the kernel's -errno). Real bcc recordings of
``bpf_fixtures/socket_errors.c`` (EAGAIN, EBADF, ENOTSOCK from a second thread, EPIPE, and a
successful round trip between them) against the test-built fake libcudart.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
import trio

from ingero.agent.trace import elfsyms
from ingero.agent.trace.libc_sockets import errno_tp_offset, libc_of
from ingero.agent.trace.tracer import TraceReady
from ingero.identity import Identity
from ingero.store import catalog
from tests.bpf_support import build, build_program, record, trace_options

SEND, RECV = catalog.op_id("net_send")[1], catalog.op_id("net_recv")[1]


def _run(exe: Path, lib_dir: Path, ready: TraceReady) -> tuple[int, str]:
    p = subprocess.Popen([str(exe), str(lib_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    first = p.stdout.readline()
    trio.from_thread.run(ready.control.rescan)  # its socket calls are probed from the agent's next sync
    out, _ = p.communicate("go\n", timeout=60)
    assert p.returncode == 0, first + out
    return p.pid, first + out


@pytest.mark.bpf
@pytest.mark.parametrize("socket_rw", [False, True], ids=["libc-uprobes", "tracepoints"])
def test_failed_socket_calls_record_their_errno(tmp_path: Path, socket_rw: bool) -> None:
    built = build(tmp_path / "bpf-build")
    exe = build_program("socket_errors.c", tmp_path / "prog")
    opts = trace_options(tmp_path / "errno.db", Identity("errno-node"), built.overrides(), socket_rw=socket_rw)
    _, (pid, out) = record(opts, lambda ready: _run(exe, built.dir, ready))
    words = out.split()
    a, b, closed, pipe_r = (int(w) for w in words[words.index("fds") + 1 : words.index("fds") + 5])
    seen = {k: int(words[words.index(k) + 1]) for k in ("recv", "send", "recvmsg", "sendto", "tid")}
    # what the program itself saw from libc: the recording must say the same
    assert [seen[k] for k in ("recv", "send", "recvmsg", "sendto")] == [
        errno.EAGAIN,
        errno.EBADF,
        errno.ENOTSOCK,
        errno.EPIPE,
    ]
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as c:
        rows = c.execute(
            "SELECT op, arg1, arg0, ret_code, tid FROM events WHERE pid = ? AND source = ? ORDER BY timestamp",
            (pid, catalog.NET),
        ).fetchall()
    assert rows == [
        (RECV, b, 0, -errno.EAGAIN, pid),
        (SEND, closed, 0, -errno.EBADF, pid),
        (SEND, a, 10, 0, pid),  # success after a failure: errno is still EBADF in the TLS, and not read
        (RECV, b, 10, 0, pid),
        (RECV, pipe_r, 0, -errno.ENOTSOCK, seen["tid"]),  # another thread: its own TLS
        (SEND, a, 0, -errno.EPIPE, pid),
    ]


def test_errno_offset_is_this_process_own() -> None:
    """The offset read from the GOT is where errno lives: thread pointer (%fs base) + offset is the
    address ``__errno_location()`` returns in this very process."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.__errno_location.restype = ctypes.c_void_p
    fs = ctypes.c_ulong()
    arch_prctl, arch_get_fs = 158, 0x1003  # x86-64
    assert libc.syscall(arch_prctl, arch_get_fs, ctypes.byref(fs)) == 0
    path = libc_of(os.getpid())
    assert path is not None
    off = errno_tp_offset(os.getpid(), elfsyms.load(path))
    assert off is not None and off < 0
    assert fs.value + off == libc.__errno_location()
