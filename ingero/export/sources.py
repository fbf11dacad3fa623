"""Where an export's data comes from: a local database (one node or a merged cluster), or the fleet.

Local (:func:`traces_from_db`): one read-only connection; for each node in the window, a lazy cursor
over its events (the trace writer consumes one node at a time), its process names (per node from a
merged database's ``node_process_names`` when present), its identity (rank, world size) and its causal
chains: the chains stored in the database plus those the explain engine computes, by id; and its serving
engines' series as counter tracks (:mod:`ingero.export.engine_tracks`).

Fleet (:func:`traces_from_fleet`): every agent answers through the fleet client; events are paged
with keyset SQL through ``/api/v1/query`` (the guard caps each answer), chains come from
``/api/v1/chains`` and identity from ``/api/v1/info``. Each node's clock offset, measured concurrently
by the client, is subtracted from its timestamps so that the nodes line up on the client's clock.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ingero.errors import StoreError
from ingero.explain.model import Chain, stored_chains
from ingero.export.engine_tracks import read_tracks
from ingero.export.perfetto import EXPORT_COLUMNS, ExportRow, NodeTrace, iter_rows
from ingero.store.annotations import list_annotations
from ingero.store.db import open_readonly, translate
from ingero.store.window import Window


@dataclass
class LocalExport:
    """An open database and the node traces read from it (close when the trace is written)."""

    conn: sqlite3.Connection
    nodes: list[NodeTrace]
    base_ns: int | None

    def close(self) -> None:
        self.conn.close()


def _cursor(conn: sqlite3.Connection, node: str, window: Window, path: Path) -> Iterator[ExportRow]:
    where, params = window.clause("timestamp")
    try:
        cur = conn.execute(f"SELECT {EXPORT_COLUMNS} FROM events WHERE node = ? AND {where}", [node, *params])
        yield from iter_rows(cur)
    except sqlite3.Error as e:
        raise translate(e, path) from None


def _identity(conn: sqlite3.Connection, node: str) -> tuple[int | None, int | None]:
    for sql in (
        "SELECT rank, world_size FROM sessions WHERE node = ? AND rank IS NOT NULL ORDER BY id DESC LIMIT 1",
        "SELECT rank, world_size FROM events WHERE node = ? AND rank IS NOT NULL LIMIT 1",
    ):
        try:
            row = conn.execute(sql, (node,)).fetchone()
        except sqlite3.OperationalError:
            continue
        if row is not None:
            return row[0], row[1]
    return None, None


def _process_names(conn: sqlite3.Connection, node: str) -> dict[int, str]:
    try:
        per_node = dict(conn.execute("SELECT pid, name FROM node_process_names WHERE node = ?", (node,)).fetchall())
    except sqlite3.OperationalError:
        per_node = {}
    if per_node:
        return {int(k): str(v) for k, v in per_node.items()}
    try:
        return {int(k): str(v) for k, v in conn.execute("SELECT pid, name FROM process_names").fetchall()}
    except sqlite3.OperationalError:
        return {}


def local_chains(conn: sqlite3.Connection, window: Window) -> list[Chain]:
    """Stored chains, plus the engine's computed ones (a computed chain never hides a stored id)."""
    chains = {c.id: c for c in stored_chains(conn, window)}
    from ingero.explain.engine import explain

    for c in explain(conn, window).chains:
        chains.setdefault(c.id, c)
    return list(chains.values())


def traces_from_db(path: str | Path, window: Window | None = None) -> LocalExport:
    """Node traces of a local database (Ingero 0.8/0.9 or ours, one node or merged)."""
    p = Path(path).expanduser()
    window = window or Window()
    conn = open_readonly(p)
    try:
        where, params = window.clause("timestamp")
        nodes = [r[0] for r in conn.execute(f"SELECT DISTINCT node FROM events WHERE {where}", params)]
        first = conn.execute(f"SELECT min(timestamp) FROM events WHERE {where}", params).fetchone()[0]
        chains = local_chains(conn, window)
        marks = list_annotations(conn, window.start_ns, window.end_ns, limit=100_000, overlapping=True)
        tracks = read_tracks(conn, window)
        for other in [c.node for c in chains] + list(tracks):
            if other not in nodes:
                nodes.append(other)
        traces = []
        for node in nodes:
            rank, world = _identity(conn, node)
            traces.append(
                NodeTrace(
                    node=node,
                    rank=rank,
                    world_size=world,
                    first_ns=first,
                    events=_cursor(conn, node, window, p),
                    process_names=_process_names(conn, node),
                    chains=[c for c in chains if c.node == node],
                    annotations=[a for a in marks if a.node == node or (not a.node and len(nodes) == 1)],
                    engine_tracks=tracks.get(node, []),
                )
            )
        traces.sort(key=lambda t: (t.rank if t.rank is not None else 1 << 30, t.node))
    except sqlite3.Error as e:
        conn.close()
        raise translate(e, p) from None
    except StoreError:
        conn.close()
        raise
    except BaseException:
        conn.close()
        raise
    return LocalExport(conn, traces, first)
