"""GPU memory by pointer: allocations matched with their frees, live bytes per process over time.

The tracer records each allocation's returned pointer (``arg1`` of :data:`~ingero.store.catalog.ALLOC_OPS`
rows, read from the out-parameter at return; 0 when the call failed) and each free's pointer
(``arg0`` of :data:`~ingero.store.catalog.FREE_OPS`). A free is matched with the latest allocation of
the same pointer before it in the same process; a free of a pointer allocated before the recording
began (or a second free) subtracts nothing. Live bytes are the running sum: allocated minus freed.

Pure numpy on parallel arrays (:func:`live_series`, :func:`unfreed`), shared by the explain leak rule
(``ingero.explain.rules_leak``) and anyone reading a database (:func:`live_bytes`).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ingero.store.catalog import ALLOC_OPS, FREE_OPS
from ingero.store.window import Window

I64 = npt.NDArray[np.int64]
ALLOC, FREE = 1, -1


@dataclass(frozen=True)
class LiveSeries:
    """Live bytes after each allocation or free, in time order."""

    ts_ns: I64
    live: I64
    allocated: int  # bytes allocated in the series
    freed: int  # bytes of those allocations freed again

    @property
    def size(self) -> int:
        return int(self.ts_ns.size)


def _matched(kind: I64, ptr: I64, ts: I64, size: I64) -> tuple[I64, npt.NDArray[np.bool_]]:
    """(bytes each free releases, which allocations are freed later), both in input order."""
    # by pointer, then time; at equal times the input (recording) order: explain's timestamps are
    # quantized to a microsecond or more, so an allocation freed at once can share its free's time
    order = np.lexsort((ts, ptr))
    k, p, s = kind[order], ptr[order], size[order]
    prev_alloc = np.zeros(order.size, dtype=bool)
    prev_alloc[1:] = (k[1:] == FREE) & (k[:-1] == ALLOC) & (p[1:] == p[:-1])
    released = np.zeros(order.size, dtype=np.int64)
    released[prev_alloc] = s[np.flatnonzero(prev_alloc) - 1]
    freed_alloc = np.zeros(order.size, dtype=bool)
    freed_alloc[np.flatnonzero(prev_alloc) - 1] = True
    out_rel = np.empty_like(released)
    out_rel[order] = released
    out_freed = np.empty_like(freed_alloc)
    out_freed[order] = freed_alloc
    return out_rel, out_freed


def _kept(kind: I64, ptr: I64, ts: I64) -> npt.NDArray[np.bool_]:
    """Rows that count: failed allocations (pointer 0) and nested ones are dropped. An allocation of a
    pointer whose previous row is an allocation of the same pointer is the inner half of one call
    (libcudart's cudaMalloc calls libcuda's cuMemAlloc_v2: both are probed)."""
    order = np.lexsort((ts, ptr))  # ties in input order, as in _matched
    k, p = kind[order], ptr[order]
    nested = np.zeros(order.size, dtype=bool)
    nested[1:] = (k[1:] == ALLOC) & (k[:-1] == ALLOC) & (p[1:] == p[:-1])
    out = np.empty(order.size, dtype=bool)
    out[order] = ~nested
    keep: npt.NDArray[np.bool_] = out & (ptr != 0)
    return keep


def live_series(kind: I64, ptr: I64, ts: I64, size: I64) -> LiveSeries:
    """Live bytes of one process from its allocation (``kind`` ALLOC, ``size`` bytes, ``ptr`` the
    returned pointer, 0 = failed: ignored) and free (``kind`` FREE, ``ptr``) rows, in any order."""
    keep = _kept(kind, ptr, ts)
    kind, ptr, ts, size = kind[keep], ptr[keep], ts[keep], size[keep]
    released, _ = _matched(kind, ptr, ts, size)
    delta = np.where(kind == ALLOC, size, -released)
    order = np.argsort(ts, kind="stable")
    return LiveSeries(ts[order], np.cumsum(delta[order]), int(size[kind == ALLOC].sum()), int(released.sum()))


def unfreed(kind: I64, ptr: I64, ts: I64, size: I64) -> npt.NDArray[np.bool_]:
    """The allocations never freed later (input order; failed and nested ones are not counted)."""
    keep = _kept(kind, ptr, ts)
    freed = np.zeros(kind.size, dtype=bool)
    freed[keep] = _matched(kind[keep], ptr[keep], ts[keep], size[keep])[1]
    out: npt.NDArray[np.bool_] = (kind == ALLOC) & keep & ~freed
    return out


def _op_clause(ops: tuple[tuple[int, int], ...]) -> str:
    return " OR ".join(f"(source = {s} AND op = {o})" for s, o in ops)


def load_rows(
    conn: sqlite3.Connection, pid: int, *, node: str | None = None, window: Window | None = None
) -> tuple[I64, I64, I64, I64, I64]:
    """(kind, ptr, ts, size, stack_hash) of one process's allocation and free rows (in ``window``)."""
    where = f"pid = ? AND (({_op_clause(ALLOC_OPS)}) OR ({_op_clause(FREE_OPS)}))"
    params: list[object] = [pid]
    if node is not None:
        where += " AND node = ?"
        params.append(node)
    if window is not None and not window.unbounded:
        clause, bounds = window.clause()
        where += f" AND {clause}"
        params.extend(bounds)
    free_case = _op_clause(FREE_OPS)
    rows = conn.execute(
        f"SELECT CASE WHEN {free_case} THEN {FREE} ELSE {ALLOC} END, "
        f"CASE WHEN {free_case} THEN arg0 ELSE arg1 END, timestamp, "
        f"CASE WHEN {free_case} THEN 0 ELSE arg0 END, stack_hash FROM events WHERE {where}",
        params,
    ).fetchall()
    a = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    return a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4]


def live_bytes(conn: sqlite3.Connection, pid: int, *, node: str | None = None) -> LiveSeries:
    """Live GPU bytes of process ``pid`` over the recording (see :func:`live_series`)."""
    kind, ptr, ts, size, _ = load_rows(conn, pid, node=node)
    return live_series(kind, ptr, ts, size)
