"""Outliers by median absolute deviation: the robust z-score (:func:`robust_z`, :data:`Z_THRESHOLD`) the
fleet's verdicts share — per-node figures (:mod:`ingero.fleet.straggler`), clock offsets
(:mod:`ingero.fleet.fleet_skew`) — and slow ranks on one metric of the collectives join (:func:`outlier_ranks`).
This module needs numpy only (the rank model is a type here), so the clock-skew pass loads nothing else.

Metrics of each rank (:class:`~ingero.fleet.collectives.RankRow`):

* ``lag`` (default) — its median lag, in ms, over the calls where it arrived last (0 when never last);
* ``last`` — the share of calls where it arrived last;
* ``wait`` — the share of its time it waited for others; *low* is suspicious here (the straggler is
  the one that never waits), so the score is taken on the negated value.

A rank is an outlier when its robust z-score (``0.6745 · (x − median) / MAD``, :func:`robust_z`)
reaches ``threshold`` *and* its distance from the median clears the metric's absolute floor (for
``lag`` also its clock uncertainty): near-identical ranks never produce outliers from noise. Outliers
come slowest first (by lag).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ingero.fleet.collective_model import RankRow

Z_THRESHOLD = 3.5  # robust z-score of an outlier (Iglewicz & Hoaglin)

# metric -> (what it is, value of a rank, sign: +1 high is bad / −1 low is bad, absolute floor)
METRICS: dict[str, tuple[str, Callable[[RankRow], float], int, float]] = {
    "lag": ("median lag when arriving last (ms)", lambda r: r.median_lag_ms, +1, 0.5),
    "last": ("share of calls arriving last", lambda r: r.last_share, +1, 0.2),
    "wait": ("share of its time spent waiting for others", lambda r: r.wait_share, -1, 0.01),
}
DEFAULT_METRIC = "lag"


def robust_z(values: np.ndarray) -> np.ndarray:
    """Modified z-scores, median/MAD. All-equal peers with one differing value give ±inf."""
    x = np.asarray(values, dtype=np.float64)
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med)))
    floor = 1e-3 * abs(med)  # differences below 0.1% of the median are noise, not signal
    dev = x - med
    if mad <= floor:
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(np.abs(dev) <= floor, 0.0, np.sign(dev) * np.inf)
        return np.asarray(z, dtype=np.float64)
    return np.asarray(0.6745 * dev / mad, dtype=np.float64)


@dataclass(frozen=True)
class RankOutlier:
    row: RankRow
    metric: str
    value: float
    median: float
    z: float

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.row.as_dict(),
            "metric": self.metric,
            "value": round(self.value, 5),
            "median": round(self.median, 5),
            "z": None if math.isinf(self.z) else round(self.z, 2),
        }


def outlier_ranks(
    ranks: Sequence[RankRow], metric: str = DEFAULT_METRIC, threshold: float = Z_THRESHOLD
) -> list[RankOutlier]:
    """Ranks standing out on ``metric`` (see the module docstring), slowest first."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r} is not one of {', '.join(METRICS)}")
    if len(ranks) < 2:
        return []
    _, value_of, sign, floor = METRICS[metric]
    values = np.array([value_of(r) for r in ranks], dtype=np.float64)
    z = robust_z(sign * values)
    med = float(np.median(values))
    out = []
    for i, r in enumerate(ranks):
        need = floor + (r.uncertainty_ms if metric == "lag" else 0.0)
        if z[i] >= threshold and abs(values[i] - med) > need:
            out.append(RankOutlier(r, metric, float(values[i]), med, float(z[i])))
    out.sort(key=lambda o: (-o.row.median_lag_ms, -o.z if math.isfinite(o.z) else -1e300))
    return out
