"""Rules on a GPU op's own timing: its slower regimes and the calls held off the CPU (the tail rule).

* **tail** — an op's slower regimes (:mod:`ingero.explain.regimes`: stretches of calls ≥ 2x the op's
  regime-aware steady level, found by run-length; no p99/p50 gate, so a third of the calls running
  3x slower is found), and the calls *held off the CPU*: no regime's slow calls, but their thread was
  preempted (or off-CPU of unknown kind) inside them beyond steady — contention that delays a sync now
  and then makes no stretch, yet each call's loss is measured on its own thread. The buckets of these
  calls make runs (± one bucket): *episodes*. Each episode's host evidence is weighed against the
  op's other buckets (:func:`ingero.explain.causes.assess`), and where its lost time went is measured
  per call on the calling thread (involuntary / voluntary / unknown off-CPU time, block I/O in flight:
  :class:`~ingero.explain.causes.Shares`). The root cause is the one holding the dominant share
  (≥ 50 %) of the lost time (:func:`~ingero.explain.causes.dominant`); other causes are context. An
  episode with no dominant cause makes no chain (a note says where the time went). Episodes are
  folded into one chain per (op, root family); severity is its lost time over wall time. p99/p50
  stay in the chain as figures (Ingero's columns), not as a gate.
(Throughput drops: :mod:`ingero.explain.rules_drop`; periodic spikes: :mod:`ingero.explain.rules_periodic`.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ingero.explain import causes as cz
from ingero.explain import regimes
from ingero.explain.context import Context, Culprit, OpRows, fmt_ns, layer_of, short_ns, us
from ingero.explain.evidence import Evidence, runs
from ingero.explain.frame import member
from ingero.explain.ledger_gaps import GAP_NS
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, UNKNOWN, VOL, Intervals, union
from ingero.explain.rules_launch import LAUNCH_OPS, first_launch_mask
from ingero.explain.stats import OpStats
from ingero.store.catalog import IO, NCCL, op_ids
from ingero.timeutil import fmt_ts

MIN_CALLS = 10
MIN_IO_OVERLAP = 0.05  # share of the lost time during which the traced tree's block I/O was in flight
COPY_OPS = set(op_ids("cudaMemcpy", "cudaMemcpyAsync", "cuMemcpy", "cuMemcpyAsync"))  # arg0 = bytes
# a call off-CPU inside itself (preempted, or of unknown kind) beyond steady for this share of its steady
# time, and at least as long as an ordinary preemption or wakeup latency (the ledger's turnaround)
HELD_OFF, HELD_OFF_NS = cz.MIN_OVERLAP, GAP_NS


def _mask(ctx: Context, ts: np.ndarray, dilate: int = 0) -> np.ndarray:
    m = np.zeros(ctx.grid.n, dtype=bool)
    m[ctx.grid.index(ts)] = True
    if dilate:
        d = m.copy()
        d[:-1] |= m[1:]
        d[1:] |= m[:-1]
        return d
    return m


@dataclass
class _Episode:
    b0: int
    b1: int
    found: list[cz.Cause]  # root first; empty when no cause holds the dominant share
    seen: list[cz.Cause]  # every corroborated cause, dominant or not
    ep: Evidence
    index: int  # the episode's number among the op's
    slow_ep: np.ndarray  # per call of the op: the episode its slow call falls in (−1: none), shared

    shares: cz.Shares

    @property
    def in_ep(self) -> np.ndarray:
        """The op's slow calls in this episode's window (computed for a chain's episode only)."""
        out: np.ndarray = self.slow_ep == self.index
        return out


def tail_chains(ctx: Context) -> tuple[list[Chain], list[OpStats]]:
    """Chains for the slower regimes of every op whose lost time has a dominant, corroborated cause;
    and the ops with regimes (≥ 1 % of wall time lost) that nothing on the host explains.

    Time spent inside an NCCL collective is waiting for peers, never CPU contention. One pass per op:
    the per-call overlaps are prefix-sum lookups and every episode's figures are one ``bincount``.
    """
    chains: list[Chain] = []
    unexplained: list[OpStats] = []
    wall = max(1, ctx.gpu.last_ns - ctx.gpu.first_ns)
    in_flight = _io_in_flight(ctx)
    for st in ctx.ops:
        if st.count < MIN_CALLS or st.p50_ns <= 0:
            continue
        rows = ctx.rows(st)
        found_eps = _episodes(ctx, st, rows, in_flight)
        if found_eps is None:
            continue
        reg, episodes, base, held_n = found_eps
        by_family: dict[str, list[_Episode]] = {}
        minority: list[_Episode] = []
        for e in episodes:
            (by_family.setdefault(e.found[0].family, []) if e.found else minority).append(e)
        chained = False
        for fam, eps in by_family.items():
            lost = sum(e.shares.lost_ns for e in eps)
            if not cz.worth_a_chain(lost, wall):
                continue
            best = max(eps, key=lambda e: e.shares.lost_ns)
            sev = cz.severity_of_loss(lost, wall, may_be_sleep=cz.may_be_sleep(fam, rows.tid, ctx.off.woken))
            chains.append(_tail_chain(ctx, st, rows, reg, held_n, fam, best, sev, eps, lost, wall, base))
            chained = True
        minority = [e for e in minority if e.seen]  # causes seen, none dominant: say so, name none
        unexplained_lost = sum(e.shares.lost_ns for e in minority)
        if cz.worth_a_chain(unexplained_lost, wall):
            total = _sum_shares([e.shares for e in minority])
            names = sorted({c.family for e in minority for c in e.seen})
            ctx.notes.append(
                f"{ctx.node}{_who(ctx)}: {st.name} ran slower than its steady {fmt_ns(reg.steady_ns)} in "
                f"{len(minority)} window(s), losing {short_ns(unexplained_lost)} ({100 * unexplained_lost / wall:.1f}% "
                f"of wall time): {total.words()}; {', '.join(names)} seen but not the dominant share of it, "
                "so no cause is named"
            )
        if not chained and cz.worth_a_chain(reg.lost_total_ns, wall):
            unexplained.append(st)
    return chains, unexplained


def _who(ctx: Context) -> str:
    return f" (pid {ctx.pid})" if ctx.pid is not None else ""


def _sum_shares(parts: list[cz.Shares]) -> cz.Shares:
    return cz.Shares(
        sum(p.lost_ns for p in parts),
        sum(p.inv_ns for p in parts),
        sum(p.vol_ns for p in parts),
        sum(p.unk_ns for p in parts),
        sum(p.io_ns for p in parts),
    )


def _call_shape(ctx: Context, st: OpStats, rows: OpRows) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(scale, ignore) for :func:`regimes.find`: copies are judged per byte (a call's bytes over the
    median bytes); a kernel's first launch (loading/JIT, not a regime) is never slow."""
    scale = ignore = None
    if (st.source, st.op) in LAUNCH_OPS:
        ignore = first_launch_mask(ctx, rows)
    if (st.source, st.op) in COPY_OPS:
        nbytes = ctx.arg0_of(rows)
        if nbytes is not None and (nbytes > 0).all():
            scale = nbytes / float(np.median(nbytes))
    return scale, ignore


def _held_off(
    ctx: Context, st: OpStats, rows: OpRows, reg: regimes.Regimes, scale: np.ndarray | None, ignore: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Calls that are no regime's slow calls but lost time to the CPU: their thread was off-CPU inside
    them, preempted or of unknown kind (never asleep by itself), beyond steady for ≥ :data:`HELD_OFF`
    of the call's steady time and ≥ :data:`HELD_OFF_NS` (shorter is an ordinary preemption or wakeup
    latency, as the ledger's turnaround). Contention that delays a sync now and then makes no stretch (a run of
    slow calls), and a delay under 2x is no slow call, yet each such call's lost time is measured on its
    own thread. (mask, each call's excess over steady). Never inside a collective (waiting for peers)."""
    none = np.zeros(rows.ts_ns.size, dtype=bool), np.zeros(rows.ts_ns.size, dtype=np.int64)
    if st.source == NCCL or reg.steady_ns <= 0 or not (ctx.off.threads[INVOL] or ctx.off.threads[UNKNOWN]):
        return none
    steady = reg.steady_ns * (scale if scale is not None else np.ones(rows.ts_ns.size))
    exc = rows.dur - steady
    floor = np.maximum(HELD_OFF * steady, HELD_OFF_NS)
    cand = ~reg.slow & (exc >= floor)
    if ignore is not None:
        cand &= ~ignore
    idx = np.flatnonzero(cand)
    if idx.size == 0:
        return none
    ts, end, tid = rows.ts_ns[idx], rows.ts_ns[idx] + rows.dur[idx], rows.tid[idx]
    off = ctx.off.covered(INVOL, tid, ts, end) + ctx.off.covered(UNKNOWN, tid, ts, end)
    hit = idx[np.minimum(off, exc[idx]) >= floor[idx]]
    mask, excess = none
    mask[hit] = True
    excess[hit] = np.round(exc[hit]).astype(np.int64)
    return mask, excess


def _episodes(
    ctx: Context, st: OpStats, rows: OpRows, in_flight: Intervals | None
) -> tuple[regimes.Regimes, list[_Episode], Evidence | None, int] | None:
    """The op's regimes and the calls held off the CPU (:func:`_held_off`), cut into episodes (runs of
    buckets with slow calls, ± one bucket), each with its host evidence, measured shares and causes
    (root first; none when no cause dominates); and how many calls were held off."""
    scale, ignore = _call_shape(ctx, st, rows)
    reg = regimes.find(rows.ts_ns, rows.dur, rows.tid, scale=scale, ignore=ignore)
    held, held_exc = _held_off(ctx, st, rows, reg, scale, ignore)
    if not cz.worth_a_chain(reg.lost_total_ns + int(held_exc.sum()), max(1, ctx.gpu.last_ns - ctx.gpu.first_ns)):
        return None  # no family's share of it could make a chain: its windows need no evidence
    g = ctx.grid
    slow = reg.slow | held
    excess = np.where(held, held_exc, reg.excess)
    spans = runs(_mask(ctx, rows.ts_ns[slow]), max_gap=2)  # runs ± one bucket that touch merge
    if not spans:
        return None
    b0s = np.asarray([a for a, _ in spans], dtype=np.int64)
    b1s = np.asarray([b for _, b in spans], dtype=np.int64)
    # each call in a regime or held off → its episode (the run whose window, ± one bucket, holds it)
    inside = np.flatnonzero((reg.stretch >= 0) | held)
    bucket = g.index(rows.ts_ns[inside])
    k = np.searchsorted(b0s - 1, bucket, side="right") - 1
    ok = (k >= 0) & (bucket <= b1s[np.maximum(k, 0)] + 1)
    calls, ep_of = inside[ok], k[ok]
    ts, end = rows.ts_ns[calls], rows.ts_ns[calls] + rows.dur[calls]
    tid, exc = rows.tid[calls], excess[calls]
    n_ep = len(spans)

    def per_ep(x: np.ndarray) -> np.ndarray:
        return np.bincount(ep_of, weights=x, minlength=n_ep).astype(np.int64)

    inv = np.minimum(exc, ctx.off.covered(INVOL, tid, ts, end))
    vol = np.minimum(exc, ctx.off.covered(VOL, tid, ts, end))
    unk = np.minimum(exc, ctx.off.covered(UNKNOWN, tid, ts, end))
    io = np.minimum(exc, in_flight.covered(ts, end)) if in_flight is not None else np.zeros_like(exc)
    lost, inv_e, vol_e, unk_e, io_e = per_ep(exc), per_ep(inv), per_ep(vol), per_ep(unk), per_ep(io)
    slow_n = np.bincount(ep_of, weights=slow[calls], minlength=n_ep)
    active = _mask(ctx, rows.ts_ns)
    dilated = _mask(ctx, rows.ts_ns[slow], dilate=1)
    base = ctx.series.over_mask(active & ~dilated)
    collective = st.source == NCCL
    slow_ep = np.full(rows.ts_ns.size, -1, dtype=np.int64)
    slow_ep[calls[slow[calls]]] = ep_of[slow[calls]]
    out: list[_Episode] = []
    for i, (b0, b1) in enumerate(spans):
        if slow_n[i] == 0 or lost[i] <= 0:
            continue
        ep = ctx.series.over_range(b0 - 1, b1 + 1)
        shares = cz.Shares(int(lost[i]), int(inv_e[i]), int(vol_e[i]), int(unk_e[i]), int(io_e[i]))
        ep.slow_ns, ep.slow_inv_ns, ep.slow_vol_ns, ep.slow_unk_ns = (
            shares.lost_ns,
            shares.inv_ns,
            shares.vol_ns,
            shares.unk_ns,
        )
        ep.io_overlap_ns = shares.io_ns
        ep.excess_ns = shares.lost_ns
        found = cz.assess(ep, base, st.p99_ns)
        if collective:  # inside a collective the thread waits for its peers
            found = [c for c in found if c.family not in ("cpu", "offcpu")]
        # block I/O must overlap the lost time itself, not just share a bucket with it
        found = [c for c in found if not c.family.startswith("io") or shares.share(shares.io_ns) >= MIN_IO_OVERLAP]
        out.append(_Episode(int(b0), int(b1), cz.dominant(found, shares), found, ep, i, slow_ep, shares))
    return reg, out, base, int(held.sum())


def _io_in_flight(ctx: Context) -> Intervals | None:
    """When block I/O issued by the traced process tree was in flight (built once per context)."""
    f = ctx.frame
    m = (f.source == IO) & member(f.pid, ctx.tree if ctx.tree.size else ctx.traced)
    if not m.any():
        return None
    io_s, io_e = union(f.ts_ns[m] - f.dur[m], f.ts_ns[m])  # ts = completion, duration = device latency
    return Intervals.build(io_s, io_e, np.zeros(io_s.size, dtype=np.int64))


def _tail_chain(
    ctx: Context,
    st: OpStats,
    rows: OpRows,
    reg: regimes.Regimes,
    held_n: int,
    fam: str,
    e: _Episode,
    sev: str,
    eps: list[_Episode],
    lost: int,
    wall: int,
    base: Evidence | None,
) -> Chain:
    g = ctx.grid
    total = _sum_shares([x.shares for x in eps])
    # the words and figures of the chain are its whole lost time's (every episode), the host evidence
    # its strongest window's
    ep = replace(e.ep, slow_ns=total.lost_ns, slow_inv_ns=total.inv_ns, slow_vol_ns=total.vol_ns,
                 slow_unk_ns=total.unk_ns, io_overlap_ns=total.io_ns, excess_ns=total.lost_ns)  # fmt: skip
    b0, b1, found = e.b0, e.b1, e.found
    start = max(g.start_of(max(0, b0 - 1)), ctx.frame.first_ns)
    end = min(g.end_of(min(g.n - 1, b1 + 1)), ctx.frame.last_ns + 1)
    ep_slow = e.in_ep
    worst = int(rows.dur[ep_slow].max(initial=0))
    slow_n = int(reg.slow.sum()) + held_n
    culprits: list[Culprit] = []
    if fam == "cpu":
        culprits = ctx.preemptors(rows.tid[ep_slow], rows.ts_ns[ep_slow], rows.ts_ns[ep_slow] + rows.dur[ep_slow])
        culprits = culprits or ctx.culprits(start, end)
    subject = ctx.subject(rows.pid)
    root, context = found[0], found[1:]
    words = cz.phrase(root, ep)
    summary = (
        f"{st.name} p99={fmt_ns(st.p99_ns)} ({st.tail_ratio:.1f}x p50): {_slow_calls(reg, held_n)} lost "
        f"{short_ns(lost)} ({100 * lost / wall:.1f}% of wall time) — {words}"
    )
    base_txt = ""
    if base is not None and fam.startswith("io"):
        base_txt = f" (elsewhere: {base.per_s(base.io_n):.1f} I/O ops/s)"
    also = "; ".join(cz.phrase(c, ep) for c in context[:2])
    explanation = (
        f"{st.name} ran {st.count} times at a steady {fmt_ns(reg.steady_ns)} (p50 {fmt_ns(st.p50_ns)}, "
        f"p99 {fmt_ns(st.p99_ns)}, max {fmt_ns(st.max_ns)}); "
        + (
            f"in {reg.n} slower stretch(es) {int(reg.slow.sum())} calls took ≥ {regimes.SLOW_FACTOR:.0f}x steady"
            if reg.n
            else "no stretch of calls ran slower"
        )
        + (
            f"; {held_n} other calls ran ≥ {100 * HELD_OFF:.0f}% (and ≥ {fmt_ns(HELD_OFF_NS)}) beyond steady while "
            "their thread was off the CPU inside them (not asleep by itself)"
            if held_n
            else ""
        )
        + f". {int(ep_slow.sum())} of these calls (up to {fmt_ns(worst)}) fell in "
        f"{fmt_ts(start)} – {fmt_ts(end)}, where the host shows {words}{base_txt}. "
        + (f"The same cause recurs in {len(eps)} separate windows. " if len(eps) > 1 else "")
        + f"Time lost: {short_ns(lost)} ({100 * lost / wall:.1f}% of wall time); of it, {total.words()}. "
        + (f"Also seen, not the root (a minority of the lost time): {also}. " if also else "")
        + cz.mechanism(fam, st.name)
    )
    tl = cz.timeline(found, ep, culprits)
    tl.append(
        TimelineEntry(
            layer_of(st.source),
            st.name,
            f"steady {fmt_ns(reg.steady_ns)}; p99={fmt_ns(st.p99_ns)} ({st.tail_ratio:.1f}x p50={fmt_ns(st.p50_ns)}); "
            f"{int(ep_slow.sum())} slow calls, worst {fmt_ns(worst)}",
            round(st.p99_ns / 1000),
        )
    )
    share = total.of(fam)
    evidence = {
        "rule": "tail",
        "op": st.name,
        "count": st.count,
        "steady_us": us(reg.steady_ns),
        "p50_us": us(st.p50_ns),
        "p99_us": us(st.p99_ns),
        "tail_ratio": round(st.tail_ratio, 2),
        "slow_calls": slow_n,
        "held_off_calls": held_n,
        "slow_calls_in_window": int(ep_slow.sum()),
        "regimes": reg.n,
        "window_start_ns": start,
        "window_end_ns": end,
        "episodes": len(eps),
        "causes": [c.family for c in found],
        "root_share": round(share, 3) if share is not None else None,
        "score": round(found[0].score, 4),
        "lost_ms": round(lost / 1e6, 1),
        "lost_share": round(lost / wall, 4),
        "slow_call_ms": round(ep.slow_ns / 1e6, 1),
        "overlap_involuntary": round(total.share(total.inv_ns), 3),
        "overlap_voluntary": round(total.share(total.vol_ns), 3),
        "overlap_unknown": round(total.share(total.unk_ns), 3),
        "io_overlap_ms": round(total.io_ns / 1e6, 1),
        "prev_state": "recorded" if ctx.off.has_state else ("unknown" if ctx.off.has_rows else "no sched rows"),
        "may_be_sleep": cz.may_be_sleep(
            fam, rows.tid, ctx.off.woken
        ),  # unknown off-CPU time whose sleeps cannot be told
        "preempted_by": [c.name for c in culprits if c.ns],
        **cz.evidence_figures(ep, base),
    }
    return ctx.chain(
        cid=ctx.chain_id("tail", fam, st.name),
        detected_at=end,
        severity=sev,
        summary=summary,
        root_cause=cz.root_cause(root, ep, subject, culprits),
        explanation=explanation,
        recommendations=cz.recommendations([root], ep),
        family=f"tail/{fam}",
        evidence=evidence,
        timeline=tl,
        st=st,
    )


def _slow_calls(reg: regimes.Regimes, held_n: int) -> str:
    """'12 calls ≥ 2x its steady 7.9ms (+ 6 held off the CPU)' for a summary."""
    n = int(reg.slow.sum())
    held = f"{held_n} calls held off the CPU beyond its steady {fmt_ns(reg.steady_ns)}"
    if not n:
        return held
    said = f"{n} calls ≥ {regimes.SLOW_FACTOR:.0f}x its steady {fmt_ns(reg.steady_ns)}"
    return f"{said} (+ {held_n} held off the CPU)" if held_n else said
