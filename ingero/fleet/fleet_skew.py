"""The fleet's clock skew on numpy: every node's samples in one set of arrays.

:func:`fit` takes ``t1..t4`` of every sample of every node (int64 Unix ns, the four-timestamp method of
:mod:`ingero.fleet.skew`) with each sample's node index, and gives per node, with no Python loop over
nodes or samples:

* **the lowest-delay sample** (ties: the first) — its offset ``((t2 − t1) + (t3 − t4)) / 2`` ± ``delay / 2``,
  the causal bound :mod:`ingero.fleet.skew` explains. Samples with a negative delay beyond the agent clock's rate error are discarded (``TimeSample.plausible``).
* **its drift**, with ≥ :data:`MIN_DRIFT_SAMPLES` samples: how much faster the agent's clock runs than
  ours, in ppm — the slope of offset against time (this host's clock, the middle of each round trip).
  As chrony does, slow samples stay out (chrony's ``maxdelayratio``: a delay over
  :data:`MAX_DELAY_RATIO` × the node's lowest, though the 3 lowest always stay) and the rest are
  weighted by how far their bound lets them stray: weighted least squares with weight 1/σ², σ the
  standard deviation of an offset anywhere in its ±delay/2 interval (delay/√12, at least
  :data:`SIGMA_FLOOR_NS`) — only the weights' ratios matter. The uncertainty is the slope's 95 %
  interval: Student's t for the fit's degrees of freedom times the standard error estimated from the
  residuals (chrony's a-posteriori estimate: the bounds of round trips are far wider than the scatter
  of their offsets, and a clock that stepped or wanders shows up there), at least what
  :data:`SIGMA_FLOOR_NS` allows. Under 3 samples, or with every sample at one instant, the drift is None.

:func:`fleet_outliers` then takes the answering nodes' offsets: their median and, per node, the robust
z-score ``0.6745 · (x − median) / MAD`` (:func:`ingero.fleet.outliers.robust_z`). A node is an outlier
when ``|z|`` reaches :data:`~ingero.fleet.outliers.Z_THRESHOLD` *and* it sits further from the median
than its own uncertainty plus the fleet's typical one — near-identical clocks never make outliers from
noise. Fewer than 3 nodes have no median to speak of: no z, no outlier.

:func:`fleet_estimates` runs both over the fan-out's :class:`~ingero.fleet.skew.SkewEstimate` list.
This module imports numpy: the fan-out loads it in a worker thread once its answers are in
(:func:`ingero.fleet.skew.refine`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ingero.fleet.outliers import Z_THRESHOLD, robust_z
from ingero.fleet.skew import HOLD_RATE_TOLERANCE, SkewEstimate, TimeSample
from ingero.timeutil import NS_PER_S

MIN_DRIFT_SAMPLES = 3  # a slope from two points has no residual to check it against
MAX_DELAY_RATIO = 4.0  # samples slower than this × the node's fastest stay out of the drift fit
SIGMA_FLOOR_NS = 1_000.0  # a sample's σ, at least: reading a clock from Python costs about a microsecond
PPM = 1e-6
# Student's t, two-sided 95 %, for 1..10 degrees of freedom; beyond, 1.96 + 2.5/dof (within 0.015)
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)

if TYPE_CHECKING:  # numpy.typing costs an import at run time
    import numpy.typing as npt

    Floats = npt.NDArray[np.float64]
    Ints = npt.NDArray[np.int64]
    Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class NodeFits:
    """Per node (arrays indexed by node): the winning sample and the drift; NaN where there is none."""

    best: Ints  # index of the lowest-delay sample, −1 when the node has no valid sample
    offset_ns: Floats
    delay_ns: Floats
    samples: Ints  # valid samples
    drift_ppm: Floats
    drift_uncertainty_ppm: Floats


def sample_arrays(per_node: Sequence[Sequence[TimeSample]]) -> tuple[Ints, Ints]:
    """(node index of each sample, ``t1..t4`` as an (n, 4) int64 array) over every node's samples."""
    node = np.repeat(np.arange(len(per_node), dtype=np.int64), [len(p) for p in per_node])
    t = np.array([(s.t1, s.t2, s.t3, s.t4) for p in per_node for s in p], dtype=np.int64).reshape(-1, 4)
    return node, t


