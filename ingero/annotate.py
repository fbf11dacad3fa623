"""Annotations over Ingero's socket protocol (agent 0.17), and the helper training code calls.

The protocol: ``ingero trace --annotate`` listens on a Unix socket (``/run/ingero/annotate.sock``, or
``~/.ingero/run/annotate.sock`` when ``/run`` is not writable) for NDJSON, one object a line::

    {"ts": ns?, "labels": {"k": "v", ...}, "pid"?, "start_time"?, "span_start"?, "span_end"?, "v"?}

The limits are Ingero's (``pkg/contract/annotate.go`` of ingero-io/ingero): ``labels`` required and
non-empty, at most :data:`MAX_LABELS` pairs, keys of ``[A-Za-z0-9_.-]`` up to :data:`MAX_KEY_BYTES`,
values up to :data:`MAX_VALUE_BYTES` (we also refuse control characters in them, and take numbers as
their JSON text where Ingero takes strings only), a line up to :data:`MAX_LINE_BYTES`, at most
:data:`RATE_PER_CONNECTION` lines a second on one connection, and a span with ``span_end <
span_start`` refused. They are declared here once; the agent (:mod:`ingero.agent.trace.annotate_socket`),
``ingero annotate`` and the direct ``--db`` path all validate with :func:`parse_line`.

The helper: ``with ingero.annotate.span(step=12): ...`` and ``ingero.annotate.point(epoch=3)``. Both
send one line to the agent and never block or raise: with no agent listening they warn once (a
:class:`RuntimeWarning`) and do nothing; a line the socket cannot take at once is dropped and counted
(:func:`dropped`). Labels are scoped to the calling process (``pid=0`` for trace-wide labels). Only
the standard library is imported here, so a training script pays nothing for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ingero.errors import UsageError

PROTOCOL_VERSION = 1
SOCKET_NAME = "annotate.sock"
SOCKET_DIR = Path("/run/ingero")  # agent-owned, 0700; checked at bind
FALLBACK_DIR = Path("~/.ingero/run")  # when /run is not writable: a 0700 directory under the home
MAX_KEY_BYTES = 64
MAX_VALUE_BYTES = 256
MAX_LABELS = 32
MAX_LINE_BYTES = 16 * 1024
RATE_PER_CONNECTION = 1000  # lines per RATE_WINDOW_S on one connection
RATE_WINDOW_S = 1.0
FIELDS = ("ts", "labels", "pid", "start_time", "span_start", "span_end", "v")
_KEY = re.compile(r"[A-Za-z0-9_.-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_INT64_MAX = (1 << 63) - 1
_RETRY_S = 5.0  # the helper looks for an agent again at most this often


@dataclass(frozen=True)
class AnnotationLine:
    """One validated protocol object. ``ts`` is the instant (the span's start for a span)."""

    ts: int
    labels: dict[str, str]
    pid: int = 0
    start_time: int = 0
    span_start: int = 0
    span_end: int = 0

    @property
    def is_span(self) -> bool:
        return bool(self.span_start or self.span_end)

    def as_wire(self) -> dict[str, object]:
        doc: dict[str, object] = {"ts": self.ts, "labels": self.labels, "v": PROTOCOL_VERSION}
        for name in ("pid", "start_time", "span_start", "span_end"):
            if getattr(self, name):
                doc[name] = getattr(self, name)
        return doc


def check_labels(labels: object) -> dict[str, str]:
    """The labels as strings, or UsageError naming the first violation of the limits."""
    if not isinstance(labels, Mapping) or not labels:
        raise UsageError("labels are required: a non-empty object of key/value strings")
    if len(labels) > MAX_LABELS:
        raise UsageError(f"{len(labels)} labels, at most {MAX_LABELS}")
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key) or len(key.encode()) > MAX_KEY_BYTES:
            shown = json.dumps(str(key)[:MAX_KEY_BYTES])
            raise UsageError(f"label key {shown}: use [A-Za-z0-9_.-], at most {MAX_KEY_BYTES} bytes")
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise UsageError(f"label {key}: the value must be a string (or a number)")
        text = value if isinstance(value, str) else json.dumps(value)
        if _CONTROL.search(text):
            raise UsageError(f"label {key}: control characters are not allowed in a value")
        if len(text.encode()) > MAX_VALUE_BYTES:
            raise UsageError(f"label {key}: value of {len(text.encode())} bytes, at most {MAX_VALUE_BYTES}")
        out[key] = text
    return out


