"""How the time of a GPU thread's gaps splits by what the thread did: the ledger's bucket names, and
the classification of its off-CPU intervals (:mod:`ingero.explain.offcpu`), wakeups, socket calls and
block I/O into them, painted over the gaps with exact integer sums (see :mod:`ingero.explain.ledger`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ingero.explain.frame import I64, distinct
from ingero.explain.offcpu import INVOL, IOWAIT, NOT_WOKEN, UNKNOWN, VOL, Intervals, OffCpu, union
from ingero.store.catalog import op_ids
from ingero.timeutil import NS_PER_MS

BUCKETS = (
    "gpu_steady",
    "gpu_slow",
    "host_code",
    "preempted",
    "asleep_workers",
    "asleep_disk",
    "asleep_network",
    "asleep_timer",
    "asleep_unknown",
    "offcpu_unknown",
    "not_recorded",
)
(
    GPU_STEADY,
    GPU_SLOW,
    HOST_CODE,
    PREEMPTED,
    ASLEEP_WORKERS,
    ASLEEP_DISK,
    ASLEEP_NETWORK,
    ASLEEP_TIMER,
    ASLEEP_UNKNOWN,
    OFFCPU_UNKNOWN,
    NOT_RECORDED,
) = BUCKETS
GAP_BUCKETS = BUCKETS[2:]
IDX = {b: i for i, b in enumerate(BUCKETS)}
# gap classes, strongest first (host_code is what no class covers)
_GAP_ORDER = (
    NOT_RECORDED,
    PREEMPTED,
    ASLEEP_DISK,
    ASLEEP_WORKERS,
    ASLEEP_NETWORK,
    ASLEEP_TIMER,
    ASLEEP_UNKNOWN,
    OFFCPU_UNKNOWN,
)
# where the time of unstored GPU calls is taken from: the thread is on-CPU when it makes a call
TAKE_ORDER = (
    HOST_CODE,
    ASLEEP_UNKNOWN,
    ASLEEP_TIMER,
    OFFCPU_UNKNOWN,
    ASLEEP_NETWORK,
    ASLEEP_WORKERS,
    ASLEEP_DISK,
    PREEMPTED,
)

GAP_NS = NS_PER_MS  # shorter gaps, and this much of each bucket in a gap (turnaround), are not idle to the chains
TURNAROUND_X = 2.0  # own host code in a gap beyond this many times the loop's median per gap is idle
NET_NEAR_NS = NS_PER_MS  # a sleep this close to the thread's own socket call is a wait on the network


SLEEPS = (ASLEEP_WORKERS, ASLEEP_DISK, ASLEEP_NETWORK, ASLEEP_TIMER, ASLEEP_UNKNOWN, OFFCPU_UNKNOWN)
_STEP_ENDS = np.zeros(1 << 12, dtype=bool)  # by (source & 0xF) << 8 | (op & 0xFF): the syncs that end a loop's step
_STEP_ENDS[
    [
        (s & 0xF) << 8 | (o & 0xFF)
        for s, o in op_ids("cudaStreamSync", "cudaDeviceSync", "cudaEventSynchronize", "cuCtxSynchronize")
    ]
] = True
SLEEP_FREE_NS = NS_PER_MS // 4  # a gap with less sleep than this (scheduler ticks) is on-CPU throughout
MIN_REF = 5  # a sync's steady level after quick host gaps needs this many of them (else: unknown, not idle)


@dataclass
class Judged:
    """What :func:`judge_idle` counts as GPU idle: per gap bucket (exact ns), per judged gap, and the
    part of the idle own host code that is the loop's pace (within its usual time per gap, beyond the
    turnaround: CPU-bound at every step)."""

    in_idle: I64
    gap_idle: npt.NDArray[np.float64]
    paced: int
    per_gap: npt.NDArray[np.float64] | None = None  # with ``detail``: per bucket (rows), each gap's idle


def judge_idle(
    per: npt.NDArray[np.float64],
    drained: npt.NDArray[np.bool_],
    sync_ns: I64,
    sync_key: I64,
    sleeps: bool = True,
    short: I64 | None = None,
    detail: bool = False,
) -> Judged:
    """How much of each judged gap the GPU idled, per bucket (``per``: rows BUCKETS, a column per gap).

    * Each bucket's first ``GAP_NS`` in a gap is the loop's turnaround (dispatching the next step, a
      handoff, an ordinary preemption): never idle.
    * After a draining call (``drained``) the GPU had nothing queued: the rest is idle — own host code
      beyond twice the loop's usual time per gap (its median over every gap after a sync, the ``short``
      ones under ``GAP_NS`` included: a loop whose only long gaps are its incidents has no long pace) as
      an incident; up to it, the loop's pace, only in gaps
      the thread never slept in (under ``SLEEP_FREE_NS``: a CPU-bound step). A loop that sleeps between
      steps (a timer, a peer, a queue) is paced by that wait, told in its own bucket; a thread with no
      sleep recorded at all (``sleeps`` False: not even in its syncs) may spin on-CPU waiting for work
      (requests, the GPU) as well as run its own code — its pace is not claimed.
    * After asynchronous launches, the GPU may still run what was queued: only what is unusual in the gap
      can be idle — per bucket, its time beyond its median in such gaps (those ending in the same op) and
      the turnaround; own host code beyond twice its usual time — ``H``; the sync that ends the gap tells
      how much of it was: it returned in ``S`` where, after gaps with nothing unusual, the same op of the
      same thread returns in ``W`` (their median; ``MIN_REF`` of them at least, else unknown: not idle).
      The GPU worked ``W - S`` into the gap, the rest ``H - (W - S)`` idled (clamped to [0, H]), taken
      from the off-CPU buckets first, then own host code. Gaps with no sync after them stay unknown.

    With ``detail``, each gap's idle time per bucket too (:attr:`Judged.per_gap`: what the ledger per
    label cuts at its spans' edges).
    """
    n, host = per.shape[0], IDX[HOST_CODE]
    h = per[host]
    allow = np.zeros(h.size)
    for kind, also in ((drained, short), (~drained, None)):  # a loop's host code: after a sync, between launches
        if kind.any():
            usual = np.concatenate((h[kind], also)) if also is not None else h[kind]
            allow[kind] = max(float(GAP_NS), TURNAROUND_X * float(np.median(usual)))
    # the off-CPU buckets present (few), strongest first, then own host code: a compact matrix of them
    rows = [IDX[b] for b in _GAP_ORDER if per[IDX[b]].any()] + [host]
    k = len(rows) - 1  # own host code's row in it
    beyond = np.zeros((k + 1, h.size))  # per row and gap, its idle time
    sure = np.flatnonzero(drained)  # after a draining call: each bucket beyond the turnaround
    if sure.size:
        b = per[np.ix_(np.asarray(rows, dtype=np.int64), sure)]
        b[:k] = np.maximum(b[:k] - GAP_NS, 0)
        b[k] = np.maximum(h[sure] - allow[sure], 0)
        beyond[:, sure] = b
    sleep_rows = [r for r in rows if BUCKETS[r] in SLEEPS]
    asleep = (
        per[np.ix_(np.asarray(sleep_rows, dtype=np.int64), sure)].sum(axis=0) if sleep_rows else np.zeros(sure.size)
    )
    cpu_bound = (asleep < SLEEP_FREE_NS) & sleeps  # gaps the thread never waited in: on-CPU throughout
    paced = np.zeros(h.size)
    paced[sure] = np.where(cpu_bound, np.maximum(np.minimum(h[sure], allow[sure]) - GAP_NS, 0), 0)
    after_launch = np.flatnonzero(~drained)
    has_sync = sync_ns[after_launch] >= 0
    keys = sync_key[after_launch]
    for key in distinct(keys[has_sync]).tolist():
        mine = after_launch[has_sync & (keys == key)]
        b = per[np.ix_(np.asarray(rows, dtype=np.int64), mine)]
        if k:
            b[:k] = np.maximum(b[:k] - _median_rows(b[:k])[:, None] - GAP_NS, 0)
        b[k] = np.maximum(h[mine] - allow[mine], 0)
        unusual = b.sum(axis=0)
        ref = unusual == 0
        if int(ref.sum()) >= MIN_REF:  # else: unknown, not idle
            worked = np.maximum(float(np.median(sync_ns[mine][ref])) - sync_ns[mine], 0)
            cap = np.maximum(unusual - worked, 0)
            # off-CPU time first (the unusual part of a gap), then own host code: row by row, what is
            # left of the cap after the rows before it, within the row's time
            taken = np.zeros(mine.size)
            for i in range(k + 1):
                part = cap - taken
                taken += b[i]
                np.minimum(np.maximum(part, 0, out=part), b[i], out=b[i])
            beyond[:, mine] = b
    in_idle = np.zeros(n)
    in_idle[rows] = beyond.sum(axis=1)
    in_idle[host] += paced.sum()
    gap_idle = beyond.sum(axis=0) + paced
    per_gap = None
    if detail:
        per_gap = np.zeros_like(per)
        per_gap[rows] = beyond
        per_gap[host] += paced
    return Judged(np.rint(in_idle[:n]).astype(np.int64), gap_idle, round(float(paced.sum())), per_gap)


def _median_rows(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``np.median(x, axis=1)``, with no partition of the rows more than half zeros (their median is 0:
    most gaps hold none of a given off-CPU bucket)."""
    out = np.zeros(x.shape[0])
    some = 2 * np.count_nonzero(x, axis=1) >= x.shape[1]
    if some.any():
        out[some] = np.median(x[some], axis=1)
    return out