def fit(node: Ints, t: Ints, n_nodes: int) -> NodeFits:
    """Lowest-delay sample and drift of every node at once (see the module docstring)."""
    t1, t2, t3, t4 = (t[:, i] for i in range(4))
    offset = ((t2 - t1) + (t3 - t4)) / 2  # int64 differences: exact, then one rounding to float64
    hold = t3 - t2
    raw = ((t4 - t1) - hold).astype(np.float64)
    valid = raw >= -HOLD_RATE_TOLERANCE * np.maximum(hold, 0)  # TimeSample.plausible
    delay = np.maximum(raw, 0.0)  # TimeSample.delay_ns
    n_valid = np.bincount(node[valid], minlength=n_nodes).astype(np.int64)
    nan = np.full(n_nodes, np.nan)
    if not valid.any():
        return NodeFits(np.full(n_nodes, -1, dtype=np.int64), nan, nan, n_valid, nan, nan)
    # Sorted by node, then delay (invalid samples last); lexsort is stable, so ties keep list order.
    order = np.lexsort((np.where(valid, delay, np.inf), node))
    starts = np.searchsorted(node[order], np.arange(n_nodes))
    has = n_valid > 0
    best = np.where(has, order[np.minimum(starts, len(order) - 1)], -1).astype(np.int64)
    at_best = np.maximum(best, 0)
    best_offset = np.where(has, offset[at_best], np.nan)
    best_delay = np.where(has, delay[at_best], np.nan)
    drift, drift_unc = _drift(node, t1, t4, offset, delay, valid, order, starts, at_best, n_nodes)
    return NodeFits(best, best_offset, best_delay, n_valid, drift, drift_unc)


def _drift(
    node: Ints,
    t1: Ints,
    t4: Ints,
    offset: Floats,
    delay: Floats,
    valid: Bools,
    order: Ints,
    starts: Ints,
    best: Ints,
    n_nodes: int,
) -> tuple[Floats, Floats]:
    """Weighted least-squares slope of offset vs time per node, ppm, and its 95 % half-interval
    (``best``: each node's lowest-delay sample, any index for a node without one)."""
    nan = np.full(n_nodes, np.nan)
    rank = np.empty(len(order), dtype=np.int64)  # place of each sample in its node's delay order
    rank[order] = np.arange(len(order)) - starts[node[order]]
    fastest = delay[best][node]
    keep = valid & ((delay <= MAX_DELAY_RATIO * fastest + SIGMA_FLOOR_NS) | (rank < MIN_DRIFT_SAMPLES))
    k = np.bincount(node[keep], minlength=n_nodes)
    keep &= k[node] >= MIN_DRIFT_SAMPLES
    if not keep.any():
        return nan, nan.copy()
    nd = node[keep]
    ref = t1[best][nd]  # each node's own time origin: float64 keeps ns resolution over days
    x = ((t1[keep] - ref) + (t4[keep] - ref)) / 2 / NS_PER_S  # seconds, this host's clock
    y = offset[keep] - offset[best][nd]  # ns
    w = 1.0 / np.maximum(delay[keep] / math.sqrt(12), SIGMA_FLOOR_NS) ** 2
    sw = np.bincount(nd, w, minlength=n_nodes)
    with np.errstate(divide="ignore", invalid="ignore"):
        dx = x - (np.bincount(nd, w * x, minlength=n_nodes) / sw)[nd]
        dy = y - (np.bincount(nd, w * y, minlength=n_nodes) / sw)[nd]
        sxx = np.bincount(nd, w * dx * dx, minlength=n_nodes)
        slope = np.bincount(nd, w * dx * dy, minlength=n_nodes) / sxx  # ns per s
        resid = dy - slope[nd] * dx
        chi2 = np.bincount(nd, w * resid * resid, minlength=n_nodes)
        dof = np.maximum(k - 2, 1)
        floor = SIGMA_FLOOR_NS**2 / np.bincount(nd, dx * dx, minlength=n_nodes)
        var = np.maximum(chi2 / dof / sxx, floor)  # a-posteriori: the residuals' scatter
        ok = (k >= MIN_DRIFT_SAMPLES) & (sxx > 0) & np.isfinite(slope)
        drift = np.where(ok, slope * 1e-9 / PPM, np.nan)
        unc = np.where(ok, t95(dof) * np.sqrt(var) * 1e-9 / PPM, np.nan)
    return drift, unc


