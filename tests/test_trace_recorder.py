"""From decoded BPF records to rows: selective storage, aggregates, stacks, names, NCCL communicators.

The records are built in the kernel's layout (``ringbuf.EVENT_DTYPE``); the recorder's output is then
written through the real StoreWriter into a real SQLite file.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from ingero.agent.trace.discovery import read_comm
from ingero.agent.trace.livestats import LiveStats
from ingero.agent.trace.recorder import OP_NCCL_COMM_INIT, Recorder, StoragePolicy, WriteBatch
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.agent.trace.stacks import Symbolizer, stack_hash
from ingero.identity import Identity
from ingero.store.writer import StoreWriter

S = 1_000_000_000
BASE = 1_000 * S  # a CLOCK_MONOTONIC-like start
OFFSET = 1_700_000_000 * S  # wall clock - monotonic


def events(
    n: int, *, source: int, op: int, pid: int = 100, start: int = BASE, step: int = 1000, **cols: object
) -> np.ndarray:
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["ts"] = start + np.arange(n, dtype=np.int64) * step
    ev["source"], ev["op"], ev["pid"], ev["tid"] = source, op, pid, pid
    ev["duration"] = 500
    ev["stack_id"] = -1
    for k, v in cols.items():
        ev[k] = v
    return ev


def recorder(**policy: object) -> Recorder:
    return Recorder(StoragePolicy(**policy), lambda _sid: [], comm_of=lambda pid: f"proc{pid}")  # type: ignore[arg-type]


def test_always_stored_ops_are_stored_and_timestamps_are_wall_clock() -> None:
    rec = recorder()
    batch = rec.process(events(300, source=1, op=1, arg0=4096), OFFSET)
    assert len(batch.events) == 300 == rec.stored == rec.seen
    first = batch.events[0]
    # (timestamp, pid, tid, source, op, duration, gpu_id, arg0, arg1, ret_code, stack_hash, cgroup_id)
    assert first == (BASE + OFFSET, 100, 100, 1, 1, 500, 0, 4096, 0, 0, 0, 0)
    ((bucket, source, op, pid, count, stored, sum_dur, min_dur, max_dur, sum_arg0),) = batch.aggregates
    assert (source, op, pid, count, stored, sum_dur, min_dur, max_dur, sum_arg0) == (
        1,
        1,
        100,
        300,
        300,
        150_000,
        500,
        500,
        300 * 4096,
    )
    assert bucket == (BASE + OFFSET) // (60 * S) * 60 * S


def test_high_rate_ops_are_sampled_but_counted() -> None:
    rec = recorder(budget_per_s=100)
    # 5,000 launches in the first second, 5,000 in the next: stored well under, counted exactly.
    ev = np.concatenate(
        [events(5000, source=4, op=1, step=S // 5000), events(5000, source=4, op=1, start=BASE + S, step=S // 5000)]
    )
    batch = rec.process(ev, OFFSET)
    agg = {(a[0], a[1], a[2]): a for a in batch.aggregates}
    assert sum(a[4] for a in agg.values()) == 10_000
    assert sum(a[5] for a in agg.values()) == len(batch.events) == rec.stored
    per_second = np.bincount([(e[0] - OFFSET - BASE) // S for e in batch.events])
    assert per_second[0] <= 100 + 100 * 6  # budget, then thinning that doubles
    assert 100 <= per_second[1] <= 2 * 100 + 2  # budget + every 50th (previous second's rate / budget)
    # The sample spans the whole second, not just its start.
    second = sorted(e[0] for e in batch.events if e[0] >= BASE + OFFSET + S)
    assert second[-1] - second[0] > 0.9 * S


def test_errors_of_high_rate_ops_are_always_stored() -> None:
    rec = recorder(budget_per_s=10)
    ev = events(1000, source=1, op=3, step=100)
    ev["ret"][500:510] = 98
    batch = rec.process(ev, OFFSET)
    assert sum(1 for e in batch.events if e[9] == 98) == 10


def test_store_all_keeps_everything() -> None:
    rec = recorder(mode="all", budget_per_s=1)
    assert len(rec.process(events(2000, source=4, op=1, step=10), OFFSET).events) == 2000


def test_nccl_communicator_records_become_nccl_comms_rows() -> None:
    rec = recorder()
    ctl = events(2, source=8, op=OP_NCCL_COMM_INIT, pid=7)
    ctl["arg0"] = [0x5300, 0x9100]
    ctl["arg1"] = [(8 << 32) | 3, (2 << 32) | 1]
    coll = events(3, source=8, op=1, pid=7, arg0=4096, arg1=0x5300)
    batch = rec.process(np.concatenate([ctl, coll]), OFFSET)
    assert [(c, p, r, n) for c, p, r, n, *_ in batch.nccl_comms] == [(0x5300, 7, 3, 8), (0x9100, 7, 1, 2)]
    assert len(batch.events) == 3 and rec.seen == 3 and rec.control_records == 2


def test_stacks_are_read_once_hashed_and_symbolized() -> None:
    libc = ctypes.CDLL(None)
    ip = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    assert ip
    reads: list[int] = []

    def stack_ips(sid: int) -> list[int]:
        reads.append(sid)
        return [ip, ip + 1]

    rec = Recorder(StoragePolicy(), stack_ips, symbolizer=Symbolizer())
    pid = os.getpid()
    first = rec.process(events(5, source=1, op=1, pid=pid, stack_id=7), OFFSET)
    again = rec.process(events(5, source=1, op=1, pid=pid, stack_id=7), OFFSET)
    assert reads == [7]  # the kernel map is read once per stack id
    ((h, ips, frames),) = first.stacks
    assert again.stacks == []
    assert h == stack_hash([ip, ip + 1]) and {e[10] for e in first.events + again.events} == {h}
    assert ips == f'["0x{ip:x}","0x{ip + 1:x}"]'
    assert frames.startswith('[{"s":"getpid+0x0","f":"libc.so.6"},{"s":"getpid+0x1"')


def test_process_names_include_preemptors() -> None:
    rec = Recorder(StoragePolicy(), lambda _sid: [])
    me = os.getpid()
    switch = events(1, source=3, op=1, pid=me, arg1=me)
    batch = rec.process(switch, OFFSET)
    assert [(p, n) for p, n, _ in batch.process_names] == [(me, read_comm(me))]
    assert rec.process(switch, OFFSET).process_names == []  # named once


def test_page_allocation_summaries() -> None:
    rec = recorder()
    first = rec.page_alloc_rows({0: (1000, 4_096_000), 42: (10, 40960)}, ts=OFFSET + BASE)
    second = rec.page_alloc_rows({0: (1500, 6_144_000), 42: (10, 40960), 43: (3, 3 * 8192)}, ts=OFFSET + BASE + S)
    assert [e[1:5] + e[7:9] for e in first.events] == [(42, 42, 3, 3, 40960, 10)]
    assert [e[1:9] for e in second.events] == [(43, 43, 3, 3, S, 0, 24576, 3)]  # 42 did not allocate
    assert [(a[3], a[4], a[9]) for a in second.aggregates] == [(0, 500, 2_048_000), (43, 3, 24576)]


def test_batches_write_through_the_real_store(tmp_path: Path) -> None:
    rec = recorder(budget_per_s=50)
    batch = WriteBatch()
    batch.merge(rec.process(events(400, source=4, op=1, step=S // 400), OFFSET))
    batch.merge(rec.process(events(20, source=1, op=5, duration=2_000_000), OFFSET))
    with StoreWriter(tmp_path / "t.db", Identity("n1")) as w:
        w.write_batch(batch.events, aggregates=batch.aggregates, process_names=batch.process_names)  # type: ignore[arg-type]
        total, stored = w.conn.execute(
            "SELECT sum(count), sum(stored) FROM event_aggregates WHERE source = 4"
        ).fetchone()
        rows = w.conn.execute("SELECT count(*) FROM events WHERE source = 4").fetchone()[0]
        assert (total, stored) == (400, rows) and rows < 400
        assert w.conn.execute("SELECT name FROM process_names").fetchall() == [("proc100",)]


def test_live_stats_percentiles_counts_and_flags() -> None:
    live = LiveStats()
    ev = events(1000, source=4, op=1)
    ev["duration"] = np.arange(1, 1001) * 1000
    ev["duration"][-20:] = 50_000_000  # 2 %: the p99 is one of them
    live.add(ev)
    live.add(events(2, source=1, op=1, ret=2))
    live.add_counts(3, 3, 12345)
    lines = {ln.name: ln for ln in live.snapshot(1.0)}
    launch = lines["cuLaunchKernel"]
    assert launch.count == 1000 and launch.rate == 1000.0
    assert launch.p50_ns == pytest.approx(500_500, rel=0.01)
    assert launch.max_ns == 50_000_000 and any("tail" in f for f in launch.flags)
    assert lines["cudaMalloc"].flags == ["2 errors"]
    assert lines["mm_page_alloc"].count == 12345
    assert lines["cuLaunchKernel"].as_dict()["p99_us"] > 900
    assert live.snapshot(1.0)[0].rate == 0.0  # nothing new since the last snapshot