def ends_a_step(keys: I64) -> npt.NDArray[np.bool_]:
    """Which calls (op keys ``(source & 0xF) << 8 | (op & 0xFF)``) are syncs: a loop's step ends in one."""
    out: npt.NDArray[np.bool_] = _STEP_ENDS[keys & 0xFFF]
    return out


def _sleeps(classes: dict[str, tuple[I64, I64]]) -> bool:
    """Whether the thread's sleeps are recorded (any interval of a sleep class)."""
    return any(classes[b][0].size for b in SLEEPS)


def _sure_context(
    idle: npt.NDArray[np.bool_], drained: npt.NDArray[np.bool_] | None, sync: tuple[I64, I64] | None
) -> tuple[npt.NDArray[np.bool_], I64, I64]:
    """For the judged gaps (``idle``): which follow a draining call, and the draining call that ends each."""
    m = int(idle.sum())
    d = np.ones(m, dtype=bool) if drained is None else drained[idle]
    if sync is None:
        return d, np.full(m, -1, dtype=np.int64), np.full(m, -1, dtype=np.int64)
    return d, sync[0], sync[1]


def _per_gap(seg_s: I64, seg_e: I64, seg_b: I64, a: I64, z: I64) -> npt.NDArray[np.float64]:
    """Per bucket (rows), its time in each gap [a, z) (columns), from the painted segments (sorted and
    disjoint, bucket ``seg_b``). Many gaps: each gap end is found once among all the segments; few: among
    each bucket's own."""
    per = np.zeros((len(BUCKETS), a.size))
    present = np.flatnonzero(np.bincount(seg_b, minlength=len(BUCKETS))).tolist()
    if seg_s.size == 0:
        return per
    if 4 * a.size < seg_s.size:
        for b in present:
            m = seg_b == b
            s, e = seg_s[m], seg_e[m]
            mine = Intervals(s, e, np.concatenate(([0], np.cumsum(e - s))), s)
            per[b] = mine.before(z) - mine.before(a)
        return per
    lens = seg_e - seg_s
    (ka, pa), (kz, pz) = _last_segment(seg_s, lens, a), _last_segment(seg_s, lens, z)
    la, lz = seg_b[ka], seg_b[kz]
    for b in present:
        cum = np.concatenate(([0], np.cumsum(np.where(seg_b == b, lens, 0))))  # b's time before each segment
        per[b] = (cum[kz] + np.where(lz == b, pz, 0)) - (cum[ka] + np.where(la == b, pa, 0))
    return per


