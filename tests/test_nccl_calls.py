"""NCCL records to nccl_calls rows: entry records paired with returns, in-flight calls, comm ids."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np

from ingero.agent.trace.recorder import Recorder, StoragePolicy
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.identity import Identity
from ingero.store import catalog
from ingero.store.writer import StoreWriter

OFFSET = 1_700_000_000_000_000_000
COMM = 0x7F00_1234_0000


def records(n: int, **cols: object) -> np.ndarray:
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["pid"], ev["tid"], ev["stack_id"], ev["source"] = 7, 7, -1, catalog.NCCL
    for k, v in cols.items():
        ev[k] = v
    return ev


def entries(ts: list[int], op: int = 1, seq0: int = 0) -> np.ndarray:
    # cpu = op | datatype << 4 | redop << 8: float32 (7), sum (0); ret = peer (-1)
    return records(len(ts), ts=ts, op=catalog.NCCL_CALL_ENTER_OP, arg0=1024, arg1=COMM, ret=-1,
                   cpu=op | 7 << 4, flags=np.arange(seq0, seq0 + len(ts)))  # fmt: skip


def returns(ts: list[int], op: int = 1) -> np.ndarray:
    return records(len(ts), ts=ts, op=op, arg0=4096, arg1=COMM, duration=[500 + t for t in ts])


def recorder() -> Recorder:
    return Recorder(StoragePolicy(), lambda _sid: [], comm_of=lambda pid: f"proc{pid}")


def test_entries_pair_with_returns_and_in_flight_calls_are_written_once(tmp_path: Path) -> None:
    rec = recorder()
    uid = catalog.nccl_comm_id(bytes(range(128)))
    comm = records(1, op=catalog.NCCL_COMM_INIT_OP, arg0=COMM, arg1=(4 << 32) | 2, cgroup_id=uid)
    b1 = rec.process(np.concatenate([comm, entries([10, 20, 30]), returns([10, 20])]), OFFSET)
    assert b1.nccl_comms == [(COMM, 7, 2, 4, OFFSET, catalog.as_sqlite_int(uid))]
    done = [r for r in b1.nccl_calls if r[6] >= 0]
    assert [(r[3], r[5], r[6], r[10]) for r in done] == [(0, OFFSET + 10, 510, 4096), (1, OFFSET + 20, 520, 4096)]
    (flying,) = [r for r in b1.nccl_calls if r[6] < 0]
    assert flying[3] == 2 and flying[6] == -1 and flying[7] == 7 and flying[8] == 0 and flying[9] == 1024
    assert flying[10] == 4096 and flying[11] == -1  # bytes = count × float32 size; no peer
    assert rec.process(entries([], seq0=3), OFFSET).nccl_calls == []  # not written twice
    b3 = rec.process(returns([30]), OFFSET)
    assert [(r[3], r[6]) for r in b3.nccl_calls] == [(2, 530)]
    db = tmp_path / "n.db"
    with StoreWriter(db, Identity("n")) as w:
        for b in (b1, b3):
            w.write_batch(b.events, nccl_comms=b.nccl_comms, nccl_calls=b.nccl_calls)  # type: ignore[arg-type]
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT seq, duration FROM nccl_calls ORDER BY seq").fetchall() == [
        (0, 510),
        (1, 520),
        (2, 530),
    ]
    assert conn.execute("SELECT comm_id FROM nccl_comms").fetchone()[0] == catalog.as_sqlite_int(uid)
    assert conn.execute(f"SELECT count(*) FROM events WHERE source = {catalog.NCCL}").fetchone()[0] == 3
    conn.close()


def test_send_recv_peer_and_no_redop() -> None:
    rec = recorder()
    ent = records(1, ts=[5], op=catalog.NCCL_CALL_ENTER_OP, arg0=10, arg1=COMM, ret=3, cpu=6 | 2 << 4 | 15 << 8)
    b = rec.process(np.concatenate([ent, returns([5], op=6)]), OFFSET)
    (row,) = b.nccl_calls
    assert (row[4], row[7], row[8], row[9], row[11]) == (6, 2, -1, 10, 3)  # ncclSend, int32, no redop, peer 3
    assert rec.nccl.unpaired_returns == 0
    rec.process(returns([99]), OFFSET)
    assert rec.nccl.unpaired_returns == 1