def _int_field(doc: Mapping[str, object], name: str, *, limit: int = _INT64_MAX) -> int:
    value = doc.get(name, 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise UsageError(f"{name}: a whole number from 0 to {limit}")
    return value


def parse_line(raw: bytes | str, *, now_ns: int | None = None) -> AnnotationLine:
    """One protocol line, validated; UsageError (one line, the reason) for anything else."""
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > MAX_LINE_BYTES:
        raise UsageError(f"line of {size} bytes, at most {MAX_LINE_BYTES}")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise UsageError("not a JSON object") from None
    if not isinstance(doc, dict):
        raise UsageError("not a JSON object")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise UsageError(f"unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    version = doc.get("v")
    if version is not None and version != PROTOCOL_VERSION:
        raise UsageError(f"protocol version {version!r}: this agent speaks v{PROTOCOL_VERSION}")
    labels = check_labels(doc.get("labels"))
    ts = _int_field(doc, "ts")
    pid = _int_field(doc, "pid", limit=(1 << 32) - 1)
    start_time = _int_field(doc, "start_time") if pid else 0  # start_time without a pid is ignored
    span_start, span_end = _int_field(doc, "span_start"), _int_field(doc, "span_end")
    if (span_start or span_end) and not (span_start and span_end):
        raise UsageError("a span needs both span_start and span_end")
    if span_end < span_start:
        raise UsageError(f"span_end ({span_end}) is before span_start ({span_start})")
    if not ts:
        ts = span_start or (time.time_ns() if now_ns is None else now_ns)
    return AnnotationLine(ts, labels, pid, start_time, span_start, span_end)


def agent_socket_dir(run_dir: Path = SOCKET_DIR) -> Path:
    """Where the agent puts its socket: ``/run/ingero`` when ``/run`` is writable (or the directory is
    already the agent's), else the fallback under the home."""
    if os.access(run_dir.parent, os.W_OK):
        return run_dir
    with contextlib.suppress(OSError):
        if run_dir.stat().st_uid == os.geteuid():
            return run_dir
    return FALLBACK_DIR.expanduser()


def socket_candidates() -> list[Path]:
    """Where a client looks for the agent: ``$INGERO_ANNOTATE_SOCKET``, then the two agent places."""
    found = [Path(p) for p in [os.environ.get("INGERO_ANNOTATE_SOCKET", "")] if p]
    return [*found, SOCKET_DIR / SOCKET_NAME, FALLBACK_DIR.expanduser() / SOCKET_NAME]


def connect(path: Path | None = None, *, timeout_s: float = 2.0) -> socket.socket | None:
    """A connected socket to the agent (``path``, else the first candidate that answers), or None."""
    for candidate in [path] if path is not None else socket_candidates():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(candidate))
        except OSError:
            sock.close()
            continue
        return sock
    return None


class _Client:
    """The helper's one connection, shared by the threads of a process; reset in a forked child."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.next_try = 0.0
        self.warned = False
        self.dropped = 0

    def reset(self) -> None:
        self.sock, self.next_try, self.lock = None, 0.0, threading.Lock()

    def send(self, line: AnnotationLine) -> bool:
        data = json.dumps(line.as_wire(), separators=(",", ":")).encode() + b"\n"
        with self.lock:
            if self.sock is None and not self._open():
                self.dropped += 1
                return False
            assert self.sock is not None
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except BlockingIOError:  # the agent is behind: never stall the caller, count the loss
                self.dropped += 1
                return False
            except OSError:  # the agent went away: look for it again later
                self.sock.close()
                self.sock, self.next_try = None, time.monotonic() + _RETRY_S
                self.dropped += 1
                return False
            if sent < len(data):  # a torn line would corrupt the stream: start a fresh connection
                self.sock.close()
                self.sock = None
                self.dropped += 1
                return False
            return True

    def _open(self) -> bool:
        now = time.monotonic()
        if now < self.next_try:
            return False
        self.next_try = now + _RETRY_S
        self.sock = connect(timeout_s=0.5)
        if self.sock is None:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    "ingero.annotate: no agent is listening (run 'ingero trace --annotate'); labels are dropped",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return False
        self.sock.shutdown(socket.SHUT_RD)  # the agent's replies are for CLIs; this helper never reads
        return True


_CLIENT = _Client()
os.register_at_fork(after_in_child=_CLIENT.reset)


def _scope(pid: int | None) -> int:
    return os.getpid() if pid is None else int(pid)


def point(*, pid: int | None = None, **labels: object) -> bool:
    """Mark this moment with ``labels`` (``point(epoch=3)``); True when the agent took the line."""
    try:
        line = AnnotationLine(time.time_ns(), check_labels(labels), _scope(pid))
    except UsageError as e:
        warnings.warn(f"ingero.annotate: {e}", RuntimeWarning, stacklevel=2)
        return False
    return _CLIENT.send(line)


@contextlib.contextmanager
def span(*, pid: int | None = None, **labels: object) -> Iterator[None]:
    """``with span(step=12): ...`` labels the block's time; one line is sent when the block ends."""
    try:
        checked: dict[str, str] | None = check_labels(labels)
    except UsageError as e:
        warnings.warn(f"ingero.annotate: {e}", RuntimeWarning, stacklevel=3)
        checked = None
    start = time.time_ns()
    try:
        yield
    finally:
        if checked is not None:
            end = max(time.time_ns(), start)
            _CLIENT.send(AnnotationLine(start, checked, _scope(pid), span_start=start, span_end=end))


def disconnect() -> None:
    """Close the helper's connection; the next label looks for an agent again at once."""
    with _CLIENT.lock:
        if _CLIENT.sock is not None:
            _CLIENT.sock.close()
        _CLIENT.sock, _CLIENT.next_try, _CLIENT.warned = None, 0.0, False


def dropped() -> int:
    """Lines this process's helper could not hand to an agent (none listening, or it was behind)."""
    return _CLIENT.dropped


__all__ = [
    "MAX_KEY_BYTES",
    "MAX_LABELS",
    "MAX_LINE_BYTES",
    "MAX_VALUE_BYTES",
    "PROTOCOL_VERSION",
    "RATE_PER_CONNECTION",
    "SOCKET_DIR",
    "SOCKET_NAME",
    "AnnotationLine",
    "agent_socket_dir",
    "check_labels",
    "connect",
    "disconnect",
    "dropped",
    "parse_line",
    "point",
    "socket_candidates",
    "span",
]
