"""NCCL in the store and on the wire: schema 3 migration, the communicator id, /api/v1/collectives."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import trio

from ingero.fleet.collectives import NodeCalls, analyze
from ingero.identity import Identity
from ingero.store import catalog
from ingero.store.schema import SCHEMA_VERSION, migrate
from ingero.store.writer import StoreWriter
from tests.agent_servers import assert_error_shape, running, settings
from tests.collective_sim import Job, Rank, simulate, write_calls_db

UID = bytes(range(128))


def test_comm_id_folds_every_word_of_the_unique_id() -> None:
    a = catalog.nccl_comm_id(UID)
    assert a == catalog.nccl_comm_id(bytes(UID))  # deterministic
    # ids that share their first 8 bytes (NCCL's bootstrap address) still differ
    other = UID[:127] + b"\xff"
    assert catalog.nccl_comm_id(other) != a
    assert 0 <= a < 1 << 64
    # the fold as documented, written out independently
    h = 0
    for i in range(16):
        h = catalog.splitmix64(h ^ int.from_bytes(UID[8 * i : 8 * i + 8], "little"))
    assert h == a
    assert catalog.splitmix64(0) == 0xE220A8397B1DCDAF  # splitmix64's published first output for seed 0
    with pytest.raises(ValueError):
        catalog.nccl_comm_id(b"short")
    assert catalog.as_sqlite_int(1 << 63) == -(1 << 63) and catalog.as_sqlite_int(-1 & catalog.U64) == -1


def _old_schema_2(path: Path) -> None:
    """A database as schema 2 left it: NCCL rows on source 8, nccl_comms without comm_id."""
    with StoreWriter(path, Identity("n1")) as w:
        w.write_batch([(1000, 7, 7, catalog.NCCL, 1, 500, 0, 4096, 0xC0, 0, 0, 0)])
    conn = sqlite3.connect(path)
    conn.executescript(
        f"""
        DELETE FROM sources WHERE id = 8;
        DELETE FROM ops WHERE source_id = 8;
        UPDATE sources SET id = 8 WHERE id = {catalog.NCCL};
        UPDATE ops SET source_id = 8 WHERE source_id = {catalog.NCCL};
        UPDATE events SET source = 8 WHERE source = {catalog.NCCL};
        UPDATE event_aggregates SET source = 8 WHERE source = {catalog.NCCL};
        DROP TABLE nccl_calls;
        ALTER TABLE nccl_comms DROP COLUMN comm_id;
        INSERT INTO nccl_comms(comm, pid, rank, nranks, node, seen_at) VALUES (192, 7, 1, 2, 'n1', 5);
        INSERT INTO event_aggregates(bucket, source, op, pid, count, stored, sum_dur, min_dur, max_dur, sum_arg0)
            VALUES (0, 8, 1, 7, 1, 1, 500, 500, 500, 4096);
        PRAGMA user_version = 2;
        """
    )
    conn.close()


def test_migration_moves_our_nccl_rows_off_source_8(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    _old_schema_2(db)
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*) FROM events WHERE source = 8").fetchone()[0] == 1
    migrate(conn)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 3
    assert conn.execute("SELECT source, op, arg0 FROM events").fetchall() == [(catalog.NCCL, 1, 4096)]
    assert conn.execute("SELECT DISTINCT source FROM event_aggregates").fetchall() == [(catalog.NCCL,)]
    assert conn.execute("SELECT name FROM sources WHERE id = 8").fetchone()[0] == "CUDA_GRAPH"
    assert conn.execute(
        "SELECT o.name FROM events e JOIN ops o ON o.source_id = e.source AND o.op_id = e.op"
    ).fetchall() == [("ncclAllReduce",)]
    assert conn.execute("SELECT comm, rank, comm_id FROM nccl_comms").fetchall() == [(192, 1, 0)]
    assert conn.execute("SELECT count(*) FROM nccl_calls").fetchone()[0] == 0
    conn.close()


def test_migration_keeps_ingero_source_8_rows(sample_copy: Path) -> None:
    """In Ingero's databases source 8 is CUDA Graph events: they stay where they are."""
    db = sample_copy / "sample-gpu-node-01.db"
    conn = sqlite3.connect(db)
    conn.execute(
        "INSERT INTO events(id, timestamp, pid, tid, source, op, duration, node) "
        "VALUES ('gpu-node-01:graph', 1, 1, 1, 8, 1, 10, 'gpu-node-01')"
    )
    conn.commit()
    migrate(conn)
    assert conn.execute("SELECT count(*) FROM events WHERE source = 8").fetchone()[0] == 1
    assert conn.execute(f"SELECT count(*) FROM events WHERE source = {catalog.NCCL}").fetchone()[0] == 0
    conn.close()


