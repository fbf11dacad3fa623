"""The wall-time ledger: where every nanosecond of each GPU thread's wall time went.

For each thread that drives a GPU (a tid with CUDA, driver or NCCL calls), its wall time — from its
first GPU call's start to its last GPU call's end — is split into buckets that add up to it exactly
(integer nanoseconds). Overlapping calls of one thread (asynchronous APIs, clock jitter) are merged
first, so no time is counted twice. The buckets:

============== =====================================================================================
gpu_steady     inside a GPU call, up to its op's steady level (:func:`steady_ns`); time inside an NCCL
               collective counts here whole (a rank waiting for its peers is judged across nodes)
gpu_slow       inside a GPU call beyond its op's steady level: time lost to a slower regime
host_code      in a gap between GPU calls, on-CPU: the thread's own host code (Python, detokenising...)
preempted      in a gap, runnable but off-CPU: preempted, or in the run queue after a wakeup
asleep_workers in a gap, asleep until a process the GPU process forked woke it (DataLoader workers)
asleep_disk    in a gap, asleep in uninterruptible state (D: disk I/O)
asleep_network in a gap, asleep around the thread's own socket calls (waiting on a peer)
asleep_timer   in a gap, asleep until a wakeup from no process (a timer, an interrupt): a chosen sleep
asleep_unknown in a gap, asleep and woken by another process or thread, or no wakeup recorded
offcpu_unknown in a gap, off-CPU of unknown kind: the recording has no prev_state (Ingero's layout)
not_recorded   nothing was recorded (a hole in ``event_aggregates``), or the time of GPU calls that
               were counted but not stored (selective storage), taken out of the gaps
============== =====================================================================================

Where the thread's intervals overlap, the first bucket in this order wins: gpu_slow, gpu_steady,
not_recorded (holes), preempted, asleep_disk, asleep_workers, asleep_network, asleep_timer,
asleep_unknown, offcpu_unknown, host_code (what is left of a gap is on-CPU).

Without prev_state, an off-CPU interval that ends with a recorded ``sched_wakeup`` was asleep until the
wakeup (a runnable task is not woken): that part is classified by its waker; the rest stays
``offcpu_unknown`` — CPU contention is never guessed.

Selective storage: ``event_aggregates`` count every call per minute, stored or not. The duration of
the calls counted but not stored is moved, per minute, from the thread's gaps (its own host code
first) into ``not_recorded``: which gap each unstored call fell in cannot be told at that resolution,
so a bucket's idle part gives up its share of that time (the calls' expected place, were they spread
evenly over the bucket's gaps; rounded up). A busy GPU is still never reported idle: a gap is idle only
where the GPU had nothing queued, and beyond the loop's turnaround (below).

What counts as GPU idle (``LedgerRow.idle_ns``, ``gpu_idle`` in JSON; the chains' lost time): gaps of at
least ``GAP_NS``, judged by :func:`~ingero.explain.ledger_gaps.judge_idle`. After a draining call (a sync,
a blocking copy: :data:`DRAINING`) the GPU had nothing queued: each bucket's time beyond its first
``GAP_NS`` in the gap (the loop's turnaround: dispatch, a handoff, an ordinary preemption) is idle — own
host code beyond twice the loop's median per gap as an incident, and up to it, in gaps the thread never
slept in, as the loop's pace (``LedgerRow.paced_ns``: CPU-bound at every step). After asynchronous
launches the GPU may still run queued work: only the gap's unusual time can be idle, and the sync that
ends the gap says how much was (it returns sooner by what the GPU did in the gap: sync shrinkage); a
gap with no sync after it is never called idle.

A thread's calls are cut into busy stretches, slow time and judged gaps by
:func:`~ingero.explain.ledger_calls.thread_calls`, with each op's steady level from
:func:`~ingero.explain.ledger_calls.steady_ns` (the median of the op's calls on the node plus their noise
band) — one definition, which the ledger per label (:mod:`ingero.explain.by_label`) cuts by too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ingero.explain.frame import I64, ArgRows, Frame
from ingero.explain.ledger_calls import DRAINING, op_keys, steady_levels, steady_ns, thread_calls
from ingero.explain.ledger_gaps import (
    ASLEEP_DISK,
    ASLEEP_NETWORK,
    ASLEEP_TIMER,
    ASLEEP_UNKNOWN,
    ASLEEP_WORKERS,
    BUCKETS,
    GAP_BUCKETS,
    GPU_SLOW,
    GPU_STEADY,
    HOST_CODE,
    IDX,
    NOT_RECORDED,
    OFFCPU_UNKNOWN,
    PREEMPTED,
    TAKE_ORDER,
    ThreadEvidence,
    gap_classes,
    paint,
)
from ingero.explain.offcpu import OffCpu, wakeups
from ingero.explain.sockets import socket_calls
from ingero.explain.storage import MINUTE_NS
from ingero.explain.unstored import Unstored, less_stored, unstored_owner
from ingero.store.catalog import IO, op_id, op_name
from ingero.timeutil import NS_PER_MS, fmt_duration

__all__ = [  # the ledger's public names (the bucket names are declared in ledger_gaps)
    "ASLEEP_DISK",
    "ASLEEP_NETWORK",
    "ASLEEP_TIMER",
    "ASLEEP_UNKNOWN",
    "ASLEEP_WORKERS",
    "BUCKETS",
    "DRAINING",
    "GAP_BUCKETS",
    "GPU_SLOW",
    "GPU_STEADY",
    "HOST_CODE",
    "NOT_RECORDED",
    "OFFCPU_UNKNOWN",
    "PREEMPTED",
    "Ledger",
    "LedgerRow",
    "aggregate",
    "build_ledger",
    "children",
    "describe",
    "steady_ns",
    "thread_evidence",
]

PROCESS_FORK = op_id("process_fork")  # pid = parent, arg1 = child


def children(args: ArgRows, pid: int) -> dict[int, int]:
    """Processes forked by ``pid``, transitively (process_fork: pid = parent, arg1 = child), with the
    time each was forked."""
    m = args.is_op(PROCESS_FORK)
    parent, child, ts = args.pid[m].tolist(), args.arg1[m].tolist(), args.ts_ns[m].tolist()
    kids: dict[int, int] = {}
    frontier = {pid}
    while frontier:
        new = {c: t for p, c, t in zip(parent, child, ts, strict=True) if p in frontier and c not in kids and c != pid}
        kids.update(new)
        frontier = set(new)
    return kids


@dataclass
class LedgerRow:
    """One GPU thread's wall time, bucket by bucket (``sum(buckets) == wall_ns``)."""

    node: str
    pid: int | None
    tid: int | None
    start_ns: int
    end_ns: int
    buckets: dict[str, int]
    calls: int = 0
    idle_ns: dict[str, int] = field(default_factory=dict)  # gap buckets in gaps the GPU certainly idled
    slow_by_op: dict[tuple[int, int], int] = field(default_factory=dict)  # per-call excess, per op
    gap_start: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)  # those gaps
    gap_end: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)
    gap_idle: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)  # their idle ns
    name: str = ""  # the process's name (command line), when recorded
    paced_ns: int = 0  # of idle_ns[host_code]: the loop's own pace (CPU-bound at every step, ledger_gaps.judge_idle)

    @property
    def wall_ns(self) -> int:
        return self.end_ns - self.start_ns if self.tid is not None else sum(self.buckets.values())

    @property
    def gpu_ns(self) -> int:
        return self.buckets[GPU_STEADY] + self.buckets[GPU_SLOW]

    def share(self, bucket: str) -> float:
        w = self.wall_ns
        return self.buckets.get(bucket, 0) / w if w > 0 else 0.0

    def slow_ops(self) -> list[tuple[str, int]]:
        """The slow calls' excess per op name, largest first."""
        return sorted(((op_name(s, o), ns) for (s, o), ns in self.slow_by_op.items()), key=lambda x: -x[1])

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"node": self.node, "pid": self.pid, "name": self.name}
        if self.tid is not None:
            d |= {"tid": self.tid, "start_ns": self.start_ns, "end_ns": self.end_ns, "calls": self.calls}
        d |= {"wall_ns": self.wall_ns, "buckets": dict(self.buckets)}
        return d | ({"gpu_idle": dict(self.idle_ns)} if self.tid is not None else {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LedgerRow:
        """A row back from :meth:`as_dict` (an agent's answer): the figures it carries (not the gaps or
        the per-op excess); buckets it does not name (an older agent's) are 0."""
        buckets = dict.fromkeys(BUCKETS, 0) | {str(b): int(ns) for b, ns in dict(d.get("buckets") or {}).items()}
        tid = d.get("tid")
        start = int(d.get("start_ns") or 0)
        end = int(d.get("end_ns") or start + sum(buckets.values()))
        idle = {str(b): int(ns) for b, ns in dict(d.get("gpu_idle") or {}).items()}
        pid = d.get("pid")
        row = cls(
            str(d.get("node") or ""),
            None if pid is None else int(pid),
            None if tid is None else int(tid),
            start,
            end,
            buckets,
            int(d.get("calls") or 0),
            idle,
        )
        row.name = str(d.get("name") or "")
        return row


def aggregate(rows: list[LedgerRow], *, by_process: bool) -> list[LedgerRow]:
    """Rows summed per (node, pid) or per node: their wall time is the sum of their threads' (thread-time,
    so the buckets still add up to it)."""
    out: dict[tuple[str, int | None], LedgerRow] = {}
    for r in rows:
        key = (r.node, r.pid if by_process else None)
        cur = out.get(key)
        if cur is None:
            out[key] = LedgerRow(r.node, key[1], None, r.start_ns, r.end_ns, dict(r.buckets), r.calls)
            out[key].name = r.name if by_process else ""
            continue
        for b, ns in r.buckets.items():
            cur.buckets[b] += ns
        cur.calls += r.calls
        cur.start_ns, cur.end_ns = min(cur.start_ns, r.start_ns), max(cur.end_ns, r.end_ns)
    return list(out.values())


def _take_unstored(row: LedgerRow, per_minute: npt.NDArray[np.float64], amounts: npt.NDArray[np.float64]) -> int:
    """Move each minute's unstored call time out of the thread's gaps (host code first) into
    not_recorded; returns the time that found no gap to come from."""
    left = 0
    for i in np.flatnonzero(amounts > 0).tolist():
        want = int(amounts[i])
        for b in TAKE_ORDER:
            have = int(per_minute[i, IDX[b]])
            total = row.buckets[b]
            take = min(want, have, total)
            if take <= 0:
                continue
            idle = row.idle_ns.get(b, 0)
            row.buckets[b] -= take
            row.buckets[NOT_RECORDED] += take
            # which of the bucket's gaps the calls fell in is not known: its idle part gives its share
            row.idle_ns[b] = max(0, idle - -(-take * idle // total))
            if b == HOST_CODE:  # the paced part of it gives its share too
                row.paced_ns = min(row.idle_ns[b], max(0, row.paced_ns - -(-take * row.paced_ns // total)))
            want -= take
            if want == 0:
                break
        left += want
    return left


@dataclass
class Ledger:
    """The ledger of one node: a row per GPU thread, and what could not be placed."""

    rows: list[LedgerRow]
    notes: list[str] = field(default_factory=list)
    steady: dict[tuple[int, int], int] = field(default_factory=dict)  # per op: steady_ns's level


def thread_evidence(fr: Frame, off: OffCpu, holes: list[tuple[int, int]] | None = None) -> ThreadEvidence:
    """What the ledger reads beside a node's GPU calls: its off-CPU intervals, wakeups (either layout),
    socket (either layout) and block I/O calls, and the recording's holes."""
    io = fr.source == IO
    net = socket_calls(fr.args)
    h = np.asarray(holes or [], dtype=np.int64).reshape(-1, 2)
    return ThreadEvidence(
        off,
        {
            "wakeup": wakeups(fr.args),
            "net": (net.tid, net.start, net.end),
            "disk": (fr.tid[io], fr.ts_ns[io], fr.ts_ns[io] + fr.dur[io]),
        },
        (h[:, 0], h[:, 1]),
    )


def build_ledger(
    fr: Frame,
    gpu: Frame,
    off: OffCpu,
    *,
    holes: list[tuple[int, int]] | None = None,
    unstored: Unstored | None = None,
    names: dict[int, str] | None = None,
) -> Ledger:
    """The ledger of every GPU thread of one node (``gpu``: its GPU API rows; ``fr``: all its rows)."""
    if gpu.size == 0:
        return Ledger([])
    ev = thread_evidence(fr, off, holes)
    steady, levels = steady_levels(gpu.source, gpu.op, gpu.dur)
    pid, tid, ts, dur, src, op = gpu.pid, gpu.tid, gpu.ts_ns, gpu.dur, gpu.source, gpu.op
    if (pid == pid[0]).all() and (tid == tid[0]).all():  # one thread, the common case: time order only
        cut = np.zeros(0, dtype=np.int64)
        if not (ts[1:] >= ts[:-1]).all():
            order = np.argsort(ts, kind="stable")
            ts, dur, src, op, steady = ts[order], dur[order], src[order], op[order], steady[order]
    else:
        order = np.lexsort((ts, tid, pid))
        pid, tid, ts, dur, src, op, steady = (x[order] for x in (pid, tid, ts, dur, src, op, steady))
        cut = np.flatnonzero((np.diff(pid) != 0) | (np.diff(tid) != 0)) + 1
    end, st = ts + dur, ts + steady
    key = op_keys(src, op)
    kids_of: dict[int, set[int]] = {}
    un = less_stored(unstored or Unstored(), gpu)
    owner = unstored_owner(pid, tid, src, op, un)
    ledger = Ledger([])
    ledger.steady = levels
    for lo, hi in zip(np.concatenate(([0], cut)), np.concatenate((cut, [ts.size])), strict=True):
        p, t = int(pid[lo]), int(tid[lo])
        if p not in kids_of:
            kids_of[p] = set(children(fr.args, p))
        mine = owner == t
        row = _thread_row(
            fr.node,
            p,
            t,
            ts[lo:hi],
            end[lo:hi],
            st[lo:hi],
            src[lo:hi],
            op[lo:hi],
            key[lo:hi],
            ev,
            kids_of[p],
            un.minute[mine],
            un.sum_ns[mine] if mine.any() else None,
        )
        if row is None:
            continue
        if isinstance(row, tuple):
            row, left = row
            if left:
                ledger.notes.append(
                    f"{fr.node}: {left / 1e6:.1f} ms of unstored GPU calls of tid {t} found no gap in their minute "
                    "(calls overlapping stored ones, or a window cutting a minute)"
                )
        row.name = (names or {}).get(p, "")
        ledger.rows.append(row)
    if un.count.size:
        ledger.notes.append(
            f"{fr.node}: {int(un.count.sum()):,} GPU calls were counted but not stored (selective storage): their "
            f"{int(un.sum_ns.sum()) / 1e6:.1f} ms are in the ledger's not_recorded, taken out of the gaps of the "
            "minute they were counted in — event_aggregates are per minute, so which gap each fell in cannot be "
            "told: idle figures in those minutes are upper bounds"
        )
    return ledger


def _thread_row(
    node: str,
    pid: int,
    tid: int,
    ts: I64,
    end: I64,
    steady_end: I64,
    src: I64,
    op: I64,
    key: I64,
    ev: ThreadEvidence,
    kids: set[int],
    un_minute: I64,
    un_ns: I64 | None,
) -> LedgerRow | tuple[LedgerRow, int] | None:
    tc = thread_calls(ts, end, steady_end, key)
    if tc is None:
        return None
    w0, w1 = tc.w0, tc.w1
    busy = int((tc.b_end - tc.b_start).sum())
    slow_ns = int((tc.se - tc.ss).sum())
    buckets = dict.fromkeys(BUCKETS, 0)
    buckets[GPU_STEADY], buckets[GPU_SLOW] = busy - slow_ns, slow_ns
    excess = tc.slow_end - tc.slow_from
    slow_key = (src[tc.slow] << 16) | op[tc.slow]
    by_op: dict[tuple[int, int], int] = {}
    if slow_key.size:
        uk, inv = np.unique(slow_key, return_inverse=True)
        sums = np.bincount(inv, weights=excess.astype(np.float64))
        excess_ns = float(sums.sum())
        for k, v in zip(uk.tolist(), sums.tolist(), strict=True):  # scaled to the merged slow time
            by_op[(k >> 16, k & 0xFFFF)] = round(v / excess_ns * slow_ns) if excess_ns > 0 else 0
    row = LedgerRow(node, pid, tid, w0, w1, buckets, int(ts.size), dict.fromkeys(GAP_BUCKETS, 0), by_op)
    g0, g1, idle = tc.g0, tc.g1, tc.idle
    if g0.size == 0:
        return row
    minutes = None
    if un_ns is not None:
        first = (w0 // MINUTE_NS + 1) * MINUTE_NS
        minutes = np.arange(first, w1, MINUTE_NS, dtype=np.int64)
    painted = paint(
        g0, g1, idle, gap_classes(ev, tid, kids), minutes, drained=tc.drained[:-1], sync=tc.sync, short=tc.short
    )
    total, per_minute, judged = painted.total, painted.per_minute, painted.judged
    in_idle, gap_idle, row.paced_ns = judged.in_idle, judged.gap_idle, judged.paced
    for b in GAP_BUCKETS:
        row.buckets[b] = int(total[IDX[b]])
        row.idle_ns[b] = int(in_idle[IDX[b]])
    keep = tc.drained[:-1][idle] | (gap_idle > 0)  # the gaps the GPU idled in
    row.gap_start, row.gap_end, row.gap_idle = g0[idle][keep], g1[idle][keep], gap_idle[keep]
    if un_ns is None or per_minute is None or minutes is None:
        return row
    amounts = np.zeros(per_minute.shape[0], dtype=np.float64)
    idx = np.searchsorted(minutes, un_minute, side="right")  # the minute's row in per_minute
    inside = (un_minute + MINUTE_NS > w0) & (un_minute < w1)
    np.add.at(amounts, idx[inside], un_ns[inside].astype(np.float64))
    return row, _take_unstored(row, per_minute, amounts)


WORDS = {
    HOST_CODE: "own host code",
    PREEMPTED: "preempted",
    ASLEEP_WORKERS: "asleep (workers)",
    ASLEEP_DISK: "asleep (disk)",
    ASLEEP_NETWORK: "asleep (network)",
    ASLEEP_TIMER: "asleep (timer)",
    ASLEEP_UNKNOWN: "asleep (woken by another task)",
    OFFCPU_UNKNOWN: "off-CPU (kind unknown)",
    NOT_RECORDED: "not recorded",
}


def _pct(ns: int, wall: int) -> str:
    p = 100 * ns / wall
    return f"{p:.0f} %" if p >= 1 or p == 0 else f"{p:.1f} %"


def describe(row: LedgerRow) -> str:
    """'90 s = 62 % GPU calls (3 % slower than steady) + 30 % own host code + 5 % preempted': the buckets
    of at least 0.5 % of the wall time, largest first."""
    wall = max(1, row.wall_ns)
    gpu = f"{_pct(row.gpu_ns, wall)} GPU calls"
    if row.buckets[GPU_SLOW] >= 0.005 * wall:
        gpu += f" ({_pct(row.buckets[GPU_SLOW], wall)} slower than steady)"
    rest = sorted(((ns, b) for b, ns in row.buckets.items() if b in WORDS and ns >= 0.005 * wall), reverse=True)
    shown = [gpu] + [f"{_pct(ns, wall)} {WORDS[b]}" for ns, b in rest]
    return f"{fmt_duration(round(row.wall_ns / NS_PER_MS) * NS_PER_MS)} = " + " + ".join(shown)
