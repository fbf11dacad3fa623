"""Host-side evidence on a time grid: what happened on the host while a GPU op misbehaved.

(explain v2: the GPU threads' off-CPU time comes from their own intervals, :mod:`ingero.explain.offcpu`,
and only the traced process tree's I/O counts; the grid is for rates and episode windows.)

A node's window is cut into buckets (about one second; fewer, wider ones on long recordings). Each
kind of host evidence becomes a per-bucket series (sched_switch count and off-CPU time of the traced
processes, block I/O count/time/peak/bytes with reads and writes apart, page-allocation bytes, TCP
retransmits, socket I/O, system-snapshot peaks), with cumulative sums so that the evidence for any
run of buckets is O(1). Rules compare a run of buckets (an *episode*: where an op's tail or throughput
drop happened) against the op's other buckets (its *baseline*): evidence counts only when it is more
intense where the trouble is than where it is not.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ingero.explain.frame import I64, Frame, distinct, member
from ingero.explain.offcpu import INVOL, SCHED_SWITCH, UNKNOWN, VOL, OffCpu, is_runnable
from ingero.explain.sockets import socket_calls
from ingero.store.catalog import IO, NET, TCP, op_id
from ingero.timeutil import NS_PER_MS, NS_PER_S

F64 = npt.NDArray[np.float64]
BoolArr = npt.NDArray[np.bool_]

MAX_BUCKETS = 100_000
BLOCK_READ, BLOCK_WRITE, PAGE_ALLOC = op_id("block_read"), op_id("block_write"), op_id("mm_page_alloc")
SECTOR_BYTES = 512  # block I/O arg0 is a sector count (Ingero's convention)


@dataclass(frozen=True)
class Grid:
    start_ns: int
    width_ns: int
    n: int

    @classmethod
    def for_span(cls, first_ns: int, last_ns: int) -> Grid:
        span = max(1, last_ns - first_ns)
        width = NS_PER_S if span >= 10 * NS_PER_S else max(10 * NS_PER_MS, span // 10)
        width = max(width, -(-span // MAX_BUCKETS))
        return cls(first_ns, width, span // width + 1)

    def index(self, ts_ns: I64) -> I64:
        return np.clip((ts_ns - self.start_ns) // self.width_ns, 0, self.n - 1).astype(np.int64)

    def start_of(self, b: int) -> int:
        return self.start_ns + b * self.width_ns

    def end_of(self, b: int) -> int:
        return self.start_ns + (b + 1) * self.width_ns


def _sum(grid: Grid, idx: I64, weights: I64 | F64 | None = None) -> F64:
    return np.bincount(idx, weights=weights, minlength=grid.n).astype(np.float64)


def _cum(x: F64) -> F64:
    return np.concatenate(([0.0], np.cumsum(x)))


# system snapshots: (timestamp, cpu_pct, mem_pct, mem_avail, swap_mb, load_avg) rows, or those rows as
# a float64 array (:func:`snapshot_array`)
SnapRows = list[tuple[int, float, float, int, int, float]] | F64


def snapshot_array(rows: Sequence[Sequence[Any]]) -> F64:
    """Fetched snapshot rows as the float64 array :meth:`Snapshots.from_rows` reads, the same values as
    the typed tuples (mem_avail and swap_mb truncated to integers): no Python conversion per value."""
    arr: F64 = np.asarray(rows, dtype=np.float64).reshape(-1, 6)
    arr[:, 3:5] = np.trunc(arr[:, 3:5])
    return arr


@dataclass
class Snapshots:
    """System snapshots attributed to one node, as per-bucket peaks (NaN: no snapshot)."""

    cpu: F64
    mem: F64
    swap: F64
    avail: F64  # minimum MB available
    load: F64

    @classmethod
    def empty(cls, grid: Grid) -> Snapshots:
        nan = np.full(grid.n, np.nan)
        return cls(nan, nan.copy(), nan.copy(), nan.copy(), nan.copy())

    @classmethod
    def from_rows(cls, grid: Grid, rows: SnapRows) -> Snapshots:
        snap = cls.empty(grid)
        if len(rows) == 0:
            return snap
        arr = np.asarray(rows, dtype=np.float64)
        inside = (arr[:, 0] >= grid.start_ns) & (arr[:, 0] < grid.end_of(grid.n - 1))
        arr = arr[inside]
        if not arr.size:
            return snap
        idx = grid.index(arr[:, 0].astype(np.int64))
        for target, col, fn in (
            (snap.cpu, 1, np.fmax),
            (snap.mem, 2, np.fmax),
            (snap.avail, 3, np.fmin),
            (snap.swap, 4, np.fmax),
            (snap.load, 5, np.fmax),
        ):
            fn.at(target, idx, arr[:, col])
        return snap


def load_snapshots(
    conn: sqlite3.Connection, start_ns: int, end_ns: int
) -> list[tuple[int, float, float, int, int, float]]:
    try:
        cur = conn.execute(
            "SELECT timestamp, cpu_pct, mem_pct, mem_avail, swap_mb, load_avg FROM system_snapshots "
            "WHERE timestamp >= ? AND timestamp <= ? ORDER BY timestamp",
            (start_ns, end_ns),
        )
        return [(int(t), float(c), float(m), int(a), int(s), float(ld)) for t, c, m, a, s, ld in cur]
    except sqlite3.OperationalError:
        return []


@dataclass
class Evidence:
    """Host evidence summed over a set of buckets."""

    span_ns: int
    buckets: int
    sched_n: int = 0
    offcpu_ns: int = 0
    io_n: int = 0
    io_ns: int = 0
    io_max_ns: int = 0
    io_reads: int = 0
    io_writes: int = 0
    io_bytes: int = 0
    page_n: int = 0
    page_bytes: int = 0
    tcp_n: int = 0
    net_n: int = 0
    net_bytes: int = 0
    vol_ns: int = 0  # the GPU threads' voluntary sleeps (waiting, not contention)
    unknown_ns: int = 0  # off-CPU time of unknown kind (recordings without prev_state)
    io_other_n: int = 0  # block I/O of processes outside the traced tree (context)
    tcp_other_n: int = 0  # TCP retransmits with no owner in the traced tree (context)
    # measured on the slow calls themselves (tail episodes): their time, and the GPU thread's off-CPU
    # time inside them by kind
    slow_ns: int = 0
    slow_inv_ns: int = 0
    slow_vol_ns: int = 0
    slow_unk_ns: int = 0
    excess_ns: int = 0  # time lost: the slow calls' excess over the op's steady p50
    io_overlap_ns: int = 0  # the slow calls' time with the traced tree's block I/O in flight
    cpu_max: float | None = None
    mem_max: float | None = None
    swap_max: float | None = None
    avail_min: float | None = None
    load_max: float | None = None

    def frac(self, ns: int) -> float:
        return min(1.0, ns / self.span_ns) if self.span_ns > 0 else 0.0

    @property
    def offcpu_frac(self) -> float:
        return self.frac(self.offcpu_ns)

    @property
    def io_frac(self) -> float:
        return self.frac(self.io_ns)

    def per_s(self, count: int) -> float:
        return count / (self.span_ns / NS_PER_S) if self.span_ns > 0 else 0.0

    @property
    def pressure(self) -> list[str]:
        """System-snapshot conditions that raise a chain's severity."""
        out = []
        if self.cpu_max is not None and self.cpu_max > 90:
            out.append("cpu")
        if self.mem_max is not None and self.mem_max > 95:
            out.append("memory")
        if self.swap_max is not None and self.swap_max > 0:
            out.append("swap")
        return out