def test_collectives_endpoint_arrays_filter_and_errors(tmp_path: Path, samples: Path) -> None:
    comm_id = 0xF00D_0000_0000_0001  # above 2**63: stored negative, answered as 16 hex digits
    job = Job([Rank("a"), Rank("b", extra_ms=6.0)], steps=50, comm=comm_id)
    sims = simulate(job)
    dbs = []
    for sim in sims:
        db = tmp_path / f"{sim.node}.db"
        write_calls_db(db, sim, unmatched=True)
        dbs.append(db)

    async def main() -> list[NodeCalls]:
        out = []
        for sim, db in zip(sims, dbs, strict=True):
            s = settings(db, tmp_path / "tls", identity=Identity(sim.node))
            async with running(s) as srv:
                body = (await srv.get("/api/v1/collectives")).json()
                assert body["ok"] is True and body["node"] == sim.node
                assert body["comms"] == [{"id": "f00d000000000001", "nranks": 2}]
                assert body["truncated"] is False and body["unmatched"] == 1
                assert body["calls"]["seq"] == list(range(50))
                assert body["calls"]["entry_ns"] == sim.entry_ns.tolist()
                assert set(body["calls"]["rank"]) == {int(sim.rank[0])}
                out.append(NodeCalls.from_body(sim.node, body))
                one = (await srv.get("/api/v1/collectives", params={"comm": "f00d000000000001"})).json()
                assert len(one["calls"]["seq"]) == 50 and one["unmatched"] == 0
                none = (await srv.get("/api/v1/collectives", params={"comm": "1234"})).json()
                assert none["calls"]["seq"] == [] and none["comms"] == []
                window = {"from": str(int(sim.entry_ns[10])), "to": str(int(sim.entry_ns[19]))}
                part = (await srv.get("/api/v1/collectives", params=window)).json()
                assert part["calls"]["seq"] == list(range(10, 20))
                assert_error_shape(await srv.get("/api/v1/collectives", params={"comm": "xyz"}), 400)
                assert_error_shape(await srv.get("/api/v1/collectives", params={"bogus": "1"}), 400)
        s = settings(samples / "sample-gpu-node-01.db", tmp_path / "tls")
        async with running(s) as srv:  # Ingero's database: no NCCL tables, empty arrays
            body = (await srv.get("/api/v1/collectives")).json()
            assert body["ok"] is True and body["comms"] == [] and body["calls"]["seq"] == []
        return out

    got = trio.run(main)
    v = analyze(got)
    assert v.kind == "straggler" and v.node == "b"


def test_writer_replaces_an_entry_record_with_its_return(tmp_path: Path) -> None:
    db = tmp_path / "n.db"
    with StoreWriter(db, Identity("n")) as w:
        w.write_batch(nccl_calls=[(1, 2, 3, 0, 1, 100, -1, 7, 0, 4, 16, -1, 0)])
        w.write_batch(nccl_calls=[(1, 2, 3, 0, 1, 100, 55, 7, 0, 4, 16, -1, 0)])
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT seq, timestamp, duration, node FROM nccl_calls").fetchall() == [(0, 100, 55, "n")]
    conn.close()
    shutil.rmtree(tmp_path / "tls", ignore_errors=True)
