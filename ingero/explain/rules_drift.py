"""Kernel-duration drift: the same work slower and slower over the run (thermal or power capping).

A GPU that heats up or hits its power cap lowers its clocks: every kernel takes a little longer than
the one before, a gradual slowdown well under 2x. No call is "slow" against the op's steady level (the
regime finder of :mod:`ingero.explain.regimes` needs 2x), no stretch stands out, and yet the run loses
seconds. What shows it is the *trend* of the op's duration over time.

Per op, in time order (per op and not per kernel: a launch returns once the kernel is queued, so its
duration says nothing of the kernel's; the kernels' time shows in the calls that wait for them — syncs,
blocking copies — and a per-kernel split would need ``arg0`` matched to every launch for nothing):

1. the calls are cut into at most :data:`~ingero.explain.regimes.BLOCKS` consecutive blocks, each
   reduced to the median time and median duration of up to :data:`PER_BLOCK` of its calls, evenly
   spaced (noise-proof, and the cost stays flat however many calls an op has); blocks at
   :data:`~ingero.explain.regimes.SLOW_FACTOR` x the op's steady level (the lower quartile of the block
   medians) or more are left out — a slower regime, the regime finder's;
2. a least-squares line through the block medians: ``dur(t) = early + slope x t``; its standard error
   from the residuals;
3. it is drift when the slope is positive and :data:`MIN_T` standard errors from zero, the line rises
   at least :data:`MIN_RISE` of the early level over the run and less than 2x (beyond, it is a regime),
   and the line explains the blocks (R² ≥ :data:`MIN_R2`: a slowdown in the middle of the run is a
   stretch, not a trend).

A steeper drift (the line through every block rises :data:`MAX_RISE` or more) is still drift: the steady
level (the blocks' lower quartile) drifts with it, so the regime finder never sees 2x of it and the
drift would go unnamed. It is named when that line is a trend (``MIN_T``, ``MIN_R2``) that fits the
blocks better than any single step — a slower regime that starts mid-run fits a step, and stays the
regime finder's — and its lost time is every call's fitted excess over the early level.

Time lost: each call's fitted excess over the early level, ``Σ slope x t_i`` (calls of a slower regime
left out) — never more than the calls' own time nor the wall time. Severity from lost time over wall time like every other chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, layer_of, short_ns
from ingero.explain.frame import I64
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.regimes import BLOCKS, F64, MIN_BLOCK, SLOW_FACTOR, STEADY_QUANTILE
from ingero.explain.stats import OpStats

MIN_CALLS = 8 * MIN_BLOCK  # at least eight blocks to fit a line through
MIN_T = 5.0  # the slope this many standard errors above zero
MIN_RISE = 0.02  # the line rises at least this share of the early level over the run ...
MAX_RISE = SLOW_FACTOR - 1.0  # ... and less than this (a 2x slowdown is a regime)
MIN_R2 = 0.3  # the line explains this share of the blocks' variance: a trend, not a stretch
PER_BLOCK = 64  # calls a block's median is taken from, evenly spaced


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


def _block_medians(t: F64, d: F64, k: int) -> tuple[F64, F64]:
    """Median time and duration of ``k`` consecutive blocks of calls, each from at most
    :data:`PER_BLOCK` calls evenly spaced in it (a block median needs no more; the cost stays flat)."""
    block = t.size // k
    take = np.linspace(0, block - 1, min(block, PER_BLOCK)).astype(np.int64)
    idx = (np.arange(k)[:, None] * block + take[None, :]).ravel()
    shape = (k, take.size)
    return np.median(t[idx].reshape(shape), axis=1), np.median(d[idx].reshape(shape), axis=1)


def _line(bt: F64, bd: F64) -> tuple[float, float, float, float, float] | None:
    """Least squares ``bd = early + slope x bt``: (early, slope, t statistic, R², residual sum of squares)."""
    k = int(bt.size)
    x = bt - bt.mean()
    sxx = float(x @ x)
    if k < 3 or sxx <= 0:
        return None
    slope = float(x @ (bd - bd.mean())) / sxx
    early = float(bd.mean()) - slope * float(bt.mean())
    resid = bd - (early + slope * bt)
    ss_res, ss_tot = float(resid @ resid), float(((bd - bd.mean()) ** 2).sum())
    se = np.sqrt(ss_res / (k - 2) / sxx) if ss_res > 0 else 0.0
    t_stat = slope / se if se > 0 else (np.inf if slope > 0 else 0.0)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    return early, slope, float(t_stat), r2, ss_res


def _step_ss(bd: F64) -> float:
    """The residual sum of squares of the best single step through the block medians (two flat levels)."""
    k = int(bd.size)
    c1, c2 = np.cumsum(bd), np.cumsum(bd * bd)
    n_l = np.arange(1, k, dtype=np.float64)
    s_l, q_l = c1[:-1], c2[:-1]
    s_r, q_r = c1[-1] - s_l, c2[-1] - q_l
    ss = (q_l - s_l * s_l / n_l) + (q_r - s_r * s_r / (k - n_l))
    return float(ss.min())


def _steep(t: F64, d: F64, bt: F64, bd: F64) -> Drift | None:
    """A drift that rises :data:`MAX_RISE` or more over the run: the steady level drifts with it, so the
    regime finder never sees 2x of it (a trend is not a regime). Named when the line through every block
    is a trend (``MIN_T``, ``MIN_R2``) that fits better than any single step (a slower regime that starts
    mid-run fits a step, a drift a line); its lost time is every call's fitted excess over the early level."""
    if bt.size < 8:
        return None
    line = _line(bt, bd)
    if line is None:
        return None
    early, slope, t_stat, r2, ss_res = line
    if early <= 0 or slope / early < MAX_RISE or t_stat < MIN_T or r2 < MIN_R2 or ss_res >= _step_ss(bd):
        return None
    lost = float(np.minimum(slope * t, d).sum())
    return Drift(early, early + slope, t_stat, r2, int(d.size), lost)


