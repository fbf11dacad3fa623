"""Store: schema compatibility with Ingero, the writer, read-only opening, migrations."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from ingero.errors import (
    DatabaseNotFoundError,
    InvalidNodeNameError,
    NotADatabaseError,
    SchemaError,
    SchemaTooNewError,
)
from ingero.identity import Identity
from ingero.store import catalog
from ingero.store.db import open_readonly, open_writable, summarize
from ingero.store.schema import SCHEMA_VERSION, inspect_layout
from ingero.store.writer import StoreWriter
from tests.conftest import SEED_QUERY, make_ingero_08, write_db


def _ev(i: int, source: int = 1, op: int = 1, dur: int = 1000, pid: int = 100) -> tuple[int, ...]:
    return (1_775_218_723_000_000_000 + i * 1000, pid, pid, source, op, dur, 0, i, 0, 0, 0, 0)


def _columns(conn: sqlite3.Connection, table: str) -> list[tuple[str, str]]:
    return [(r[1], r[2]) for r in conn.execute(f"PRAGMA table_info({table})")]


def test_schema_matches_ingero_tables_and_columns(tmp_path: Path, samples: Path) -> None:
    ours = open_writable(tmp_path / "ours.db")
    theirs = open_readonly(samples / "sample-cluster.db")
    their_tables = [
        r[0] for r in theirs.execute("SELECT name FROM sqlite_master WHERE type='table' AND name != 'sqlite_sequence'")
    ]
    assert len(their_tables) == 12
    additions = {
        "system_snapshots": [("node", "TEXT")],  # schema 2: snapshots say whose they are
        "cgroup_metadata": [("job_id", "TEXT"), ("seen_at", "INTEGER")],  # schema 4: Slurm job, last seen
        "event_aggregates": [("node", "TEXT")],  # schema 6: whose minute counts they are (and in the key)
    }
    for table in their_tables:
        assert _columns(ours, table) == _columns(theirs, table) + additions.get(table, []), table
    # same source and op ids and names for everything Ingero defines
    assert set(theirs.execute("SELECT id, name FROM sources")) <= set(ours.execute("SELECT id, name FROM sources"))
    their_ops = set(theirs.execute("SELECT source_id, op_id, name FROM ops"))
    assert their_ops <= set(ours.execute("SELECT source_id, op_id, name FROM ops"))
    # NCCL comes after Ingero's ids
    assert ours.execute("SELECT id FROM sources WHERE name = 'NCCL'").fetchone()[0] > max(
        r[0] for r in theirs.execute("SELECT id FROM sources")
    )
    assert ours.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert ours.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_writer_assigns_node_ids_and_stamps_identity(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with StoreWriter(db, Identity("gpu-node-07", rank=3, local_rank=1, world_size=8)) as w:
        assert w.write_batch([_ev(i) for i in range(300)]) == 300  # > one 128-row statement + remainder
    conn = open_readonly(db)
    rows = conn.execute("SELECT id, node, rank, local_rank, world_size FROM events ORDER BY rowid").fetchall()
    assert [r[0] for r in rows[:3]] == ["gpu-node-07:1", "gpu-node-07:2", "gpu-node-07:3"]
    assert rows[-1][0] == "gpu-node-07:300"
    assert {r[1:] for r in rows} == {("gpu-node-07", 3, 1, 8)}
    assert conn.execute("SELECT arg0 FROM events WHERE id = 'gpu-node-07:300'").fetchone()[0] == 299


def test_ids_survive_restarts(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    for _ in range(3):
        with StoreWriter(db, Identity("n1")) as w:
            w.write_batch([_ev(i) for i in range(5)])
    with StoreWriter(db, Identity("n2")) as w:
        w.write_batch([_ev(0)])
    conn = open_readonly(db)
    ids = [r[0] for r in conn.execute("SELECT id FROM events ORDER BY rowid")]
    assert ids == [f"n1:{i}" for i in range(1, 16)] + ["n2:1"]
    assert len(set(ids)) == len(ids)


def test_seq_continues_on_ingero_database_without_node_seq(sample_copy: Path) -> None:
    db = sample_copy / "sample-gpu-node-02.db"
    before = (
        sqlite3.connect(db)
        .execute("SELECT max(CAST(substr(id, 13) AS INTEGER)) FROM events WHERE node = 'gpu-node-02'")
        .fetchone()[0]
    )
    with StoreWriter(db, Identity("gpu-node-02")) as w:
        w.write_batch([_ev(0)])
    conn = open_readonly(db)
    assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 201
    assert conn.execute(f"SELECT count(*) FROM events WHERE id = 'gpu-node-02:{before + 1}'").fetchone()[0] == 1
    assert inspect_layout(conn).kind == "ingero-py"  # migrated in place
    # schema 2 backfilled the one node's snapshots
    assert conn.execute("SELECT DISTINCT node FROM system_snapshots").fetchall() == [("gpu-node-02",)]


def test_batch_writes_everything_in_one_transaction(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with StoreWriter(db, Identity("n1")) as w:
        sid = w.start_session({"gpu_model": "none", "flags": "stack"})
        w.write_batch(
            [_ev(0)],
            stacks=[(42, '["0x1"]', '[{"s":"cudaMalloc","f":"libcudart.so"}]')],
            aggregates=[(60_000_000_000, 1, 1, 100, 10, 1, 5000, 100, 900, 0)],
            snapshots=[(1, 50.0, 10.0, 1000, 0, 0.5)],
            process_names=[(100, "python3", 1)],
            nccl_comms=[(0xDEAD, 100, 2, 8, 5)],
        )
        # aggregates merge: counts add, min/max fold
        w.write_batch([], aggregates=[(60_000_000_000, 1, 1, 100, 5, 5, 1000, 50, 2000, 0)])
        w.end_session(sid, {"events_seen": 15, "events_dropped": 0})
    conn = open_readonly(db)
    assert conn.execute("SELECT count, stored, sum_dur, min_dur, max_dur FROM event_aggregates").fetchone() == (
        15,
        6,
        6000,
        50,
        2000,
    )
    assert conn.execute("SELECT frames FROM stack_traces WHERE hash = 42").fetchone()[0].startswith("[{")
    assert conn.execute("SELECT rank, nranks, node FROM nccl_comms").fetchone() == (2, 8, "n1")
    started, stopped, node = conn.execute("SELECT started_at, stopped_at, node FROM sessions").fetchone()
    assert stopped >= started > 0 and node == "n1"
    assert dict(conn.execute("SELECT key, value FROM session_stats")) == {"events_seen": 15, "events_dropped": 0}


def test_failed_batch_rolls_back(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with StoreWriter(db, Identity("n1")) as w:
        w.write_batch([_ev(0)])
        with pytest.raises(Exception, match=r"t\.db"):
            w.write_batch([_ev(1)], process_names=[(1, None, 0)])  # type: ignore[list-item]  # NOT NULL violation
        w.write_batch([_ev(2)])
    ids = [r[0] for r in open_readonly(db).execute("SELECT id FROM events ORDER BY rowid")]
    assert ids == ["n1:1", "n1:2"]


def test_seed_query_runs_on_ours_and_theirs(tmp_path: Path, samples: Path) -> None:
    db = write_db(tmp_path / "t.db", [_ev(i, source=1 + i % 2 * 2) for i in range(10)], node="gpu-node-09")
    ours = open_readonly(db).execute(SEED_QUERY).fetchall()
    assert ours == [("gpu-node-09", 1, 5, 1.0), ("gpu-node-09", 3, 5, 1.0)]
    theirs = open_readonly(samples / "sample-cluster.db").execute(SEED_QUERY).fetchall()
    assert len(theirs) == 8
    assert theirs[0][:3] == ("gpu-node-01", 3, 99)


def test_readonly_open_leaves_no_files_and_changes_nothing(sample_copy: Path) -> None:
    db = sample_copy / "sample-cluster.db"
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    before = sorted(p.name for p in sample_copy.iterdir())
    conn = open_readonly(db)
    assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 600
    with pytest.raises(sqlite3.OperationalError):
        conn.execute("DELETE FROM events")
    conn.close()
    assert sorted(p.name for p in sample_copy.iterdir()) == before
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


def test_readonly_sees_live_writer(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    with StoreWriter(db, Identity("n1")) as w:
        w.write_batch([_ev(i) for i in range(3)])
        assert Path(str(db) + "-wal").exists()
        conn = open_readonly(db)
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 3
        w.write_batch([_ev(3)])
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 4
        conn.close()


def test_ingero_08_layout_opens_readonly_with_node_column(tmp_path: Path) -> None:
    db = make_ingero_08(
        tmp_path / "old-node-5.db", [(1, 7, 7, 1, 1, 2000, 0, 0), (2, 7, 7, 3, 1, 4000, 0, 0)], sessions=[(1, 2, "")]
    )
    conn = open_readonly(db)
    assert inspect_layout(conn).kind == "ingero-0.8"
    assert conn.execute(SEED_QUERY).fetchall() == [("old-node-5", 1, 1, 2.0), ("old-node-5", 3, 1, 4.0)]
    conn = open_readonly(db, legacy_node="gpu-node-05")
    assert conn.execute("SELECT DISTINCT node, rank FROM events").fetchall() == [("gpu-node-05", None)]
    assert conn.execute("SELECT node FROM sessions").fetchall() == [("gpu-node-05",)]
    with pytest.raises(SchemaError, match="0.8"):
        StoreWriter(db, Identity("n1"))


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "future.db"
    with StoreWriter(db, Identity("n1")) as w:
        w.write_batch([_ev(0)])
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaTooNewError, match="newer"):
        open_readonly(db)
    with pytest.raises(SchemaTooNewError, match="upgrade ingero"):
        StoreWriter(db, Identity("n1"))


def test_bad_paths_give_store_errors(tmp_path: Path) -> None:
    with pytest.raises(DatabaseNotFoundError):
        open_readonly(tmp_path / "missing.db")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(NotADatabaseError):
        open_readonly(junk)
    with pytest.raises(NotADatabaseError):
        open_readonly(tmp_path)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t(x)").connection.commit()
    with pytest.raises(SchemaError, match="no 'events' table"):
        open_readonly(other)


def test_node_names_are_validated() -> None:
    with pytest.raises(InvalidNodeNameError, match="':'"):
        StoreWriter("/nonexistent/never-created.db", Identity("bad:name"))
    for bad in ["", "-lead", "a b", "x" * 64, "quote'd"]:
        with pytest.raises(InvalidNodeNameError):
            StoreWriter("/nonexistent/never-created.db", Identity(bad))


def test_summarize(samples: Path, tmp_path: Path) -> None:
    s = summarize(open_readonly(samples / "sample-cluster.db"))
    assert (s.events, s.chains, s.stacks, s.sessions) == (600, 6, 9, 3)
    assert s.nodes == ["gpu-node-01", "gpu-node-02", "gpu-node-03"]
    assert s.layout == "ingero-0.9" and not s.live
    assert s.first_ns is not None and s.last_ns is not None and s.first_ns < s.last_ns
    db = tmp_path / "live.db"
    with StoreWriter(db, Identity("n1")) as w:
        w.start_session()
        w.write_batch([(__import__("time").time_ns(), 1, 1, 1, 1, 10, 0, 0, 0, 0, 0, 0)])
        assert summarize(open_readonly(db)).live


def test_prune_oldest_keeps_newest(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with StoreWriter(db, Identity("n1")) as w:
        for b in range(10):
            w.write_batch([_ev(b * 2000 + i) for i in range(2000)])
        before = w.size_bytes()
        deleted = w.prune_oldest(before // 2)
        assert deleted > 0
        assert w.size_bytes() <= before // 2
        newest = w.conn.execute("SELECT max(timestamp) FROM events").fetchone()[0]
    assert newest == _ev(19_999)[0]


def test_catalog_lookup() -> None:
    assert catalog.lookup_op("cudaStreamSynchronize").name == "cudaStreamSync"
    assert catalog.lookup_op("CUMEMALLOC_V2") == catalog.OpRef(catalog.DRIVER, 5, "cuMemAlloc")
    assert catalog.lookup_op("ncclAllReduce").source == catalog.NCCL
    assert catalog.op_name(3, 1) == "sched_switch"
    assert catalog.op_name(42, 9) == "42/9"
    with pytest.raises(Exception, match="did you mean cudaMalloc"):
        catalog.lookup_op("cudaMallo")
