"""Throughput drops: an op's call rate (moving average over ~5 s) falls ≥ 40 % below its baseline for
≥ 2 buckets while it keeps running, its per-call latency unchanged — the process issued less work. The
window's host evidence is weighed against the op's other buckets (:func:`ingero.explain.causes.assess`);
CPU contention (or off-CPU time of unknown kind) is kept only when the GPU threads' off-CPU time above
their baseline is the dominant share of the work not done. One chain per cause family, on the busiest
op, with the others that fell listed; severity from the work not done across the family's windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, Culprit, fmt_ns, layer_of, short_ns
from ingero.explain.evidence import Evidence, runs
from ingero.explain.model import SEVERITY_RANK, Chain, TimelineEntry
from ingero.explain.rules_latency import MIN_CALLS
from ingero.explain.stats import OpStats
from ingero.timeutil import NS_PER_S, fmt_ts

DROP = 0.40
MIN_PEAK_RATE = 10.0  # ops/s before rate changes mean anything
IDLE_SLEEP = 0.25  # a bucket whose GPU thread sleeps this much more than usual is idle, not a drop


@dataclass
class _Drop:
    st: OpStats
    b0: int
    b1: int
    found: list[cz.Cause]
    ep: Evidence
    base: Evidence | None
    sev: str
    fall: float
    base_rate: float
    rate: float
    episodes: int


def drop_chains(ctx: Context) -> list[Chain]:
    """Throughput drops, one chain per cause family: the ops of one process slow down together, so the
    drop is reported on its busiest op with the others listed."""
    found_by_family: dict[str, list[_Drop]] = {}
    for st in ctx.ops:
        d = _drop(ctx, st)
        if d is not None:
            found_by_family.setdefault(d.found[0].family, []).append(d)
    chains = []
    for drops in found_by_family.values():
        drops.sort(key=lambda d: (SEVERITY_RANK[d.sev], -d.base_rate))
        chains.append(_drop_chain(ctx, drops[0], drops[1:]))
    return chains


def _drop(ctx: Context, st: OpStats) -> _Drop | None:
    g = ctx.grid
    width_s = g.width_ns / NS_PER_S
    w = max(3, round(5 / width_s)) if width_s < 5 else 1
    if st.count < MIN_CALLS or (st.stored is not None and st.stored < st.count):
        return None  # a sampled op's stored rows do not give its rate (event_aggregates do, per minute)
    rows = ctx.rows(st)
    idx = g.index(rows.ts_ns)
    lo, hi = int(idx.min()) + 1, int(idx.max()) - 1  # first and last buckets are partial
    if hi - lo + 1 < 2 * w + 2:
        return None
    counts = np.bincount(idx, minlength=g.n)[lo : hi + 1].astype(np.float64)
    kernel = np.ones(w)
    rate = np.convolve(counts, kernel, mode="same") / np.convolve(np.ones(counts.size), kernel, mode="same") / width_s
    peak = float(rate.max(initial=0))
    if peak < MIN_PEAK_RATE:
        return None
    low = (rate < (1 - DROP) * peak) & (rate >= 1.0)
    # buckets where the process was idle by its own choice (no calls, or its GPU thread asleep far more
    # than usual: an evaluation pause, waiting for input) are not drops
    vol = ctx.series.vol[lo : hi + 1] / g.width_ns
    idle = (counts == 0) | (vol > float(np.median(vol)) + IDLE_SLEEP)
    idle = np.convolve(idle.astype(np.float64), np.ones(w), mode="same") > 0
    low &= ~idle
    if low.all() or not low.any():
        return None
    base_mask = np.zeros(g.n, dtype=bool)
    base_mask[lo : hi + 1] = ~low
    base_rate = float(counts[~low].sum() / (int((~low).sum()) * width_s))
    base = ctx.series.over_mask(base_mask)
    best: _Drop | None = None
    n_eps = 0
    lost_by_family: dict[str, int] = {}
    for a, b in runs(low, max_gap=0):
        if b - a + 1 < 2:
            continue
        ep_rate = float(counts[a : b + 1].sum() / ((b - a + 1) * width_s))
        fall = 1 - ep_rate / base_rate if base_rate > 0 else 0.0
        if fall < DROP:
            continue
        ep = ctx.series.over_range(lo + a, lo + b)
        found = _dominant_off_cpu(cz.assess(ep, base, st.p99_ns), ep, base, fall * (b - a + 1) * g.width_ns)
        if not found:
            ctx.notes.append(
                f"{ctx.node}: {st.name} ops/s fell {100 * fall:.0f}% at {fmt_ts(g.start_of(lo + a))} "
                f"({base_rate:.0f} → {ep_rate:.0f}/s for {short_ns((b - a + 1) * g.width_ns)}), no host cause recorded"
            )
            continue
        n_eps += 1
        ep.excess_ns = round(fall * (b - a + 1) * g.width_ns)  # the window's share of work not done
        fam = found[0].family
        lost_by_family[fam] = lost_by_family.get(fam, 0) + ep.excess_ns
        cand = _Drop(st, lo + a, lo + b, found, ep, base, "LOW", fall, base_rate, ep_rate, 0)
        if best is None or (-ep.excess_ns, -fall) < (-best.ep.excess_ns, -best.fall):
            best = cand
    if best is not None:
        best.episodes = n_eps
        fam = best.found[0].family  # severity from the work not done across the family's windows
        best.sev = cz.severity_of_loss(
            lost_by_family[fam],
            max(1, ctx.gpu.last_ns - ctx.gpu.first_ns),
            may_be_sleep=cz.may_be_sleep(fam, rows.tid, ctx.off.woken),
        )
    return best


def _dominant_off_cpu(found: list[cz.Cause], ep: Evidence, base: Evidence | None, lost_ns: float) -> list[cz.Cause]:
    """A drop's CPU contention (or unknown off-CPU time) is kept only when the GPU threads' off-CPU
    time above their baseline is the dominant share of the work not done."""
    above_inv = max(0.0, ep.offcpu_frac - (base.offcpu_frac if base else 0.0)) * ep.span_ns
    above_unk = max(0.0, ep.frac(ep.unknown_ns) - (base.frac(base.unknown_ns) if base else 0.0)) * ep.span_ns
    shares = cz.Shares(max(1, round(lost_ns)), inv_ns=round(above_inv), unk_ns=round(above_unk))
    return [c for c in found if c.family not in ("cpu", "offcpu") or (shares.of(c.family) or 0.0) >= cz.DOMINANT]


def _drop_chain(ctx: Context, d: _Drop, others: list[_Drop]) -> Chain:
    g = ctx.grid
    st, found, ep = d.st, d.found, d.ep
    start, end = g.start_of(d.b0), min(g.end_of(d.b1), ctx.frame.last_ns + 1)
    culprits: list[Culprit] = []
    if found[0].family == "cpu":  # who ran in the GPU threads' place in the window, measured
        tids = np.unique(ctx.rows(st).tid)
        culprits = ctx.preemptors(
            tids, np.full(tids.size, start, dtype=np.int64), np.full(tids.size, end, dtype=np.int64)
        ) or ctx.culprits(start, end)
    words = " + ".join(cz.phrase(c, ep) for c in found[:3])
    change = f"{d.base_rate:.0f} → {d.rate:.0f} ops/s"
    tl = cz.timeline(found, ep, culprits)
    tl.append(TimelineEntry(layer_of(st.source), st.name, f"throughput dropped {100 * d.fall:.0f}% ({change})"))
    also = ", ".join(f"{o.st.name} -{100 * o.fall:.0f}%" for o in others[:4])
    return ctx.chain(
        cid=ctx.chain_id("drop", found[0].family, st.name),
        detected_at=end,
        severity=d.sev,
        summary=f"{st.name} throughput dropped {100 * d.fall:.0f}% ({change}) — {words}",
        root_cause=cz.root_cause(found[0], ep, ctx.subject(ctx.rows(st).pid), culprits),
        explanation=(
            f"{st.name} ran at {d.base_rate:.0f} calls/s, then at {d.rate:.0f} calls/s from {fmt_ts(start)} to "
            f"{fmt_ts(end)} ({fmt_ns(end - start)}) with its per-call latency unchanged (p50 {fmt_ns(st.p50_ns)}): the "
            f"process issued less work; it did not wait longer per call. "
            + (f"Its other GPU calls fell with it ({also}). " if also else "")
            + f"In that window the host shows {words}. "
            + cz.mechanism(found[0].family, st.name)
        ),
        recommendations=cz.recommendations(found, ep),
        family=f"drop/{found[0].family}",
        evidence={
            "rule": "drop",
            "op": st.name,
            "baseline_per_s": round(d.base_rate, 1),
            "rate_per_s": round(d.rate, 1),
            "drop_pct": round(100 * d.fall, 1),
            "also_dropped": {o.st.name: round(100 * o.fall, 1) for o in others},
            "window_start_ns": start,
            "window_end_ns": end,
            "episodes": d.episodes,
            "causes": [c.family for c in found],
            "score": round(d.fall, 4),
            **cz.evidence_figures(ep, d.base),
        },
        timeline=tl,
        st=st,
    )
