"""The DDL creates exactly the columns declared once in ingero.store.columns, and every consumer derives them."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ingero.store import columns
from ingero.store.db import open_writable
from ingero.store.merge import CHAIN_COLUMNS, EVENT_COLUMNS
from ingero.store.writer import CHAIN_FIELDS, EVENT_FIELDS


def _table_columns(conn: sqlite3.Connection, table: str) -> tuple[str, ...]:
    return tuple(r[1] for r in conn.execute(f"PRAGMA table_info({table})"))


def test_ddl_matches_the_declaration(tmp_path: Path) -> None:
    conn = open_writable(tmp_path / "t.db")
    try:
        assert _table_columns(conn, "events") == columns.names(columns.EVENTS)
        assert _table_columns(conn, "causal_chains") == columns.names(columns.CHAINS)
    finally:
        conn.close()


def test_ingero_sample_has_the_declared_columns(samples: Path) -> None:
    conn = sqlite3.connect(f"file:{samples / 'sample-gpu-node-01.db'}?mode=ro&immutable=1", uri=True)
    try:
        assert set(columns.names(columns.EVENTS)) <= set(_table_columns(conn, "events"))
        assert set(columns.names(columns.CHAINS)) <= set(_table_columns(conn, "causal_chains"))
    finally:
        conn.close()


def test_consumers_derive_from_the_declaration() -> None:
    assert EVENT_FIELDS == columns.EVENT_FIELDS
    assert CHAIN_FIELDS == columns.CHAIN_FIELDS
    assert [c for c, _ in EVENT_COLUMNS] == [n for n in columns.names(columns.EVENTS) if n not in ("id", "node")]
    assert [c for c, _ in CHAIN_COLUMNS] == [n for n in columns.names(columns.CHAINS) if n not in ("id", "node")]
