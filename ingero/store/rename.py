"""Renaming a node inside a copy of a database: how ``ingero merge`` keeps two recordings that share a name.

Two databases recorded as one node name by distinct instances (cloned VMs that share a hostname; three
recordings made without ``--node``) are not copies of one recording: merged as they are, their rows would
collide under one name (ids ``{node}:{seq}`` repeat) and one of them would be lost. The merge gives the
later one a distinct name (``name@file``) in a temporary copy, then merges the copy; the input itself is
never written.

Every table with a ``node`` column is rewritten, and the node-namespaced ids (``events.id`` =
``{node}:{seq}``, ``causal_chains.id`` = ``{node}:{descriptor}``) with it.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ingero.store.db import translate

# Tables whose ``id`` is namespaced by the node ("{node}:...").
NAMESPACED_IDS = ("events", "causal_chains")


def renamed_copy(src: Path, dst: Path, old: str, new: str) -> Path:
    """Copy ``src`` to ``dst`` (with its WAL, checkpointed into the copy) and rename node ``old`` to ``new``
    in the copy. Returns ``dst``."""
    try:
        source = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
        try:
            conn = sqlite3.connect(dst, isolation_level=None)
            source.backup(conn)
        finally:
            source.close()
    except sqlite3.Error as e:
        dst.unlink(missing_ok=True)
        raise translate(e, src) from None
    try:
        conn.execute("BEGIN IMMEDIATE")
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            cols = {r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')}
            if "node" not in cols:
                continue
            if table in NAMESPACED_IDS and "id" in cols:
                conn.execute(
                    f'UPDATE "{table}" SET node = ?, id = ? || substr(id, ?) WHERE node = ?',
                    (new, new, len(old) + 1, old),
                )
            else:
                conn.execute(f'UPDATE OR IGNORE "{table}" SET node = ? WHERE node = ?', (new, old))
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()
        dst.unlink(missing_ok=True)
        raise translate(e, dst) from None
    conn.close()
    return dst
