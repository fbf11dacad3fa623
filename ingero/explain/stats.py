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
import numpy.typing as npt

from ingero.store.catalog import GPU_API_SOURCES, HOST, IO, NET, SOURCE_NAMES, TCP, lookup_op, op_name
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
    node: str = ""  # set when computed for one node (explain, merged databases)
    pid: int | None = None  # set when computed per process (explain --per-process)
    stored: int | None = None  # rows the percentiles come from, when selective storage kept fewer than count

    @property
    def tail_ratio(self) -> float:
        return self.p99_ns / self.p50_ns if self.p50_ns > 0 else 0.0

    @property
    def source_name(self) -> str:
        return SOURCE_NAMES.get(self.source, str(self.source))

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
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
        if self.node:
            d["node"] = self.node
        if self.pid is not None:
            d["pid"] = self.pid
        if self.stored is not None and self.stored < self.count:
            d["stored"] = self.stored
            d["sampled"] = True
        return d


def _where(
    window: Window | None, pid: int | None, node: str | None, sources: Iterable[int] | None, op: tuple[int, int] | None
) -> tuple[str, list[Any]]:
    where, params = (window or Window()).clause("timestamp")
    sql_params: list[Any] = list(params)
    if pid is not None:
        where += " AND pid = ?"
        sql_params.append(pid)
    if node is not None:
        where += " AND node = ?"
        sql_params.append(node)
    if sources is not None:
        ids = [int(s) for s in sources]
        where += f" AND source IN ({','.join('?' * len(ids))})"
        sql_params.extend(ids)
    if op is not None:
        where += " AND source = ? AND op = ?"
        sql_params.extend(op)
    return where, sql_params


def op_stats(
    conn: sqlite3.Connection,
    window: Window | None = None,
    *,
    pid: int | None = None,
    sources: Iterable[int] | None = None,
    op: tuple[int, int] | None = None,
    node: str | None = None,
) -> list[OpStats]:
    """Statistics per (source, op) for events in ``window``; most total time first.

    ``node`` restricts to one node of a merged database; without it every row in the window is pooled
    (right for a node's own database; :func:`ingero.explain.engine.explain` keeps nodes apart).
    Rows are packed into one integer each inside SQLite and parsed by numpy (see
    :mod:`ingero.explain.frame`): several times faster than fetching row tuples.
    """
    where, sql_params = _where(window, pid, node, sources, op)
    text = conn.execute(
        "SELECT group_concat((source << 52) | (op << 44) | min(max(duration, 0), 17592186044415)) FROM events "
        f"WHERE {where} AND source BETWEEN 0 AND 15 AND op BETWEEN 0 AND 255",
        sql_params,
    ).fetchone()[0]
    packed = np.fromstring(text, dtype=np.int64, sep=",") if text else np.zeros(0, dtype=np.int64)
    errors = {
        (int(s), int(o)): int(n)
        for s, o, n in conn.execute(
            f"SELECT source, op, count(*) FROM events WHERE {where} AND ret_code != 0 GROUP BY 1, 2", sql_params
        )
    }
    return stats_from_columns(
        (packed >> 52) & 0xF, (packed >> 44) & 0xFF, packed & 17592186044415, errors=errors, node=node or ""
    )


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


# Host-side sources and ops of the summary, from the catalog (one declaration of every id).
HOST_SOURCES = (HOST, IO, TCP, NET)
_SWITCH = lookup_op("sched_switch")
_READ, _WRITE = lookup_op("block_read").op, lookup_op("block_write").op
_HOST = ", ".join(map(str, HOST_SOURCES))
_GPU = ", ".join(map(str, GPU_API_SOURCES))
_SCHED = f"source = {_SWITCH.source} AND op = {_SWITCH.op}"


