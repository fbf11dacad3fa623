"""Kernel-duration drift: the same work slower and slower over the run (thermal or power capping).

A GPU that heats up or hits its power cap lowers its clocks: every kernel takes a little longer than
the one before, a gradual slowdown well under 2x. No call is "slow" against the op's steady level (the
regime finder of :mod:`ingero.explain.regimes` needs 2x), no stretch stands out, and yet the run loses
seconds. What shows it is the *trend* of the op's duration over time.

Per op (per kernel function where ``arg0`` names it, for launches), in time order:

1. calls at :data:`~ingero.explain.regimes.SLOW_FACTOR` x the op's steady level or more are left out
   (a slower regime, the regime finder's); the rest are cut into consecutive blocks (as for the steady
   level), each block reduced to its median time and median duration (noise-proof);
2. a least-squares line through the block medians: ``dur(t) = early + slope x t``; its standard error
   from the residuals;
3. it is drift when the slope is positive and :data:`MIN_T` standard errors from zero, the line rises
   at least :data:`MIN_RISE` of the early level over the run and less than 2x (beyond, it is a regime),
   and the line explains the blocks (R² ≥ :data:`MIN_R2`: a slowdown in the middle of the run is a
   stretch, not a trend).

Time lost: each kept call's fitted excess over the early level, ``Σ slope x t_i`` — never more than the
calls' own time nor the wall time. Severity from lost time over wall time like every other chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, layer_of, short_ns
from ingero.explain.frame import I64
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.regimes import BLOCKS, MIN_BLOCK, SLOW_FACTOR, steady_level
from ingero.explain.stats import OpStats
from ingero.store.catalog import op_ids

MIN_CALLS = 8 * MIN_BLOCK  # at least eight blocks to fit a line through
MIN_T = 5.0  # the slope this many standard errors above zero
MIN_RISE = 0.02  # the line rises at least this share of the early level over the run ...
MAX_RISE = SLOW_FACTOR - 1.0  # ... and less than this (a 2x slowdown is a regime)
MIN_R2 = 0.3  # the line explains this share of the blocks' variance: a trend, not a stretch
LAUNCH_OPS = op_ids("cudaLaunchKernel", "cuLaunchKernel")


@dataclass(frozen=True)
class Drift:
    """A fitted trend of one op's call durations: early level, level at the end, lost time."""

    early_ns: float
    late_ns: float
    t_stat: float
    r2: float
    calls: int
    lost_ns: float

    @property
    def rise(self) -> float:
        return self.late_ns / self.early_ns - 1.0 if self.early_ns > 0 else 0.0


