"""Selective storage's other half: the GPU calls ``event_aggregates`` counted but the store did not keep.

Per (minute, pid, source, op) how many and their total duration — the aggregates' sum less the stored
rows' — and the thread each row's calls are charged to. The ledger (:mod:`ingero.explain.ledger`) moves
that time out of the thread's gaps of the minute into ``not_recorded``.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field

import numpy as np

from ingero.explain.frame import GPU_SOURCES, I64, Frame
from ingero.explain.storage import MINUTE_NS, aggregates_where
from ingero.store.window import Window

__all__ = ["Unstored", "less_stored", "load_unstored", "unstored_owner"]


@dataclass
class Unstored:
    """GPU calls counted in ``event_aggregates`` but not stored: per (minute, pid, source, op), how
    many and their total duration (from the aggregates' sum minus the stored rows' durations)."""

    minute: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pid: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    source: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    op: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    count: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sum_ns: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def load_unstored(
    conn: sqlite3.Connection, window: Window, pid: int | None = None, node: str | None = None
) -> Unstored:
    """The aggregates' rows of GPU ops with calls not stored (none for an older or foreign recording);
    ``node``: the node's own (:func:`~ingero.explain.storage.aggregate_scopes`)."""
    where, sql_params = aggregates_where(window, pid, node)
    try:
        rows = conn.execute(
            "SELECT bucket, pid, source, op, count - stored, sum_dur FROM event_aggregates "
            f"WHERE {where} AND stored < count AND source IN ({', '.join(map(str, GPU_SOURCES))})",
            sql_params,
        ).fetchall()
    except sqlite3.OperationalError:
        return Unstored()
    if not rows:
        return Unstored()
    a = np.asarray(rows, dtype=np.int64).reshape(-1, 6)
    return Unstored(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5])


def less_stored(un: Unstored, gpu: Frame) -> Unstored:
    """``un`` with each row's duration less that of its stored rows (the aggregates' sum counts both)."""
    if un.count.size == 0:
        return un
    m0 = int(un.minute.min()) // MINUTE_NS

    def key(minute: I64, pid: I64, src: I64, op: I64) -> I64:
        k: I64 = ((minute // MINUTE_NS - m0) << 40) | ((pid & 0xFFFFFFF) << 12) | ((src & 0xF) << 8) | (op & 0xFF)
        return k

    gk = key(gpu.ts_ns, gpu.pid, gpu.source, gpu.op)
    uk, inv = np.unique(gk, return_inverse=True)
    sums = np.bincount(inv, weights=gpu.dur.astype(np.float64))
    ak = key(un.minute, un.pid, un.source, un.op)
    i = np.minimum(np.searchsorted(uk, ak), max(0, uk.size - 1))
    stored = np.where((uk.size > 0) & (uk[i] == ak), sums[i] if uk.size else 0.0, 0.0)
    left = np.maximum(0, un.sum_ns - np.rint(stored).astype(np.int64))
    return Unstored(un.minute, un.pid, un.source, un.op, un.count, left)


def unstored_owner(pid: I64, tid: I64, src: I64, op: I64, un: Unstored) -> I64:
    """For each aggregates row, the thread its unstored calls are charged to: the pid's thread with the
    most stored calls of that op (else of any GPU op); -1 when the pid has no stored GPU call here."""
    out = np.full(un.count.size, -1, dtype=np.int64)
    owners: dict[tuple[int, int, int], int] = {}  # per (pid, source, op): the aggregates repeat them per minute
    for i, key in enumerate(zip(un.pid.tolist(), un.source.tolist(), un.op.tolist(), strict=True)):
        if key not in owners:
            p, s, o = key
            m = pid == p
            same = m & (src == s) & (op == o)
            cand = tid[same] if same.any() else tid[m]
            vals, counts = np.unique(cand, return_counts=True)
            owners[key] = int(vals[np.argmax(counts)]) if vals.size else -1
        out[i] = owners[key]
    return out