def _peak(arr: F64, sel: slice | BoolArr, fn: str) -> float | None:
    part = arr[sel]
    if part.size == 0 or np.all(np.isnan(part)):
        return None
    return float(np.nanmax(part) if fn == "max" else np.nanmin(part))


class RangePeaks:
    """The peaks (NaN = no value) of per-bucket series over any run of buckets in O(1): a sparse table of
    the series' peaks over runs of 1, 2, 4, ... buckets, all series at once (rules ask for hundreds of
    episode windows; each asked of the series themselves is a pass over the run). A trough is asked as
    the peak of the negated series."""

    def __init__(self, rows: F64) -> None:
        self.rows = rows  # a series per row
        self.levels: list[F64] = []  # built on the first question

    def over(self, b0: int, b1: int) -> list[float | None]:
        """Each series' peak over buckets b0..b1 (inclusive, within the series); None where every bucket
        of the run is NaN."""
        if b1 < b0:
            return [None] * self.rows.shape[0]
        if not self.levels:
            self.levels.append(self.rows.T.copy())  # a row per bucket: one question reads two rows
            width = 1
            while 2 * width <= self.rows.shape[1]:
                prev = self.levels[-1]
                self.levels.append(np.fmax(prev[:-width], prev[width:]))
                width *= 2
        j = (b1 - b0 + 1).bit_length() - 1
        lvl = self.levels[j]
        return [None if math.isnan(v) else v for v in np.fmax(lvl[b0], lvl[b1 - (1 << j) + 1]).tolist()]


