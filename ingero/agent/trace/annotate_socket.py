"""The annotation ingest socket of ``ingero trace --annotate``: Ingero's NDJSON protocol on a Unix socket.

The socket is ``annotate.sock`` in an agent-owned directory (:func:`ingero.annotate.agent_socket_dir`:
``/run/ingero``, or ``~/.ingero/run`` when ``/run`` is not writable). The path is not a flag, so the
agent only ever unlinks a file inside a directory it verified: at bind the directory must be a real
directory (not a link) owned by the agent with no group/other write bit, else the agent refuses to
start. It is made 0700 (0750 and the socket's group set with ``--annotate-socket-gid``); the socket is
0600 (0660). A live socket already there (another tracer) is refused, a stale one replaced.

Served on the tracer's trio loop: one task accepts, one task per connection (at most
:data:`MAX_CONNECTIONS`) reads lines of at most :data:`ingero.annotate.MAX_LINE_BYTES` (a longer one
is skipped to its newline, never buffered). Each line is validated (:func:`ingero.annotate.parse_line`),
rate limited per connection, checked against the peer's right to label a process, stamped with the
peer's SO_PEERCRED uid/gid/pid, and handed to the sink (the pipeline's single writer). Each line gets a
reply, ``{"ok":true}`` or ``{"ok":false,"error":"..."}``, sent without waiting: a peer that does not
read (the Python helper, Ingero's integrations) loses its replies, never stalls the agent, and a bad
line never drops the connection.

Who may label a process (``pid`` in a line): root; the process itself; a process of the same uid as the
target's real uid (the rule of kill(2)). A non-root peer cannot label a process that is not running, or
name a ``start_time`` other than the running one's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from ingero.annotate import (
    MAX_LINE_BYTES,
    RATE_PER_CONNECTION,
    RATE_WINDOW_S,
    SOCKET_NAME,
    AnnotationLine,
    agent_socket_dir,
    parse_line,
)
from ingero.errors import IngeroError, UsageError
from ingero.store.annotations import AnnotationRow, row_of

MAX_CONNECTIONS = 64
RECV_BYTES = 64 * 1024
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_clock = time.monotonic  # the rate limit's clock

Sink = Callable[[list[AnnotationRow]], bool]  # False: the recording is closing, the rows were not taken


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


@dataclass
class AnnotateStats:
    connections: int = 0
    refused_connections: int = 0
    accepted: int = 0
    rejected: int = 0
    replies_dropped: int = 0
    live: int = 0  # connections open now

    def as_dict(self) -> dict[str, int]:
        return {
            "annotate_connections": self.connections,
            "annotate_accepted": self.accepted,
            "annotate_rejected": self.rejected,
            "annotate_replies_dropped": self.replies_dropped,
        }


# --- the directory -------------------------------------------------------------------------------


def prepare_dir(directory: Path | None = None, gid: int | None = None) -> Path:
    """The socket directory, created or verified (see the module docstring); UsageError when it is not
    safe. ``directory`` is for tests: the agent always uses :func:`agent_socket_dir`."""
    d = agent_socket_dir() if directory is None else directory
    mode = 0o750 if gid is not None else 0o700
    try:
        d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        d.mkdir(mode=mode, exist_ok=True)
        st = os.lstat(d)
    except OSError as e:
        raise UsageError(f"annotation socket directory {d}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"annotation socket directory {d} is not a directory (a link?): refusing to use it")
    if st.st_uid != os.geteuid():
        raise UsageError(
            f"annotation socket directory {d} is owned by uid {st.st_uid}, not this agent (uid {os.geteuid()}): "
            "refusing to bind there",
            hint=f"remove {d} if it is not yours",
        )
    if st.st_mode & 0o022:
        raise UsageError(
            f"annotation socket directory {d} is group/other writable (mode {stat.S_IMODE(st.st_mode):04o}): "
            "refusing to bind there",
            hint=f"chmod 0700 {d}",
        )
    os.chmod(d, mode)
    if gid is not None:
        os.chown(d, -1, gid)
    return d


def bind_socket(directory: Path, gid: int | None = None) -> socket.socket:
    """A listening, non-blocking socket at ``directory/annotate.sock`` (a stale one replaced)."""
    path = directory / SOCKET_NAME
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: nobody listens (inside the directory verified above)
        else:
            raise UsageError(f"another agent is listening on {path}", hint="stop it, or trace without --annotate")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o660 if gid is not None else 0o600)
        if gid is not None:
            os.chown(path, -1, gid)
        sock.listen(MAX_CONNECTIONS)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise IngeroError(f"annotation socket {path}: {e.strerror or e}") from None
    return sock


# --- the right to label a process --------------------------------------------------------------------


def proc_start_time(pid: int) -> int | None:
    """/proc/<pid>/stat field 22 (clock ticks after boot): with the pid, one process incarnation."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[19])  # field 22 counts from pid (1) and comm (2); these start at state (3)