def host_summary(
    conn: sqlite3.Connection, window: Window | None = None, *, pid: int | None = None, node: str | None = None
) -> HostSummary:
    """Host-side evidence in ``window`` (``node`` restricts to one node of a merged database)."""
    where, sql_params = _where(window, pid, node, None, None)
    row = conn.execute(
        "SELECT"
        f" sum(source IN ({_HOST})), avg(CASE WHEN source IN ({_HOST}) THEN duration END),"
        f" sum({_SCHED}), total(CASE WHEN {_SCHED} THEN duration END),"
        f" sum(source = {IO}), total(CASE WHEN source = {IO} THEN duration END),"
        f" sum(source = {IO} AND op = {_READ}), sum(source = {IO} AND op = {_WRITE}), sum(source = {TCP}),"
        f" sum(source IN ({_GPU})), avg(CASE WHEN source IN ({_GPU}) THEN duration END)"
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


def stats_from_columns(
    source: npt.NDArray[np.int64],
    op: npt.NDArray[np.int64],
    duration: npt.NDArray[np.int64],
    *,
    errors: dict[tuple[int, int], int] | None = None,
    node: str = "",
    pid: int | None = None,
) -> list[OpStats]:
    """OpStats from parallel arrays (the explain engine's frames), most total time first.

    One sort of a packed key (source, op, duration) groups the rows and orders each group's durations.
    Durations are capped at 2^43 ns (as the frames are); sources must be below 16, ops below 256.
    """
    if source.size == 0:
        return []
    packed = (source << 52) | (op << 44) | np.clip(duration, 0, (1 << 43) - 1)
    packed.sort()
    keys = packed >> 44
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(keys)) + 1, [packed.size]))
    dur = (packed & ((1 << 44) - 1)).astype(np.float64)
    errs = errors or {}
    out: list[OpStats] = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        d = dur[lo:hi]
        k = int(keys[lo])
        src, op_id = k >> 8, k & 0xFF
        p50, p95, p99 = _sorted_percentiles(d, (50.0, 95.0, 99.0))
        out.append(
            OpStats(
                source=src,
                op=op_id,
                name=op_name(src, op_id),
                count=int(d.size),
                p50_ns=p50,
                p95_ns=p95,
                p99_ns=p99,
                max_ns=float(d[-1]),
                mean_ns=float(d.mean()),
                total_ns=float(d.sum()),
                errors=errs.get((src, op_id), 0),
                node=node,
                pid=pid,
            )
        )
    out.sort(key=lambda s: s.total_ns, reverse=True)
    return out


def _sorted_percentiles(d: npt.NDArray[np.float64], qs: tuple[float, ...]) -> list[float]:
    """numpy's default (linear) percentiles of an already sorted array, without partitioning it again."""
    n = d.size
    out = []
    for q in qs:
        pos = (n - 1) * q / 100
        lo = int(np.floor(pos))
        hi = min(lo + 1, n - 1)
        out.append(float(d[lo] + (d[hi] - d[lo]) * (pos - lo)))
    return out


def host_summary_from_columns(
    source: npt.NDArray[np.int64], op: npt.NDArray[np.int64], duration: npt.NDArray[np.int64]
) -> HostSummary:
    """The same figures as :func:`host_summary`, from parallel arrays (sources below 16, ops below 256,
    as the frames hold them): two passes, a count and a duration sum per (source, op)."""
    key = (source << 8) | op
    count = np.bincount(key, minlength=16 << 8).reshape(16, 256)
    total = np.bincount(key, weights=duration, minlength=16 << 8).reshape(16, 256)  # exact: integer sums < 2^53
    by_src, ns_by_src = count.sum(axis=1), total.sum(axis=1)
    host_n = int(by_src[list(HOST_SOURCES)].sum())
    gpu_n = int(by_src[list(GPU_API_SOURCES)].sum())
    return HostSummary(
        host_events=host_n,
        host_avg_ns=float(ns_by_src[list(HOST_SOURCES)].sum()) / host_n if host_n else 0.0,
        sched_switch=int(count[_SWITCH.source, _SWITCH.op]),
        offcpu_ns=int(total[_SWITCH.source, _SWITCH.op]),
        block_io=int(by_src[IO]),
        block_io_ns=int(ns_by_src[IO]),
        block_reads=int(count[IO, _READ]),
        block_writes=int(count[IO, _WRITE]),
        tcp_retransmits=int(by_src[TCP]),
        gpu_api_calls=gpu_n,
        gpu_api_avg_ns=float(ns_by_src[list(GPU_API_SOURCES)].sum()) / gpu_n if gpu_n else 0.0,
    )