# the per-bucket series summed over runs of buckets, and the Evidence field each sum fills (kept as
# cumulative sums: O(1) sums over any run of buckets)
_SUMMED = {
    "sched_n": "sched_n",
    "offcpu": "offcpu_ns",
    "io_n": "io_n",
    "io_ns": "io_ns",
    "io_reads": "io_reads",
    "io_writes": "io_writes",
    "io_bytes": "io_bytes",
    "page_n": "page_n",
    "page_bytes": "page_bytes",
    "tcp_n": "tcp_n",
    "net_n": "net_n",
    "net_bytes": "net_bytes",
    "vol": "vol_ns",
    "unknown": "unknown_ns",
    "io_other_n": "io_other_n",
    "tcp_other_n": "tcp_other_n",
}


class HostSeries:
    """Per-bucket host evidence of one node for a set of traced processes (the GPU callers).

    Off-CPU time is the GPU threads' own *involuntary* off-CPU time (preempted, or runnable in the run
    queue), spread over the buckets it covers (:mod:`ingero.explain.offcpu`); voluntary sleeps are kept
    apart (``vol``). Block I/O, TCP retransmits and socket I/O count only when issued by the traced
    process tree (``tree``: the GPU processes and the children they forked); the rest of the host's
    activity (other processes, softirq retransmits with no owner, the agent itself) is context
    (``io_other_n``, ``tcp_other_n``), never a cause.
    """

    def __init__(
        self,
        frame: Frame,
        grid: Grid,
        traced_pids: I64,
        snapshots: Snapshots,
        offcpu: OffCpu | None = None,
        tids: I64 | None = None,
        tree: I64 | None = None,
    ) -> None:
        self.grid = grid
        self.snap = snapshots
        offcpu = offcpu or OffCpu(frame.args)
        if tids is None:
            tids = distinct(frame.tid[frame.gpu_mask() & member(frame.pid, traced_pids)])
        tree = traced_pids if tree is None else tree
        edges = grid.start_ns + np.arange(grid.n + 1, dtype=np.int64) * grid.width_ns
        sched = frame.is_op(*SCHED_SWITCH) & member(frame.tid, tids)
        a = frame.args
        inv = a.is_op(SCHED_SWITCH) & member(a.tid, tids) & (a.arg1 != a.tid) & is_runnable(a.arg0)
        self.sched_n = (
            _sum(grid, grid.index(a.ts_ns[inv])) if offcpu.has_state else _sum(grid, grid.index(frame.ts_ns[sched]))
        )
        self.offcpu = offcpu.per_bucket(INVOL, tids, edges)
        self.vol = offcpu.per_bucket(VOL, tids, edges)
        self.unknown = offcpu.per_bucket(UNKNOWN, tids, edges)
        mine = member(frame.pid, tree)
        io_all = frame.source == IO
        self.io_other_n = _sum(grid, grid.index(frame.ts_ns[io_all & ~mine]))
        self.tcp_other_n = _sum(grid, grid.index(frame.ts_ns[(frame.source == TCP) & ~mine]))
        io = io_all & mine
        idx = grid.index(frame.ts_ns[io])
        self.io_n = _sum(grid, idx)
        self.io_ns = _sum(grid, idx, frame.dur[io])
        self.io_max = np.zeros(grid.n)
        np.maximum.at(self.io_max, idx, frame.dur[io].astype(np.float64))
        self.io_reads = _sum(grid, idx, (frame.op[io] == BLOCK_READ[1]).astype(np.float64))
        self.io_writes = _sum(grid, idx, (frame.op[io] == BLOCK_WRITE[1]).astype(np.float64))
        args = frame.args
        amine = member(args.pid, tree)
        aio = (args.source == IO) & amine
        self.io_bytes = _sum(grid, grid.index(args.ts_ns[aio]), args.arg0[aio].astype(np.float64) * SECTOR_BYTES)
        page = args.is_op(PAGE_ALLOC)
        pidx = grid.index(args.ts_ns[page])
        self.page_n = _sum(grid, pidx)
        self.page_bytes = _sum(grid, pidx, args.arg0[page].astype(np.float64))
        self.tcp_n = _sum(grid, grid.index(frame.ts_ns[(frame.source == TCP) & mine]))
        sock = socket_calls(args)  # either layout: Ingero's rows hold the fd in arg0, the bytes in arg1
        mine_net = amine[args.source == NET]
        nidx = grid.index(sock.start[mine_net])
        self.net_n = _sum(grid, nidx)
        self.net_bytes = _sum(grid, nidx, np.abs(sock.nbytes[mine_net]).astype(np.float64))
        self._cum2d = np.stack([_cum(getattr(self, name)) for name in _SUMMED], axis=1)  # a row per bucket edge
        snap = self.snap
        # cpu, mem, swap, -avail (its minimum is the peak of its negation), load, io_max
        self._peaks = RangePeaks(np.stack([snap.cpu, snap.mem, snap.swap, -snap.avail, snap.load, self.io_max]))

    def over_range(self, b0: int, b1: int) -> Evidence:
        """Evidence in buckets b0..b1 (inclusive, clipped to the grid): O(1), from the cumulative sums
        and the peaks' sparse tables."""
        b0, b1 = max(0, b0), min(self.grid.n - 1, b1)
        sums = np.rint(self._cum2d[b1 + 1] - self._cum2d[b0]).astype(np.int64).tolist()
        cpu, mem, swap, neg_avail, load, io_max = self._peaks.over(b0, b1)
        return Evidence(
            span_ns=(b1 - b0 + 1) * self.grid.width_ns,
            buckets=b1 - b0 + 1,
            io_max_ns=int(max(io_max or 0.0, 0.0)),
            cpu_max=cpu,
            mem_max=mem,
            swap_max=swap,
            avail_min=None if neg_avail is None else -neg_avail,
            load_max=load,
            **dict(zip(_SUMMED.values(), sums, strict=True)),
        )

    def over_mask(self, mask: BoolArr) -> Evidence | None:
        """Evidence summed over the buckets in ``mask`` (None when it selects no bucket)."""
        n = int(mask.sum())
        if n == 0:
            return None

        return Evidence(
            span_ns=n * self.grid.width_ns,
            buckets=n,
            io_max_ns=int(self.io_max[mask].max(initial=0)),
            cpu_max=_peak(self.snap.cpu, mask, "max"),
            mem_max=_peak(self.snap.mem, mask, "max"),
            swap_max=_peak(self.snap.swap, mask, "max"),
            avail_min=_peak(self.snap.avail, mask, "min"),
            load_max=_peak(self.snap.load, mask, "max"),
            **{field: round(float(getattr(self, name)[mask].sum())) for name, field in _SUMMED.items()},
        )


def runs(mask: BoolArr, max_gap: int = 1) -> list[tuple[int, int]]:
    """Runs of True in ``mask`` as (first, last) bucket pairs, joining runs separated by ≤ max_gap buckets."""
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) > max_gap + 1)
    starts = np.concatenate(([idx[0]], idx[breaks + 1]))
    ends = np.concatenate((idx[breaks], [idx[-1]]))
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]