def proc_real_uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def scope(line: AnnotationLine, peer: Peer) -> AnnotationLine:
    """The line with its incarnation resolved, if ``peer`` may label that process; UsageError if not."""
    if not line.pid:
        return line
    running = proc_start_time(line.pid)
    if peer.uid != 0 and line.pid != peer.pid:
        owner = proc_real_uid(line.pid)
        if running is None or owner is None:
            raise UsageError(f"pid {line.pid} is not running: only root may label it")
        if owner != peer.uid:
            raise UsageError(f"uid {peer.uid} may not label pid {line.pid} (a process of uid {owner})")
    if line.start_time:
        if peer.uid != 0 and line.start_time != running:
            raise UsageError(f"start_time {line.start_time} is not pid {line.pid}'s running incarnation")
        return line
    return AnnotationLine(
        line.ts, line.labels, line.pid, running or 0, line.span_start, line.span_end
    )  # Ingero: a bare pid gets the running incarnation's start time


# --- serving -------------------------------------------------------------------------------------


async def serve_annotations(
    sink: Sink,
    *,
    gid: int | None = None,
    directory: Path | None = None,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
    stats: AnnotateStats | None = None,
) -> None:
    """Listen until cancelled; readiness (the bound path) through ``task_status``; counters in
    ``stats``. The socket file is removed when it stops."""
    d = prepare_dir(directory, gid)
    listener = bind_socket(d, gid)
    path = d / SOCKET_NAME
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            await _accept_loop(listener, sink, AnnotateStats() if stats is None else stats, nursery)
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _accept_loop(listener: socket.socket, sink: Sink, stats: AnnotateStats, nursery: trio.Nursery) -> None:
    while True:
        await trio.lowlevel.wait_readable(listener)
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            continue
        except OSError:  # out of descriptors (EMFILE, ENFILE): the recording goes on, accepting later
            stats.refused_connections += 1
            await trio.sleep(0.1)
            continue
        conn.setblocking(False)
        if stats.live >= MAX_CONNECTIONS:
            stats.refused_connections += 1
            _reply(conn, stats, f"too many connections (at most {MAX_CONNECTIONS})")
            conn.close()
            continue
        stats.live += 1
        stats.connections += 1
        nursery.start_soon(_serve_connection, conn, sink, stats)


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Peer(pid, uid, gid)


async def _serve_connection(conn: socket.socket, sink: Sink, stats: AnnotateStats) -> None:
    """One peer's lines until it hangs up; a socket error ends this connection only (never the agent),
    and a peer whose credentials cannot be read is not served (no provenance, no rows)."""
    try:
        peer = peer_of(conn)
        lines = _Lines()
        rate = _Rate()
        while True:
            await trio.lowlevel.wait_readable(conn)
            try:
                data = conn.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                continue
            if not data:
                return
            for line, oversize in lines.feed(data):
                error = _handle(line, oversize, peer, sink, rate)
                if error is None:
                    stats.accepted += 1
                else:
                    stats.rejected += 1
                _reply(conn, stats, error)
    except OSError:
        return
    finally:
        stats.live -= 1
        conn.close()


def _handle(raw: bytes, oversize: int, peer: Peer, sink: Sink, rate: _Rate) -> str | None:
    """One line: None when taken, else the reason it was refused."""
    if oversize:
        return f"line of {oversize} bytes, at most {MAX_LINE_BYTES}"
    if not rate.allow():
        return f"rate limit: at most {RATE_PER_CONNECTION} lines a second on one connection"
    try:
        line = scope(parse_line(raw), peer)
    except UsageError as e:
        return e.one_line()
    if not sink([row_of(line, peer.uid, peer.gid, peer.pid)]):
        return "the recording is stopping"
    return None


def _reply(conn: socket.socket, stats: AnnotateStats, error: str | None) -> None:
    doc = {"ok": True} if error is None else {"ok": False, "error": error}
    data = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
    try:
        if conn.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) == len(data):
            return
    except OSError:  # full (a peer that does not read), or gone: the reply is dropped, never waited for
        pass
    stats.replies_dropped += 1


class _Lines:
    """NDJSON framing with a bounded buffer: a line over the limit is skipped up to its newline."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.skipping = 0  # bytes of an oversize line seen so far (0: not skipping)

    def feed(self, data: bytes) -> list[tuple[bytes, int]]:
        """Complete lines as (line, 0), or (b"", size) for one that was too long; blank lines dropped."""
        out: list[tuple[bytes, int]] = []
        start = 0
        while True:
            nl = data.find(b"\n", start)
            chunk = data[start:] if nl < 0 else data[start:nl]
            if self.skipping:
                self.skipping += len(chunk)
            elif len(self.buf) + len(chunk) > MAX_LINE_BYTES:
                self.skipping = len(self.buf) + len(chunk)
                self.buf.clear()
            else:
                self.buf += chunk
            if nl < 0:
                return out
            if self.skipping:
                out.append((b"", self.skipping))
                self.skipping = 0
            elif self.buf.strip():
                out.append((bytes(self.buf), 0))
            self.buf.clear()
            start = nl + 1


class _Rate:
    """Ingero's per-connection limit: :data:`RATE_PER_CONNECTION` lines per fixed window."""

    def __init__(self) -> None:
        self.window = _clock()
        self.count = 0

    def allow(self) -> bool:
        now = _clock()
        if now - self.window >= RATE_WINDOW_S:
            self.window, self.count = now, 0
        self.count += 1
        return self.count <= RATE_PER_CONNECTION


__all__ = [
    "MAX_CONNECTIONS",
    "AnnotateStats",
    "Peer",
    "bind_socket",
    "peer_of",
    "prepare_dir",
    "proc_start_time",
    "scope",
    "serve_annotations",
]