def _last_segment(start: I64, lens: I64, x: I64) -> tuple[I64, I64]:
    """Per instant of ``x``: the last of the sorted, disjoint segments starting at or before it (0 when
    none), and its time before the instant (0 when none)."""
    k = np.searchsorted(start, x, side="right") - 1
    kk = np.maximum(k, 0)
    part: I64 = np.where(k >= 0, np.clip(x - start[kk], 0, lens[kk]), 0)
    return kk, part


def _near(ts: I64, end: I64, s: I64, e: I64, slack: int) -> npt.NDArray[np.bool_]:
    """Which intervals [s, e) lie within ``slack`` of one of the calls [ts, end) (ts sorted)."""
    if ts.size == 0:
        return np.zeros(s.size, dtype=bool)
    k = np.searchsorted(ts, e + slack, side="right") - 1
    reach = np.maximum.accumulate(end)
    out: npt.NDArray[np.bool_] = (k >= 0) & (reach[np.maximum(k, 0)] >= s - slack)
    return out


@dataclass
class ThreadEvidence:
    """The rows of one node the ledger reads beside the GPU calls: per kind (wakeups: ts, waker; the
    thread's own socket calls and block I/O: ts, end), with their tids."""

    off: OffCpu
    rows: dict[str, tuple[I64, I64, I64]]
    holes: tuple[I64, I64]

    def of(self, kind: str, tid: int) -> tuple[I64, I64]:
        """The ``kind`` rows of thread ``tid``, in time order."""
        tids, ts, other = self.rows[kind]
        m = tids == tid
        order = np.argsort(ts[m], kind="stable")
        return ts[m][order], other[m][order]


