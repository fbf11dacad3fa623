"""Annotations: labels on a node's recording, in Ingero's ``annotations`` table (agent 0.17).

Two kinds of rows share the table. ``ingero annotate "deploy v2.3"`` writes a marked moment as
``{"message": ..., "author": ...}``; the annotation socket (``ingero trace --annotate``,
:mod:`ingero.agent.trace.annotate_socket`) and ``ingero annotate --label``/NDJSON write Ingero's protocol
objects (:mod:`ingero.annotate`): labels, an optional process scope (pid + /proc start time), an
optional span, and the writer's SO_PEERCRED uid/gid/pid as provenance.

The tracer's rows go through its single writer (:meth:`ingero.store.writer.StoreWriter.write_batch`,
``annotations=``, in :data:`ROW_COLUMNS` order). Without a tracer, :func:`write_lines` and
:func:`add_annotation` write one short ``BEGIN IMMEDIATE`` transaction on their own connection: the
tracer's exclusive lock is a side file (``<db>.lock``) only event writers take, and SQLite's WAL
serialises the transaction with the tracer's batches. Explain lists the window's annotations, the
Perfetto timeline shows instants as marks and spans as slices; :mod:`ingero.store.annotation_join`
gives events the labels in force.

The table has Ingero's layout plus ``node``, so Ingero's SQL over annotations runs here and its rows
read here (a row written by Ingero reads as its labels, ``key=value, ...``, with its writer's uid as
the author).
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ingero.annotate import AnnotationLine
from ingero.errors import UsageError
from ingero.store.db import write_transaction
from ingero.timeutil import now_ns

MAX_MESSAGE_CHARS = 500
TABLE = "annotations"
# The columns of one row handed to the writer (``node`` is the writer's own).
ROW_COLUMNS = ("timestamp", "labels", "pid", "start_time", "span_start", "span_end", "peer_uid", "peer_gid", "peer_pid")
AnnotationRow = tuple[int, str, int, int, int, int, int, int, int]


def insert_sql(node_sql: str = "?") -> str:
    """The INSERT of one :data:`ROW_COLUMNS` row plus ``node`` (a literal, or ``?`` for a parameter)."""
    return (
        f"INSERT INTO {TABLE}({', '.join(ROW_COLUMNS)}, node) VALUES ({', '.join('?' * len(ROW_COLUMNS))}, {node_sql})"
    )


def row_of(line: AnnotationLine, peer_uid: int, peer_gid: int, peer_pid: int) -> AnnotationRow:
    labels = json.dumps(line.labels, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return (line.ts, labels, line.pid, line.start_time, line.span_start, line.span_end, peer_uid, peer_gid, peer_pid)


@dataclass(frozen=True)
class Annotation:
    id: int
    timestamp: int  # unix nanos
    node: str
    message: str
    author: str
    labels: dict[str, str] = field(default_factory=dict)
    pid: int = 0  # process scope (0: the whole node)
    span_start: int = 0  # unix nanos; 0 and 0: an instant
    span_end: int = 0
    peer_uid: int = 0

    @property
    def is_span(self) -> bool:
        return bool(self.span_start or self.span_end)

    def as_dict(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "id": self.id,
            "timestamp": self.timestamp,
            "node": self.node,
            "message": self.message,
            "author": self.author,
        }
        if set(self.labels) - {"message", "author"}:  # a protocol row: its labels as they are
            doc["labels"] = self.labels
        if self.pid:
            doc["pid"] = self.pid
        if self.is_span:
            doc["span_start"], doc["span_end"] = self.span_start, self.span_end
        return doc


def default_author() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def add_annotation(
    db: str | Path, message: str, *, node: str, timestamp: int | None = None, author: str | None = None
) -> Annotation:
    """Write one marked moment (creating or migrating the database if needed) and return it."""
    text = " ".join(message.split())
    if not text:
        raise UsageError("an annotation needs a message", hint='e.g. ingero annotate "deploy v2.3"')
    if len(text) > MAX_MESSAGE_CHARS:
        raise UsageError(f"annotation longer than {MAX_MESSAGE_CHARS} characters ({len(text)})")
    ts = now_ns() if timestamp is None else timestamp
    who = default_author() if author is None else author
    line = AnnotationLine(ts, {"message": text, "author": who})
    row_id = write_lines(db, [line], node=node)[0]
    return Annotation(row_id, ts, node, text, who, dict(line.labels))


def write_lines(db: str | Path, lines: Sequence[AnnotationLine], *, node: str) -> list[int]:
    """Protocol lines written in one transaction with this process as the writer; their row ids."""
    path = Path(db).expanduser()
    ids: list[int] = []
    with write_transaction(path) as conn:
        for line in lines:
            cur = conn.execute(insert_sql(), (*row_of(line, os.getuid(), os.getgid(), os.getpid()), node))
            ids.append(int(cur.lastrowid or 0))
    return ids


def has_annotations(conn: sqlite3.Connection) -> bool:
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)).fetchone()
    return row is not None


def list_annotations(
    conn: sqlite3.Connection,
    start_ns: int | None = None,
    end_ns: int | None = None,
    *,
    limit: int = 1000,
    overlapping: bool = False,
) -> list[Annotation]:
    """Annotations in [start_ns, end_ns] (either open), oldest first; [] for a database without the
    table. ``overlapping``: also the spans that started before the window and reach into it."""
    if not has_annotations(conn):
        return []
    lo = -(1 << 63) if start_ns is None else int(start_ns)
    hi = (1 << 63) - 1 if end_ns is None else int(end_ns)
    cols = {r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")}
    node = "node" if "node" in cols else "''"
    where = "timestamp BETWEEN ? AND ?"
    args: tuple[int, ...] = (lo, hi)
    if overlapping:
        where = f"({where} OR (span_end >= ? AND span_start <= ? AND span_start > 0))"
        args = (lo, hi, lo, hi)
    rows = conn.execute(
        f"SELECT id, timestamp, {node}, labels, peer_uid, pid, span_start, span_end FROM {TABLE} WHERE {where} "
        "ORDER BY timestamp, id LIMIT ?",
        (*args, int(limit)),
    ).fetchall()
    out = []
    for r in rows:
        labels = decode_labels(r[3])
        message, author = _message_author(labels, str(r[3]), int(r[4] or 0))
        out.append(
            Annotation(
                int(r[0]), int(r[1]), str(r[2]), message, author, labels, int(r[5] or 0), int(r[6] or 0), int(r[7] or 0)
            )
        )
    return out


def decode_labels(text: object) -> dict[str, str]:
    """A row's labels as strings ({} for a blob that is not a JSON object)."""
    try:
        doc = json.loads(str(text))
    except ValueError:
        return {}
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in doc.items()} if isinstance(doc, dict) else {}


def _message_author(labels: dict[str, str], raw: str, peer_uid: int) -> tuple[str, str]:
    """Our rows' message and author; any other labels (Ingero's) as ``key=value, ...``."""
    if not labels:
        return raw, ""
    rest = dict(labels)
    author = str(rest.pop("author", "") or (f"uid {peer_uid}" if peer_uid else ""))
    message = rest.pop("message", None)
    text = ", ".join(f"{k}={v}" for k, v in sorted(rest.items()))
    if message is None:
        return text, author
    return (f"{message} ({text})" if text else str(message)), author


def format_labels(labels: dict[str, str]) -> str:
    """``k=v k=v`` sorted by key (``-`` for none), as Ingero prints a label set."""
    return " ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"


__all__ = [
    "ROW_COLUMNS",
    "Annotation",
    "AnnotationRow",
    "add_annotation",
    "decode_labels",
    "default_author",
    "format_labels",
    "has_annotations",
    "insert_sql",
    "list_annotations",
    "row_of",
    "write_lines",
]
