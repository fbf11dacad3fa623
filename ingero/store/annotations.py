"""Annotations: a marked moment (a deploy, a config change) in a node's database.

``ingero annotate "deploy v2.3"`` adds one row to ``annotations`` (schema 4). It works while a
tracer records into the same database: the tracer's exclusive lock is a side file (``<db>.lock``,
:mod:`ingero.store.writer_lock`) that only event writers take, so an annotation is one short
``BEGIN IMMEDIATE`` transaction on its own connection; SQLite's WAL serialises it with the tracer's
batches (waiting up to the busy timeout, never failing because the tracer is busy). Explain lists
the annotations of its window and the Perfetto timeline shows them as instant events.

The table has Ingero's layout (its agent 0.17: ``labels`` is a JSON object, with process scope, span
and writer provenance columns) plus ``node``, so Ingero's SQL over annotations runs here and its rows
read here: ours carry ``{"message": ..., "author": ...}``; a row written by Ingero reads as its labels
(``key=value, ...``) with its writer's uid as the author.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ingero.errors import UsageError
from ingero.store.db import write_transaction
from ingero.timeutil import now_ns

MAX_MESSAGE_CHARS = 500
TABLE = "annotations"


@dataclass(frozen=True)
class Annotation:
    id: int
    timestamp: int  # unix nanos
    node: str
    message: str
    author: str

    def as_dict(self) -> dict[str, int | str]:
        return {
            "id": self.id,
            "timestamp": self.timestamp,
            "node": self.node,
            "message": self.message,
            "author": self.author,
        }


def default_author() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def add_annotation(
    db: str | Path, message: str, *, node: str, timestamp: int | None = None, author: str | None = None
) -> Annotation:
    """Write one annotation (creating or migrating the database if needed) and return it."""
    text = " ".join(message.split())
    if not text:
        raise UsageError("an annotation needs a message", hint='e.g. ingero annotate "deploy v2.3"')
    if len(text) > MAX_MESSAGE_CHARS:
        raise UsageError(f"annotation longer than {MAX_MESSAGE_CHARS} characters ({len(text)})")
    ts = now_ns() if timestamp is None else timestamp
    who = default_author() if author is None else author
    path = Path(db).expanduser()
    with write_transaction(path) as conn:
        labels = json.dumps({"message": text, "author": who}, separators=(",", ":"))
        cur = conn.execute(
            f"INSERT INTO {TABLE}(timestamp, labels, node, peer_uid, peer_gid, peer_pid) VALUES (?, ?, ?, ?, ?, ?)",
            (ts, labels, node, os.getuid(), os.getgid(), os.getpid()),
        )
        row_id = int(cur.lastrowid or 0)
    return Annotation(row_id, ts, node, text, who)


def has_annotations(conn: sqlite3.Connection) -> bool:
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)).fetchone()
    return row is not None


def list_annotations(
    conn: sqlite3.Connection, start_ns: int | None = None, end_ns: int | None = None, *, limit: int = 1000
) -> list[Annotation]:
    """Annotations in [start_ns, end_ns] (either open), oldest first; [] for a database without the table."""
    if not has_annotations(conn):
        return []
    lo = -(1 << 63) if start_ns is None else int(start_ns)
    hi = (1 << 63) - 1 if end_ns is None else int(end_ns)
    cols = {r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")}
    node = "node" if "node" in cols else "''"
    rows = conn.execute(
        f"SELECT id, timestamp, {node}, labels, peer_uid FROM {TABLE} WHERE timestamp BETWEEN ? AND ? "
        "ORDER BY timestamp, id LIMIT ?",
        (lo, hi, int(limit)),
    ).fetchall()
    return [Annotation(int(r[0]), int(r[1]), str(r[2]), *_message_author(r[3], int(r[4] or 0))) for r in rows]


def _message_author(labels_json: object, peer_uid: int) -> tuple[str, str]:
    """Our rows' message and author; any other labels (Ingero's) as ``key=value, ...``."""
    try:
        labels = json.loads(str(labels_json))
    except ValueError:
        return str(labels_json), ""
    if not isinstance(labels, dict):
        return str(labels_json), ""
    author = str(labels.pop("author", "") or (f"uid {peer_uid}" if peer_uid else ""))
    message = labels.pop("message", None)
    rest = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
    if message is None:
        return rest, author
    return (f"{message} ({rest})" if rest else str(message)), author


__all__ = ["Annotation", "add_annotation", "default_author", "has_annotations", "list_annotations"]