def gap_classes(ev: ThreadEvidence, tid: int, kids: set[int]) -> dict[str, tuple[I64, I64]]:
    """The thread's off-CPU intervals by gap bucket (each class sorted and disjoint)."""
    off = ev.off
    wts, _ = ev.of("wakeup", tid)
    (nts, nend), (dts, dend) = ev.of("net", tid), ev.of("disk", tid)
    kid_arr = np.asarray(sorted(kids), dtype=np.int64)
    parts: dict[str, list[tuple[I64, I64]]] = {b: [] for b in _GAP_ORDER}
    parts[NOT_RECORDED].append(ev.holes)
    for kind, bucket in ((INVOL, PREEMPTED), (IOWAIT, ASLEEP_DISK)):
        th = off.threads[kind].get(tid)
        if th is not None:
            parts[bucket].append((th.start, th.end))

    def asleep(s: I64, e: I64, who: I64 | None, woken: npt.NDArray[np.bool_]) -> None:
        """Sleeps by what ended them: a forked child, the thread's own block I/O or socket call in
        flight, a wakeup from no process (a timer); the rest ``unknown`` (``who`` None: no sleep known)."""
        workers = np.isin(who, kid_arr) if who is not None else np.zeros(s.size, dtype=bool)
        disk = ~workers & _near(dts, dend, s, e, 0)
        net = ~workers & ~disk & _near(nts, nend, s, e, NET_NEAR_NS)
        timer = ~workers & ~disk & ~net & woken & ((who == 0) if who is not None else woken)
        other = ~workers & ~disk & ~net & ~timer
        for m, bucket in ((workers, ASLEEP_WORKERS), (disk, ASLEEP_DISK), (net, ASLEEP_NETWORK), (timer, ASLEEP_TIMER)):
            parts[bucket].append((s[m], e[m]))
        parts[ASLEEP_UNKNOWN if who is not None else OFFCPU_UNKNOWN].append((s[other], e[other]))

    # a wakeup ends the sleep it follows (a little after its end: sleeps clipped where rows overlap)
    vol = off.threads[VOL].get(tid)
    if vol is not None:
        k = np.minimum(np.searchsorted(wts, vol.start, side="left"), max(0, wts.size - 1))
        woken = (wts[k] >= vol.start) & (wts[k] <= vol.end + NET_NEAR_NS) if wts.size else vol.start < 0
        asleep(vol.start, vol.end, vol.who, woken)
    unk = off.threads[UNKNOWN].get(tid)
    if unk is not None:  # no prev_state (its sleeps until a recorded wakeup are in VOL already, see OffCpu)
        woke = unk.who != NOT_WOKEN  # runnable after a wakeup, waiting for a CPU: unknown whatever is near
        parts[OFFCPU_UNKNOWN].append((unk.start[woke], unk.end[woke]))
        asleep(unk.start[~woke], unk.end[~woke], None, np.zeros(int((~woke).sum()), dtype=bool))
    out = {}
    for b, ps in parts.items():
        s = np.concatenate([p[0] for p in ps]) if ps else np.zeros(0, dtype=np.int64)
        e = np.concatenate([p[1] for p in ps]) if ps else np.zeros(0, dtype=np.int64)
        keep = e > s
        out[b] = union(s[keep], e[keep])
    return out


@dataclass
class Painted:
    """What :func:`paint` measures: per gap bucket its time in the gaps (exact ns), its time per minute
    (rows; with ``minutes``), and what :func:`judge_idle` counts as GPU idle."""

    total: I64
    per_minute: npt.NDArray[np.float64] | None
    judged: Judged


