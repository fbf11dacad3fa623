"""The breadth ops in every database: new catalog rows reach databases already at the current schema
version when a writer opens them (new ops need no migration), and Ingero's join by name works."""

from __future__ import annotations

from pathlib import Path

from ingero.store.catalog import CUDA_GRAPH, OPS, lookup_op
from ingero.store.db import open_writable


def test_missing_catalog_rows_are_added_on_open(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    conn = open_writable(db)
    conn.execute("DELETE FROM ops WHERE source_id = ? OR (source_id = 1 AND op_id > 8)", (CUDA_GRAPH,))
    n = conn.execute("SELECT count(*) FROM ops").fetchone()[0]
    conn.close()
    assert n < len(OPS)
    conn = open_writable(db)
    try:
        rows = conn.execute("SELECT source_id, op_id, name FROM ops").fetchall()
        assert {(s, o, name) for s, o, name, _ in OPS} <= set(rows)
        ref = lookup_op("cudaGraphLaunch")
        assert conn.execute(
            "SELECT o.name FROM ops o JOIN sources s ON s.id = o.source_id WHERE s.name = 'CUDA_GRAPH' AND o.op_id = ?",
            (ref.op,),
        ).fetchone() == ("graphLaunch",)
    finally:
        conn.close()
