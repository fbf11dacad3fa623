"""Per-thread off-CPU intervals, rebuilt from the scheduler rows, and how much of a set of calls they cover.

The evidence model of explain v2: a cause is measured on the same thread and at the same time as the
symptom. ingero's tracer writes one ``sched_switch`` row each time a traced thread gets a CPU back
(``ts`` = back on CPU, ``duration`` = time off it, ``arg0`` = its ``prev_state`` when it left,
``arg1`` = the tid that ran on that CPU before it), and ``sched_wakeup`` rows (``ts`` = woken,
``duration`` = time since it left, ``arg0`` = the waker's tgid). From them every thread gets intervals
of three kinds:

* :data:`INVOL` — involuntary: it left the CPU still runnable (preempted), or it sat in the run queue
  between its wakeup and getting a CPU back while another task held it (a CPU that was idle, or a wait
  under :data:`WAKE_LATENCY_NS`, is the wakeup's own latency: part of the sleep). This, and only this,
  is CPU contention.
* :data:`VOL` — voluntary: it went to sleep itself (S/D: futex, poll, usleep, I/O) until woken. That
  is waiting, not being starved of CPU; the waker says on what (a forked worker, the disk, a peer).
* :data:`IOWAIT` — the voluntary sleeps taken in uninterruptible state (D), usually disk I/O;
* :data:`UNKNOWN` — the recording has no ``prev_state`` (Ingero's databases put the thread's own id in
  ``arg1`` and 0 in ``arg0``): off-CPU, but nobody can say whether preempted or asleep. Where such an
  interval holds a recorded wakeup of the thread (Ingero writes them too, as the waker's event:
  :func:`wakeups`), it was a sleep up to that wakeup — a preempted task stays runnable and is never
  woken — and goes to :data:`VOL` with its waker; only the rest (runnable after the wakeup, waiting for
  a CPU, ``who`` = the waker) and the intervals no wakeup ended (``who`` = :data:`NOT_WOKEN`) stay
  unknown. Without prev_state that rest is not called CPU contention: it is reported as off-CPU time of
  unknown kind, with the missing signal.

Queries are prefix sums over each thread's sorted, non-overlapping intervals: the off-CPU time inside
any set of calls is O(log n) per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ingero.explain.frame import I64, ArgRows
from ingero.store.catalog import op_id
from ingero.timeutil import NS_PER_US

F64 = npt.NDArray[np.float64]

INVOL, VOL, UNKNOWN = "involuntary", "voluntary", "unknown"
IOWAIT = "iowait"  # the voluntary sleeps in uninterruptible state (D: usually disk I/O), also in VOL
KINDS = (INVOL, VOL, UNKNOWN, IOWAIT)
TASK_UNINTERRUPTIBLE = 2
NOT_WOKEN = -1  # an UNKNOWN interval no recorded wakeup ended (its ``who``; else the waker's tgid)
# from a wakeup to the CPU, a wait this short is the wakeup's own latency (the IPI, leaving an idle state,
# the switch: 5-60 µs on an idle host), part of the sleep; a wait for a CPU another task holds is longer
WAKE_LATENCY_NS = 100 * NS_PER_US
SCHED_SWITCH, SCHED_WAKEUP = op_id("sched_switch"), op_id("sched_wakeup")


def is_runnable(state: I64) -> npt.NDArray[np.bool_]:
    """prev_state of a preempted task: TASK_RUNNING (0), or the kernel's "preempted" marker
    (TASK_REPORT_MAX: 0x100 on current kernels) with no sleep bit set."""
    out: npt.NDArray[np.bool_] = (state & 0xFF) == 0
    return out


@dataclass
class Intervals:
    start: I64
    end: I64
    cum: I64  # cum[k] = total length of intervals before k (len = n + 1)
    who: I64  # preemptor tid (INVOL), waker tgid (VOL, 0 = no wakeup seen), waker or NOT_WOKEN (UNKNOWN)

    @classmethod
    def build(cls, start: I64, end: I64, who: I64) -> Intervals:
        order = np.argsort(start, kind="stable")
        s, e, w = start[order], end[order], who[order]
        if s.size > 1:  # keep intervals disjoint (clock jitter between rows): clip each at the next start
            e = np.minimum(e, np.concatenate((s[1:], [np.iinfo(np.int64).max])))
            e = np.maximum(e, s)
        return cls(s, e, np.concatenate(([0], np.cumsum(e - s))), w)

    def before(self, x: I64) -> I64:
        """Total interval time before each instant in ``x``."""
        k = np.searchsorted(self.start, x, side="right") - 1
        kk = np.maximum(k, 0)
        part = np.clip(x - self.start[kk], 0, self.end[kk] - self.start[kk])
        return np.where(k >= 0, self.cum[kk] + part, 0)

    def covered(self, a: I64, b: I64) -> I64:
        return self.before(b) - self.before(a)


def union(a: I64, b: I64) -> tuple[I64, I64]:
    """Union of intervals [a, b) as sorted disjoint intervals."""
    if a.size == 0:
        return a, b
    order = np.argsort(a, kind="stable")
    a, b = a[order], b[order]
    reach = np.maximum.accumulate(b)
    new = np.concatenate(([True], a[1:] > reach[:-1]))
    starts = a[new]
    idx = np.flatnonzero(new)
    ends = reach[np.concatenate((idx[1:] - 1, [a.size - 1]))]
    return starts, ends


def wakeups(args: ArgRows) -> tuple[I64, I64, I64]:
    """Every ``sched_wakeup`` row as (woken tid, time, waker tgid), in either layout.

    ingero's row is the woken thread's (``tid`` = woken, ``arg0`` = the waker's tgid). Ingero's host
    tracer emits the waker's event instead (``pid`` = ``tid`` = the waker, ``arg0`` 0, ``arg1`` = the woken
    thread); its databases are told by their ``sched_switch`` rows, which carry no ``prev_state``
    (``arg1`` = the thread itself)."""
    wk = args.is_op(SCHED_WAKEUP)
    if without_prev_state(args):
        return args.arg1[wk], args.ts_ns[wk], args.pid[wk]
    return args.tid[wk], args.ts_ns[wk], args.arg0[wk]


def without_prev_state(args: ArgRows) -> bool:
    """Whether the rows were written by Ingero's tracer: every ``sched_switch`` row carries the thread
    itself in ``arg1`` and no ``prev_state`` (its wakeup and socket rows have their own layout too)."""
    sw = args.is_op(SCHED_SWITCH)
    return bool(sw.any()) and bool((args.arg1[sw] == args.tid[sw]).all())


def _last_wakeup(tid: I64, start: I64, end: I64, w_tid: I64, w_ts: I64, w_by: I64) -> tuple[I64, I64]:
    """Per off-CPU interval [start, end) of thread ``tid``: the last recorded wakeup of that thread in
    (start, end] — the one that let it run again — and its waker; −1 and :data:`NOT_WOKEN` where none."""
    wake_at = np.full(tid.size, -1, dtype=np.int64)
    waker = np.full(tid.size, NOT_WOKEN, dtype=np.int64)
    for t in np.intersect1d(tid, w_tid).tolist():
        mine = np.flatnonzero(tid == t)
        m = w_tid == t
        order = np.argsort(w_ts[m], kind="stable")
        ws, wb = w_ts[m][order], w_by[m][order]
        k = np.searchsorted(ws, end[mine], side="right") - 1
        kk = np.maximum(k, 0)
        hit = (k >= 0) & (ws[kk] > start[mine])
        wake_at[mine[hit]], waker[mine[hit]] = ws[kk[hit]], wb[kk[hit]]
    return wake_at, waker


class OffCpu:
    """Off-CPU intervals of every thread with scheduler rows in a frame's argument rows."""

    def __init__(self, args: ArgRows) -> None:
        self.threads: dict[str, dict[int, Intervals]] = {k: {} for k in KINDS}
        sw = args.is_op(SCHED_SWITCH)
        tid, end, dur = args.tid[sw], args.ts_ns[sw], args.dur[sw]
        state, prev = args.arg0[sw], args.arg1[sw]
        start = end - dur
        unknown = prev == tid  # Ingero's rows: the thread itself, no state
        self.has_state = bool((~unknown).any())
        self.has_rows = bool(sw.any())
        runnable = is_runnable(state) & ~unknown
        sleep = ~runnable & ~unknown
        # a sleep ended by a wakeup: asleep until woken, then waiting in the run queue for a CPU
        wake_at = np.full(tid.size, -1, dtype=np.int64)
        waker = np.zeros(tid.size, dtype=np.int64)
        w_tid, w_ts, w_by = wakeups(args)
        # threads whose wakeups are recorded: without prev_state their sleeps are still told apart (a
        # sleeping task is woken; a preempted one is not), so their remaining off-CPU time is rarely a sleep
        self.woken: frozenset[int] = frozenset(np.unique(w_tid).tolist())
        if w_tid.size and sleep.any():
            for t in np.unique(w_tid).tolist():
                mine = np.flatnonzero(sleep & (tid == t))
                if mine.size == 0:
                    continue
                order = mine[np.argsort(start[mine], kind="stable")]
                ws = w_ts[w_tid == t]
                k = np.searchsorted(start[order], ws, side="left") - 1  # the sleep that began before it
                earlier = order[np.maximum(k - 1, 0)]  # sleeps overlapping by jitter: the one that ended first
                k = np.where((k >= 1) & (ws <= end[earlier]), k - 1, k)
                ok = (k >= 0) & (ws <= end[order[np.maximum(k, 0)]])
                hit = order[k[ok]]
                wake_at[hit] = ws[ok]
                waker[hit] = w_by[w_tid == t][ok]
        woken = sleep & (wake_at >= 0) & (wake_at < end)
        # in the run queue after the wakeup — unless the CPU was idle (nobody was in the way) or the wait
        # was the wakeup's own latency: then it is part of the sleep
        woken &= (prev != 0) & (end - wake_at >= WAKE_LATENCY_NS)
        inv_s = np.concatenate((start[runnable], wake_at[woken]))
        inv_e = np.concatenate((end[runnable], end[woken]))
        inv_t = np.concatenate((tid[runnable], tid[woken]))
        inv_w = np.concatenate((prev[runnable], prev[woken]))  # the run queue: who had the CPU meanwhile
        vol_e = np.where(woken, wake_at, end)
        self._fill(INVOL, inv_t, inv_s, inv_e, inv_w)
        dsleep = sleep & ((state & TASK_UNINTERRUPTIBLE) != 0)
        self._fill(IOWAIT, tid[dsleep], start[dsleep], vol_e[dsleep], waker[dsleep])
        u_tid, u_start, u_end = tid[unknown], start[unknown], end[unknown]
        wake_u, waker_u = _last_wakeup(u_tid, u_start, u_end, w_tid, w_ts, w_by)
        slept = wake_u >= 0  # no prev_state, but woken: asleep until the wakeup (a runnable task is never woken)
        wake_u = np.where(slept & (u_end - wake_u < WAKE_LATENCY_NS), u_end, wake_u)  # its own latency: asleep
        self._fill(
            VOL,
            np.concatenate((tid[sleep], u_tid[slept])),
            np.concatenate((start[sleep], u_start[slept])),
            np.concatenate((vol_e[sleep], wake_u[slept])),
            np.concatenate((waker[sleep], waker_u[slept])),
        )
        rest = np.where(slept, wake_u, u_start)  # then runnable, waiting for a CPU: still of unknown kind
        left = u_end > rest
        self._fill(UNKNOWN, u_tid[left], rest[left], u_end[left], waker_u[left])

    def _fill(self, kind: str, tid: I64, start: I64, end: I64, who: I64) -> None:
        if tid.size == 0:
            return
        order = np.argsort(tid, kind="stable")
        tid, start, end, who = tid[order], start[order], end[order], who[order]
        bounds = np.flatnonzero(np.diff(tid)) + 1
        for lo, hi in zip(np.concatenate(([0], bounds)), np.concatenate((bounds, [tid.size])), strict=True):
            self.threads[kind][int(tid[lo])] = Intervals.build(start[lo:hi], end[lo:hi], who[lo:hi])

    def covered(self, kind: str, tids: I64, a: I64, b: I64) -> I64:
        """Off-CPU time of ``kind`` of thread ``tids[i]`` inside [a[i], b[i]), per call."""
        out = np.zeros(tids.size, dtype=np.int64)
        threads = self.threads[kind]
        if not threads or tids.size == 0:
            return out
        for t in np.unique(tids).tolist():
            th = threads.get(int(t))
            if th is None:
                continue
            m = tids == t
            out[m] = th.covered(a[m], b[m])
        return out

    def per_bucket(self, kind: str, tids: I64, edges: I64) -> F64:
        """Off-CPU time of ``kind`` of the threads ``tids`` in each bucket between ``edges`` (long
        intervals are spread over the buckets they cover)."""
        out = np.zeros(max(0, edges.size - 1), dtype=np.float64)
        for t in np.unique(tids).tolist():
            th = self.threads[kind].get(int(t))
            if th is not None:
                out += np.diff(th.before(edges)).astype(np.float64)
        return out

    def by_who(self, kind: str, tids: I64, a: I64, b: I64) -> dict[int, int]:
        """Off-CPU time of ``kind`` inside the calls [a, b) of threads ``tids``, per preemptor (INVOL)
        or waker (VOL): who took the CPU, or who ended the wait."""
        out: dict[int, int] = {}
        for t in np.unique(tids).tolist():
            th = self.threads[kind].get(int(t))
            if th is None:
                continue
            m = tids == t
            cs, ce = union(a[m], b[m])
            calls = Intervals(cs, ce, np.concatenate(([0], np.cumsum(ce - cs))), np.zeros(cs.size, dtype=np.int64))
            ov = calls.covered(th.start, th.end)
            hit = ov > 0
            if not hit.any():
                continue
            who, inv = np.unique(th.who[hit], return_inverse=True)
            ns = np.zeros(who.size, dtype=np.int64)
            np.add.at(ns, inv, ov[hit].astype(np.int64))
            for w, n in zip(who.tolist(), ns.tolist(), strict=True):
                out[w] = out.get(w, 0) + n
        return out

    def total(self, kind: str, tids: I64, a: int, b: int) -> int:
        """Off-CPU time of ``kind`` of the threads ``tids`` in [a, b)."""
        u = np.unique(tids)
        return int(self.covered(kind, u, np.full(u.size, a, dtype=np.int64), np.full(u.size, b, dtype=np.int64)).sum())
