"""Per-op latency statistics (count, p50/p95/p99, max) over a time window, with numpy.

Shared by ``ingero explain``, the agent's ``/api/v1/ops`` endpoint, ``ingero trace``'s live view and
the fleet straggler verdict.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ingero.store.catalog import SOURCE_NAMES, op_name
from ingero.store.window import Window

_DTYPE = np.dtype([("source", np.int64), ("op", np.int64), ("duration", np.int64), ("err", np.int64)])


@dataclass(frozen=True)
class OpStats:
    source: int
    op: int
    name: str
    count: int
    p50_ns: float
    p95_ns: float
    p99_ns: float
    max_ns: float
    mean_ns: float
    total_ns: float
    errors: int

    @property
    def tail_ratio(self) -> float:
        return self.p99_ns / self.p50_ns if self.p50_ns > 0 else 0.0

    @property
    def source_name(self) -> str:
        return SOURCE_NAMES.get(self.source, str(self.source))

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source_name,
            "source_id": self.source,
            "op": self.name,
            "op_id": self.op,
            "count": self.count,
            "p50_us": round(self.p50_ns / 1000, 3),
            "p95_us": round(self.p95_ns / 1000, 3),
            "p99_us": round(self.p99_ns / 1000, 3),
            "max_us": round(self.max_ns / 1000, 3),
            "mean_us": round(self.mean_ns / 1000, 3),
            "total_ms": round(self.total_ns / 1e6, 3),
            "tail_ratio": round(self.tail_ratio, 2),
            "errors": self.errors,
        }


def op_stats(
    conn: sqlite3.Connection,
    window: Window | None = None,
    *,
    pid: int | None = None,
    sources: Iterable[int] | None = None,
    op: tuple[int, int] | None = None,
) -> list[OpStats]:
    """Statistics per (source, op) for events in ``window``; most total time first."""
    where, params = (window or Window()).clause("timestamp")
    sql_params: list[Any] = list(params)
    if pid is not None:
        where += " AND pid = ?"
        sql_params.append(pid)
    if sources is not None:
        ids = [int(s) for s in sources]
        where += f" AND source IN ({','.join('?' * len(ids))})"
        sql_params.extend(ids)
    if op is not None:
        where += " AND source = ? AND op = ?"
        sql_params.extend(op)
    cur = conn.execute(f"SELECT source, op, duration, ret_code != 0 FROM events WHERE {where}", sql_params)
    arr = np.fromiter(cur, dtype=_DTYPE)
    return stats_from_array(arr)


def stats_from_array(arr: np.ndarray) -> list[OpStats]:
    """Group a structured array (source, op, duration, err) into OpStats."""
    if arr.size == 0:
        return []
    order = np.lexsort((arr["duration"], arr["op"], arr["source"]))
    arr = arr[order]
    keys = arr["source"] * 1_000_000 + arr["op"]
    bounds = np.flatnonzero(np.diff(keys)) + 1
    out: list[OpStats] = []
    for chunk in np.split(arr, bounds):
        d = chunk["duration"].astype(np.float64)  # already sorted within the group
        p50, p95, p99 = np.percentile(d, [50, 95, 99])
        src, op_id = int(chunk["source"][0]), int(chunk["op"][0])
        out.append(
            OpStats(
                source=src,
                op=op_id,
                name=op_name(src, op_id),
                count=int(d.size),
                p50_ns=float(p50),
                p95_ns=float(p95),
                p99_ns=float(p99),
                max_ns=float(d[-1]),
                mean_ns=float(d.mean()),
                total_ns=float(d.sum()),
                errors=int(chunk["err"].sum()),
            )
        )
    out.sort(key=lambda s: s.total_ns, reverse=True)
    return out


@dataclass(frozen=True)
class HostSummary:
    """Host-side evidence in a window: what the straggler verdict and the rules weigh."""

    host_events: int  # HOST + IO + TCP + NET rows
    host_avg_ns: float  # their mean duration (off-CPU time for sched_switch, latency for block I/O)
    sched_switch: int
    offcpu_ns: int
    block_io: int
    block_io_ns: int
    block_reads: int
    block_writes: int
    tcp_retransmits: int
    gpu_api_calls: int  # CUDA + DRIVER + NCCL rows
    gpu_api_avg_ns: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "host_events": self.host_events,
            "host_avg_ms": round(self.host_avg_ns / 1e6, 4),
            "sched_switch": self.sched_switch,
            "offcpu_ms": round(self.offcpu_ns / 1e6, 3),
            "block_io": self.block_io,
            "block_io_ms": round(self.block_io_ns / 1e6, 3),
            "block_reads": self.block_reads,
            "block_writes": self.block_writes,
            "tcp_retransmits": self.tcp_retransmits,
            "gpu_api_calls": self.gpu_api_calls,
            "gpu_api_avg_ms": round(self.gpu_api_avg_ns / 1e6, 4),
        }


def host_summary(conn: sqlite3.Connection, window: Window | None = None, *, pid: int | None = None) -> HostSummary:
    where, params = (window or Window()).clause("timestamp")
    sql_params: list[Any] = list(params)
    if pid is not None:
        where += " AND pid = ?"
        sql_params.append(pid)
    row = conn.execute(
        "SELECT"
        " sum(source IN (3, 5, 6, 7)), avg(CASE WHEN source IN (3, 5, 6, 7) THEN duration END),"
        " sum(source = 3 AND op = 1), total(CASE WHEN source = 3 AND op = 1 THEN duration END),"
        " sum(source = 5), total(CASE WHEN source = 5 THEN duration END),"
        " sum(source = 5 AND op = 1), sum(source = 5 AND op = 2), sum(source = 6),"
        " sum(source IN (1, 4, 8)), avg(CASE WHEN source IN (1, 4, 8) THEN duration END)"
        f" FROM events WHERE {where}",
        sql_params,
    ).fetchone()
    v = [x or 0 for x in row]
    return HostSummary(
        host_events=int(v[0]),
        host_avg_ns=float(v[1]),
        sched_switch=int(v[2]),
        offcpu_ns=int(v[3]),
        block_io=int(v[4]),
        block_io_ns=int(v[5]),
        block_reads=int(v[6]),
        block_writes=int(v[7]),
        tcp_retransmits=int(v[8]),
        gpu_api_calls=int(v[9]),
        gpu_api_avg_ns=float(v[10]),
    )