def fit(ts_ns: I64, dur: I64) -> Drift | None:
    """The drift of one op's calls (any order), or None when they show no trend (see the module
    docstring)."""
    if ts_ns.size < MIN_CALLS:
        return None
    order = np.argsort(ts_ns, kind="stable")
    ts, d = ts_ns[order].astype(np.float64), dur[order].astype(np.float64)
    keep = d < SLOW_FACTOR * max(steady_level(d), 1)
    ts, d = ts[keep], d[keep]
    span = float(ts[-1] - ts[0]) if ts.size else 0.0
    if ts.size < MIN_CALLS or span <= 0:
        return None
    t = (ts - ts[0]) / span
    block = max(MIN_BLOCK, -(-t.size // BLOCKS))
    k = t.size // block
    bt = np.median(t[: k * block].reshape(k, block), axis=1)
    bd = np.median(d[: k * block].reshape(k, block), axis=1)
    x = bt - bt.mean()
    sxx = float(x @ x)
    if k < 8 or sxx <= 0:
        return None
    slope = float(x @ (bd - bd.mean())) / sxx
    early = float(bd.mean()) - slope * float(bt.mean())
    resid = bd - (early + slope * bt)
    ss_res, ss_tot = float(resid @ resid), float(((bd - bd.mean()) ** 2).sum())
    se = np.sqrt(ss_res / (k - 2) / sxx) if ss_res > 0 else 0.0
    t_stat = slope / se if se > 0 else (np.inf if slope > 0 else 0.0)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    if early <= 0 or slope <= 0 or t_stat < MIN_T or r2 < MIN_R2 or not MIN_RISE <= slope / early < MAX_RISE:
        return None
    lost = min(float(np.minimum(slope * t, d).sum()), float(d.sum()))
    return Drift(early, early + slope, float(t_stat), r2, int(t.size), lost)


def _groups(ctx: Context, st: OpStats) -> list[tuple[int | None, I64, I64]]:
    """(kernel function or None, starts, durations) of the op's calls: per kernel for launches whose
    ``arg0`` is recorded, else the op as one."""
    rows = ctx.rows(st)
    fn = ctx.arg0_of(rows) if (st.source, st.op) in LAUNCH_OPS else None
    if fn is None:
        return [(None, rows.ts_ns, rows.dur)]
    return [(int(f), rows.ts_ns[fn == f], rows.dur[fn == f]) for f in np.unique(fn).tolist()]


def drift_chains(ctx: Context) -> list[Chain]:
    """One chain per op (or kernel) whose calls drift slower over the run, losing ≥ 1 % of wall time."""
    g = ctx.gpu
    wall = max(1, g.last_ns - g.first_ns)
    out: list[Chain] = []
    for st in ctx.ops:
        if st.count < MIN_CALLS:
            continue
        for fn, ts, dur in _groups(ctx, st):
            dr = fit(ts, dur)
            if dr is None or not cz.worth_a_chain(min(dr.lost_ns, wall), wall):
                continue
            out.append(_chain(ctx, st, fn, dr, min(dr.lost_ns, wall), wall, int(ts.max())))
    return out


def _chain(ctx: Context, st: OpStats, fn: int | None, dr: Drift, lost: float, wall: int, last: int) -> Chain:
    what = st.name if fn is None else f"{st.name} (kernel {fn:#x})"
    early, late = short_ns(dr.early_ns), short_ns(dr.late_ns)
    share = lost / wall
    words = f"{what} drifted from {early} to {late} (+{100 * dr.rise:.0f}%) over the run"
    return ctx.chain(
        cid=ctx.chain_id("drift", st.name, "" if fn is None else f"{fn:x}"),
        detected_at=last,
        severity=cz.severity_of_loss(lost, wall),
        summary=f"{words}: {short_ns(lost)} lost ({100 * share:.1f}% of wall time)",
        root_cause=(
            "the same GPU work takes longer and longer — the GPU is slowing down over time (thermal throttling or "
            "power capping lowers its clocks), not one incident"
        ),
        explanation=(
            f"A line through the medians of {st.name}'s calls in time order ({dr.calls} calls, slower regimes left "
            f"out) rises from {early} to {late}: {dr.t_stat:.0f} standard errors above flat, R² {dr.r2:.2f}. Each "
            f"call's excess over the early level adds up to {short_ns(lost)}, {100 * share:.1f}% of the "
            "wall time."
        ),
        recommendations=[
            "Watch clocks and throttle reasons while it runs: nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE,POWER",
            "Check cooling and airflow (GPU temperature near its slowdown threshold) and the power limit "
            "(nvidia-smi -q -d POWER); DCGM field DCGM_FI_DEV_CLOCK_THROTTLE_REASONS names the cause",
        ],
        family="drift/gpu",
        evidence={
            "rule": "drift",
            "op": st.name,
            **({"kernel": fn} if fn is not None else {}),
            "early_us": round(dr.early_ns / 1000, 1),
            "late_us": round(dr.late_ns / 1000, 1),
            "rise": round(dr.rise, 4),
            "t_stat": round(dr.t_stat, 1),
            "r2": round(dr.r2, 3),
            "lost_ms": round(lost / 1e6, 1),
            "lost_share": round(share, 4),
            "score": round(share, 4),
        },
        timeline=[TimelineEntry(layer_of(st.source), st.name, words, round(dr.late_ns / 1000))],
        st=st,
    )