def fit(ts_ns: I64, dur: I64) -> Drift | None:
    """The drift of one op's calls (any order), or None when they show no trend (see the module
    docstring)."""
    if ts_ns.size < MIN_CALLS:
        return None
    if bool((np.diff(ts_ns) < 0).any()):
        order = np.argsort(ts_ns, kind="stable")
        ts_ns, dur = ts_ns[order], dur[order]
    span = float(ts_ns[-1] - ts_ns[0])
    if span <= 0:
        return None
    t, d = (ts_ns - ts_ns[0]) / span, dur.astype(np.float64)
    bt, bd = _block_medians(t, d, min(BLOCKS, t.size // MIN_BLOCK))
    steep = _steep(t, d, bt, bd)
    if steep is not None:
        return steep
    steady = max(float(np.quantile(bd, STEADY_QUANTILE)), 1.0)  # as regimes.steady_level
    fast = bd < SLOW_FACTOR * steady  # blocks inside a slower regime are the regime finder's
    bt, bd = bt[fast], bd[fast]
    line = _line(bt, bd) if bt.size >= 8 else None
    if line is None:
        return None
    early, slope, t_stat, r2, _ = line
    if early <= 0 or slope <= 0 or t_stat < MIN_T or r2 < MIN_R2 or not MIN_RISE <= slope / early < MAX_RISE:
        return None
    kept = d < SLOW_FACTOR * steady  # a slower regime's calls: their excess is the regime finder's
    lost = float(np.minimum(slope * t[kept], d[kept]).sum())
    return Drift(early, early + slope, float(t_stat), r2, int(kept.sum()), lost)


def drift_chains(ctx: Context) -> list[Chain]:
    """One chain per op (or kernel) whose calls drift slower over the run, losing ≥ 1 % of wall time."""
    g = ctx.gpu
    wall = max(1, g.last_ns - g.first_ns)
    out: list[Chain] = []
    for st in ctx.ops:
        if st.count < MIN_CALLS:
            continue
        rows = ctx.rows(st)
        dr = fit(rows.ts_ns, rows.dur)
        if dr is None or not cz.worth_a_chain(min(dr.lost_ns, wall), wall):
            continue
        out.append(_chain(ctx, st, dr, min(dr.lost_ns, wall), wall, int(rows.ts_ns.max())))
    return out


def _chain(ctx: Context, st: OpStats, dr: Drift, lost: float, wall: int, last: int) -> Chain:
    what = st.name
    early, late = short_ns(dr.early_ns), short_ns(dr.late_ns)
    share = lost / wall
    words = f"{what} drifted from {early} to {late} (+{100 * dr.rise:.0f}%) over the run"
    return ctx.chain(
        cid=ctx.chain_id("drift", st.name),
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