def paint(
    g0: I64,
    g1: I64,
    idle: npt.NDArray[np.bool_],
    classes: dict[str, tuple[I64, I64]],
    minutes: I64 | None,
    *,
    drained: npt.NDArray[np.bool_] | None = None,
    sync: tuple[I64, I64] | None = None,
    short: I64 | None = None,
    detail: bool = False,
) -> Painted:
    """Split the gaps [g0, g1) by class: per gap bucket its time, its time counted as GPU idle (gaps in
    ``idle``, judged by :func:`judge_idle`), (with ``minutes``, the minute edges inside the wall) its
    time per minute (rows) — exact integer sums —, the idle time of each ``idle`` gap, and the paced
    part of the idle own host code (:attr:`Judged.paced`). ``drained``: which gaps follow a draining
    call (None: every ``idle`` gap); ``sync``: per ``idle`` gap (in order), the duration and op key of
    the draining call that ends it (-1: none) — what the gaps after asynchronous launches are judged
    by; ``short``: the lengths of the gaps after syncs too short to be judged (a loop's pace is measured
    over every gap after one); ``detail``: each judged gap's idle per bucket too (:attr:`Judged.per_gap`).

    The classes are painted once, strongest first, into segments between their own edges; the gaps are
    measured through their prefix sums (no cut per gap: the work grows with the scheduler rows, not the
    calls), and only the ``idle`` gaps get per-gap figures; the minutes (selective storage, or any edges:
    the ledger per label) are measured the same way (:func:`_per_minute`)."""
    n, host = len(BUCKETS), IDX[HOST_CODE]
    live = [(b, classes[b]) for b in _GAP_ORDER if classes[b][0].size]
    seg_s = seg_e = seg_b = np.zeros(0, dtype=np.int64)
    if live:
        edges = np.sort(np.concatenate([x for _, se in live for x in se]), kind="stable")  # sorted runs: merged
        edges = edges[np.concatenate(([True], edges[1:] != edges[:-1]))]
        label = np.full(edges.size - 1, -1, dtype=np.int64)
        for b, (s, e) in reversed(live):  # the strongest class painted last wins
            d = np.zeros(edges.size, dtype=np.int64)
            d[np.searchsorted(edges, s)] += 1  # a class's intervals are disjoint: each edge once
            d[np.searchsorted(edges, e)] -= 1
            label[np.cumsum(d[:-1]) > 0] = IDX[b]
        keep = label >= 0
        seg_s, seg_e, seg_b = edges[:-1][keep], edges[1:][keep], label[keep]
    glen = g1 - g0
    gcum = np.concatenate(([0], np.cumsum(glen)))
    (ks, ps), (ke, pe) = _last_segment(g0, glen, seg_s), _last_segment(g0, glen, seg_e)
    in_gaps = (gcum[ke] + pe) - (gcum[ks] + ps)  # each segment's time inside the gaps
    total = np.bincount(seg_b, weights=in_gaps.astype(np.float64), minlength=n)
    total[host] = float(int(gcum[-1]) - int(in_gaps.sum()))  # what no class covers: own host code
    # per idle gap, each bucket's time in it: judge_idle says how much of it the GPU idled
    sure = np.flatnonzero(idle)
    a, z = g0[sure], g1[sure]
    per = _per_gap(seg_s, seg_e, seg_b, a, z)
    per[host] = (z - a) - per.sum(axis=0)
    judged = judge_idle(per, *_sure_context(idle, drained, sync), _sleeps(classes), short, detail)
    per_minute = None if minutes is None else _per_minute(g0, glen, gcum, seg_s, seg_e, seg_b, in_gaps, minutes)
    return Painted(np.rint(total).astype(np.int64), per_minute, judged)


def _per_minute(
    g0: I64,
    glen: I64,
    gcum: npt.NDArray[Any],  # int64 at run time, as in_gaps
    seg_s: I64,
    seg_e: I64,
    seg_b: I64,
    in_gaps: npt.NDArray[Any],
    minutes: I64,
) -> npt.NDArray[np.float64]:
    """Per minute (rows: before ``minutes[0]``, between each two edges, after the last) each bucket's
    time inside the gaps [g0, g0 + glen) (prefix sums ``gcum``): a bucket's in-gap time before an edge
    is that of its painted segments before the one the edge falls in (``in_gaps``: each segment's), plus
    that segment's in-gap time before the edge."""
    n, host = len(BUCKETS), IDX[HOST_CODE]

    def gap_time(x: I64) -> npt.NDArray[Any]:  # the gaps' time before each instant
        k, part = _last_segment(g0, glen, x)
        return gcum[k] + part

    x = np.concatenate(([g0[0]], minutes, [g0[-1] + glen[-1]]))
    before = np.zeros((x.size, n), dtype=np.int64)  # per edge, each bucket's in-gap time before it
    if seg_s.size:
        k, _ = _last_segment(seg_s, seg_e - seg_s, x)  # the segment each edge falls in or follows (0: none)
        part = gap_time(np.clip(x, seg_s[k], seg_e[k])) - gap_time(seg_s[k])
        for b in distinct(seg_b).tolist():
            cum = np.concatenate(([0], np.cumsum(np.where(seg_b == b, in_gaps, 0))))
            before[:, b] = cum[k] + np.where(seg_b[k] == b, part, 0)
    before[:, host] = gap_time(x) - before.sum(axis=1)
    return np.diff(before, axis=0).astype(np.float64)
