"""A late rank: a rank that enters its collectives late because of its own host code, while every
peer waits inside the collective for it.

On the late rank's own node the signature is in its NCCL calls (recorded as GPU calls, source NCCL):
before some collectives the thread ran its own code (on-CPU) far longer than before the others, and
exactly those collectives were short — it arrived last, so it did not wait; its peers did. Its peers
show the mirror image (long collectives, ordinary gaps): waiting, which is no fault of theirs and
makes no chain here (``explain --nodes`` compares the ranks).

Per GPU thread with collectives, in time order:

* the gap before each collective: from the end of the thread's previous GPU call to the collective's
  start, less the thread's off-CPU time inside it (any kind: what is left is its own host code);
* a late entry: host code ≥ the median gap's + max(:data:`MIN_LATE_NS`, :data:`SIGMAS` robust sigmas);
* it is a late rank when there are ≥ :data:`MIN_LATE` late entries and the collectives after them are
  no longer than the others (median) by more than :data:`WAIT_SHARE` of the lateness (median host code
  beyond the usual): it arrived last and did not wait, only paid the rendezvous round trip;
* time lost: ``Σ (host code − median)`` over the late entries — the time every peer waited for it too —
  never more than the wall time; severity from its share of the thread's wall time.

Without NCCL rows (Ingero's layout) the late rank is told across the nodes instead:
:mod:`ingero.explain.rules_ranks_fleet`.
"""

from __future__ import annotations

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, short_ns
from ingero.explain.frame import I64
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, UNKNOWN, VOL
from ingero.store.catalog import NCCL, op_name
from ingero.timeutil import NS_PER_MS

MIN_LATE_NS = NS_PER_MS  # a late entry's host code exceeds the usual by at least this ...
SIGMAS = 4.0  # ... and by this many robust sigmas of the gaps before collectives
MIN_LATE = 3  # late entries before a rank is called late
MIN_COLLECTIVES = 10
# the collectives after the late entries may be longer than the others by this share of the lateness: the
# last rank to arrive still pays the rendezvous round trip (a real 2-rank recording: 140 µs against 84 µs
# next to 25 ms late, so a strict comparison called it a late rank about one run in five), while a rank
# that was not the last waits inside for a time of the order of the lateness itself
WAIT_SHARE = 0.25


def long_host_code(host_ns: I64) -> tuple[np.ndarray, float] | None:
    """(mask of the gaps whose host code is far beyond the usual, median host code), or None with too
    few gaps or fewer than MIN_LATE such gaps (or fewer than MIN_LATE ordinary ones)."""
    if host_ns.size < MIN_COLLECTIVES:
        return None
    base = float(np.median(host_ns))
    sigma = 1.4826 * float(np.median(np.abs(host_ns - base)))
    late = host_ns >= base + max(MIN_LATE_NS, SIGMAS * sigma)
    if int(late.sum()) < MIN_LATE or int((~late).sum()) < MIN_LATE:
        return None
    return late, base


def late_entries(host_ns: I64, coll_dur: I64) -> tuple[np.ndarray, float] | None:
    """(late-entry mask, median host code) of one thread's gaps before its collectives, or None when
    it is not a late rank (see the module docstring)."""
    found = long_host_code(host_ns)
    if found is None:
        return None
    late, base = found
    tolerance = WAIT_SHARE * float(np.median(host_ns[late] - base))
    if float(np.median(coll_dur[late])) > float(np.median(coll_dur[~late])) + tolerance:
        return None  # it waited inside those collectives too: not the last to arrive
    return late, base


def late_rank_chains(ctx: Context) -> list[Chain]:
    g = ctx.gpu
    coll = g.source == NCCL
    if not coll.any():
        return []
    wall = max(1, g.last_ns - g.first_ns)
    off = ctx.off
    out: list[Chain] = []
    for tid in np.unique(g.tid[coll]).tolist():
        m = np.flatnonzero(g.tid == tid)
        m = m[np.argsort(g.ts_ns[m], kind="stable")]
        s, e = g.ts_ns[m], g.ts_ns[m] + np.maximum(g.dur[m], 0)
        idx = np.flatnonzero(g.source[m][1:] == NCCL) + 1
        if idx.size < MIN_COLLECTIVES:
            continue
        a, b = np.maximum.accumulate(e)[idx - 1], s[idx]
        tids = np.full(idx.size, tid, dtype=np.int64)
        asleep = sum(off.covered(kind, tids, a, b) for kind in (INVOL, VOL, UNKNOWN))
        host = np.clip(b - a - asleep, 0, None)
        found = late_entries(host, g.dur[m][idx])
        if found is None:
            continue
        late, base = found
        lost = min(float((host[late] - base).sum()), float(wall))
        if not cz.worth_a_chain(lost, wall):
            continue
        pid = int(g.pid[m][0])
        name = op_name(NCCL, int(g.op[m][idx][0]))
        out.append(_chain(ctx, pid, int(tid), name, late, host, base, lost, wall, int(s[idx][late].max())))
    return out


def _chain(
    ctx: Context,
    pid: int,
    tid: int,
    name: str,
    late: np.ndarray,
    host: I64,
    base: float,
    lost: float,
    wall: int,
    at: int,
) -> Chain:
    n_late, n = int(late.sum()), int(late.size)
    share = lost / wall
    words = (
        f"{n_late} of {n} {name} calls entered late after {short_ns(float(np.median(host[late])))} of its own host "
        f"code (usually {short_ns(base)})"
    )
    return ctx.chain(
        cid=ctx.chain_id("late-rank", f"tid{tid}"),
        detected_at=at,
        severity=cz.severity_of_loss(lost, wall),
        summary=f"late rank: {ctx.proc(pid)} {words}; {short_ns(lost)} lost ({100 * share:.1f}% of wall time), "
        "and every peer waited as long",
        root_cause=(
            f"{ctx.proc(pid)} runs extra host code before some collectives and arrives last: its collectives after "
            "those stretches are its shortest (it did not wait), so the other ranks waited inside them for it"
        ),
        explanation=(
            f"Before each {name} the thread's own host code (the gap since its previous GPU call, less its off-CPU "
            f"time) is usually {short_ns(base)}; {n_late} times it ran far longer, {short_ns(lost)} beyond the usual in "
            f"all, {100 * share:.1f}% of its wall time. The collectives right after were no longer than the others: "
            "this rank was the last to arrive, and the job advanced at its pace."
        ),
        recommendations=recommendations(pid),
        family="late-rank",
        evidence={"rule": "late-rank", "op": name, "collectives": n, **figures(pid, tid, n_late, base, lost, share)},
        timeline=[TimelineEntry("NCCL", name, words)],
    )


def recommendations(pid: int) -> list[str]:
    """What to do about a late rank (either layout)."""
    return [
        f"Profile the rank's host code before the collective: py-spy record --pid {pid} (logging, metrics, "
        "checkpointing or data work done on one rank only)",
        "Move per-rank extra work off the critical path (a background thread, or every N steps on all ranks "
        "alike); compare the ranks with ingero explain --nodes",
    ]


def figures(pid: int, tid: int, n_late: int, base: float, lost: float, share: float) -> dict[str, object]:
    """A late-rank chain's figures (either layout): lost ≤ wall, its share in [0, 1]."""
    return {
        "pid": pid,
        "tid": tid,
        "late_entries": n_late,
        "usual_host_us": round(base / 1000, 1),
        "lost_ms": round(lost / 1e6, 1),
        "lost_share": round(share, 4),
        "score": round(share, 4),
    }
