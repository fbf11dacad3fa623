"""Recorded-array generator for the collectives join: ranks that really wait for each other.

Each step, every rank computes (its base time + jitter + its extra delay), enters the collective, and
every rank leaves together once the last one is in and the transfer is done. Entry times are written
on each node's own clock (``true + clock_offset``); the measured offset handed to the analysis may
differ from the true one by up to the stated uncertainty. Used by tests/test_collectives.py and
bench/bench_collectives.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ingero.fleet.collectives import NodeCalls
from ingero.identity import Identity
from ingero.store import catalog
from ingero.store.nccl import IN_FLIGHT
from ingero.store.writer import StoreWriter

MS = 1_000_000
T0 = 1_800_000_000 * 1_000_000_000


@dataclass
class Rank:
    node: str
    extra_ms: float = 0.0  # extra compute per step (the straggler's)
    clock_ms: float = 0.0  # the node's clock minus the true time
    measured_ms: float | None = None  # offset the analysis is told (default: the true one)
    uncertainty_ms: float = 0.1
    hang_at: int | None = None  # never enters this call (and stops there)


@dataclass
class Job:
    ranks: list[Rank]
    steps: int = 400
    compute_ms: float = 20.0
    jitter_ms: float = 0.3
    transfer_ms: float = 1.0
    nbytes: int = 64 << 20
    op: int = 1  # ncclAllReduce
    comm: int = 0x9F3A_0000_1234_5678
    seed: int = 1
    drop: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> [lo, hi) seqs missing
    restart_seq_at: dict[int, int] = field(default_factory=dict)  # rank -> seq where its counter restarts


def simulate(job: Job) -> list[NodeCalls]:
    """Arrays per node (one node per rank), as /api/v1/collectives would return them."""
    rng = np.random.default_rng(job.seed)
    n, k = len(job.ranks), job.steps
    compute = job.compute_ms + rng.normal(0.0, job.jitter_ms, size=(k, n)).clip(-job.compute_ms / 2)
    compute += np.array([r.extra_ms for r in job.ranks])[None, :]
    entries = np.zeros((k, n))
    ends = np.zeros(k)
    t = 0.0
    for s in range(k):
        entries[s] = t + compute[s]
        ends[s] = entries[s].max() + job.transfer_ms
        t = ends[s]
    hang = min((r.hang_at for r in job.ranks if r.hang_at is not None), default=None)
    out = []
    for i, r in enumerate(job.ranks):
        steps = np.arange(k)
        dur = (ends - entries[:, i]) * MS
        if hang is not None:
            if r.hang_at is not None:
                steps = steps[steps < hang]
            else:
                steps = steps[steps <= hang]
                dur[hang] = IN_FLIGHT
        lo, hi = job.drop.get(i, (0, 0))
        steps = steps[(steps < lo) | (steps >= hi)]
        seq = steps.copy()
        if i in job.restart_seq_at:
            at = job.restart_seq_at[i]
            seq = np.where(steps >= at, steps - at, steps)
        entry_ns = (T0 + (entries[steps, i] + r.clock_ms) * MS).astype(np.int64)
        measured = r.clock_ms if r.measured_ms is None else r.measured_ms
        out.append(
            NodeCalls(
                node=r.node,
                comm=np.full(steps.size, job.comm, dtype=np.uint64),
                seq=seq.astype(np.int64),
                op=np.full(steps.size, job.op, dtype=np.int64),
                bytes=np.full(steps.size, job.nbytes, dtype=np.int64),
                entry_ns=entry_ns,
                duration_ns=dur[steps].astype(np.int64),
                rank=np.full(steps.size, i, dtype=np.int64),
                nranks={job.comm: n},
                offset_ns=measured * MS,
                uncertainty_ns=r.uncertainty_ms * MS,
            )
        )
    return out


def ranks(names: Sequence[str], **overrides: Rank) -> list[Rank]:
    return [overrides.get(nm, Rank(nm)) for nm in names]


def write_calls_db(db: Path, calls: NodeCalls, *, pid: int = 42, unmatched: bool = False) -> Path:
    """One node's simulated calls written through the real writer (float32 sums, one communicator);
    ``unmatched`` adds a communicator without a cluster-wide id and a call on it."""
    comm_ptr = 0x7F00_0000_1000
    (comm_id,) = calls.nranks
    rows = [
        (pid, pid, comm_ptr, int(s), int(o), int(t), int(d), 7, 0, int(b) // 4, int(b), -1, 0)
        for s, o, t, d, b in zip(calls.seq, calls.op, calls.entry_ns, calls.duration_ns, calls.bytes, strict=True)
    ]
    with StoreWriter(db, Identity(calls.node)) as w:
        w.write_batch(
            nccl_comms=[(comm_ptr, pid, int(calls.rank[0]), calls.nranks[comm_id], 1, catalog.as_sqlite_int(comm_id))],
            nccl_calls=rows,
        )
        if unmatched:
            w.write_batch(
                nccl_comms=[(0xABC, pid, 0, 2, 1)], nccl_calls=[(pid, pid, 0xABC, 0, 1, 5, 9, 7, 0, 1, 4, -1, 0)]
            )
    return db