def t95(dof: Ints) -> Floats:
    """Two-sided 95 % quantile of Student's t for each count of degrees of freedom (≥ 1)."""
    table = np.array(T95)
    d = np.maximum(dof, 1)
    return np.asarray(np.where(d <= len(T95), table[np.minimum(d, len(T95)) - 1], 1.96 + 2.5 / d), dtype=np.float64)


def fleet_outliers(offset_ns: Floats, uncertainty_ns: Floats, member: Bools) -> tuple[float | None, Floats, Bools]:
    """The members' median offset; each member's robust z against it and whether it is an outlier
    (NaN / False for non-members, and for everyone under 3 members)."""
    z = np.full(len(offset_ns), np.nan)
    outlier = np.zeros(len(offset_ns), dtype=np.bool_)
    if int(member.sum()) < 3:
        return None, z, outlier
    values = offset_ns[member]
    median = float(np.median(values))
    # Centred on the median first, so robust_z's noise floor (relative to the median's size) is nil:
    # how far this host's own clock is from the fleet says nothing about the spread between nodes.
    z[member] = robust_z(values - median)
    typical = float(np.median(uncertainty_ns[member]))
    beyond = np.abs(offset_ns - median) > uncertainty_ns + typical
    outlier[member] = (np.abs(z[member]) >= Z_THRESHOLD) & beyond[member]
    return median, z, outlier


def fleet_estimates(
    estimates: Sequence[SkewEstimate | None], answered: Sequence[bool] | None = None
) -> list[SkewEstimate | None]:
    """Every node's estimate again, from all nodes' samples at once, with its drift, the fleet median
    (of the ``answered`` nodes: all by default) and its z-score / outlier flag. A node without an
    estimate stays None; one without samples (built by hand) keeps its offset and delay."""
    n = len(estimates)
    node, t = sample_arrays([e.points if e is not None else () for e in estimates])
    fits = fit(node, t, n)
    has_points = fits.best >= 0
    own = np.array([(e.offset_ns, e.delay_ns) if e is not None else (np.nan, np.nan) for e in estimates])
    own = own.reshape(n, 2)
    offset = np.where(has_points, fits.offset_ns, own[:, 0])
    delay = np.where(has_points, fits.delay_ns, own[:, 1])
    present = np.array([e is not None for e in estimates], dtype=np.bool_)
    member = present & np.array(answered if answered is not None else [True] * n, dtype=np.bool_)
    median, z, outlier = fleet_outliers(offset, delay / 2, member)
    out: list[SkewEstimate | None] = []
    for i, e in enumerate(estimates):
        if e is None:
            out.append(None)
            continue
        out.append(
            replace(
                e,
                offset_ns=float(offset[i]),
                delay_ns=float(delay[i]),
                drift_ppm=_opt(fits.drift_ppm[i]),
                drift_uncertainty_ppm=_opt(fits.drift_uncertainty_ppm[i]),
                fleet_median_ns=median,
                z=_opt(z[i], finite=False),
                outlier=bool(outlier[i]),
            )
        )
    return out


def _opt(x: np.floating | float, *, finite: bool = True) -> float | None:
    """A float, or None for NaN (and for ±inf unless ``finite`` is False)."""
    v = float(x)
    if math.isnan(v) or (finite and math.isinf(v)):
        return None
    return v
