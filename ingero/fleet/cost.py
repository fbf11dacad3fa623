"""The cost of waiting: dollars the ranks burned waiting for peers inside collectives.

Each rank is one GPU. Its waiting time in the window (:class:`~ingero.fleet.collectives.RankRow`
``wait_s``: last arrival − its own arrival, summed over the calls every rank took part in) is priced
at its GPU-hour rate from ``fleet.gpu_hourly_usd`` (:class:`~ingero.config.GpuRates`): the node's own
rate, else the first GPU model substring matching the node's GPU model (longest first), else the
default. Ranks with no rate are listed without dollars, never guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ingero.config import GpuRates
from ingero.fleet.collective_model import RankRow

SECONDS_PER_HOUR = 3600.0


def rate_for(rates: GpuRates, node: str, gpu_model: str = "") -> float | None:
    """Dollars per GPU-hour for a rank on ``node`` with ``gpu_model`` (None: no rate configured)."""
    if node in rates.nodes:
        return rates.nodes[node]
    model = gpu_model.lower()
    if model:
        for name in sorted(rates.models, key=len, reverse=True):
            if name.lower() in model:
                return rates.models[name]
    return rates.default


def configured(rates: GpuRates) -> bool:
    return rates.default is not None or bool(rates.models) or bool(rates.nodes)


@dataclass
class RankCost:
    node: str
    comm: str
    rank: int
    wait_s: float
    usd_per_hour: float | None
    gpu_model: str = ""

    @property
    def usd(self) -> float | None:
        return None if self.usd_per_hour is None else self.wait_s / SECONDS_PER_HOUR * self.usd_per_hour

    def as_dict(self) -> dict[str, Any]:
        usd = self.usd
        return {
            "node": self.node,
            "comm": self.comm,
            "rank": self.rank,
            "gpu_model": self.gpu_model,
            "wait_s": round(self.wait_s, 6),
            "usd_per_gpu_hour": self.usd_per_hour,
            "usd": None if usd is None else round(usd, 6),
        }


@dataclass
class WaitCost:
    ranks: list[RankCost] = field(default_factory=list)
    window_s: float = 0.0  # the span the waits were measured over (for the hourly figure)

    @property
    def wait_s(self) -> float:
        return sum(r.wait_s for r in self.ranks)

    @property
    def usd(self) -> float:
        return sum(r.usd or 0.0 for r in self.ranks)

    @property
    def unpriced(self) -> list[RankCost]:
        return [r for r in self.ranks if r.usd_per_hour is None]

    @property
    def usd_per_hour(self) -> float | None:
        """The waste rate: dollars per hour of job time, at this window's waiting."""
        return self.usd / self.window_s * SECONDS_PER_HOUR if self.window_s > 0 else None

    def line(self) -> str:
        """``cost: peers' waiting burned $12.40 in this window (~$53.10 per hour of the job)``."""
        if not self.ranks:
            return "cost: no waiting in collectives measured"
        if len(self.unpriced) == len(self.ranks):
            return (
                f"cost: {_hours(self.wait_s)} of GPU time spent waiting; set fleet.gpu_hourly_usd in the config "
                "to see it in dollars"
            )
        text = f"cost: waiting in collectives burned ${self.usd:,.2f} of GPU time in this window"
        rate = self.usd_per_hour
        if rate is not None:
            text += f" (~${rate:,.2f} per hour of the job)"
        if self.unpriced:
            text += f"; {len(self.unpriced)} rank(s) without a rate"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "wait_s": round(self.wait_s, 6),
            "usd": round(self.usd, 6),
            "usd_per_hour": None if self.usd_per_hour is None else round(self.usd_per_hour, 4),
            "window_s": round(self.window_s, 3),
            "unpriced_ranks": len(self.unpriced),
            "line": self.line(),
            "ranks": [r.as_dict() for r in self.ranks],
        }


def wait_cost(ranks: Sequence[RankRow], rates: GpuRates, *, window_s: float = 0.0) -> WaitCost:
    """Price every rank's waiting (ranks that never waited are left out)."""
    out = WaitCost(window_s=window_s)
    for r in sorted(ranks, key=lambda r: -r.wait_s):
        if r.wait_s <= 0:
            continue
        out.ranks.append(RankCost(r.node, r.comm, r.rank, r.wait_s, rate_for(rates, r.node, r.gpu_model), r.gpu_model))
    return out


def _hours(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} GPU-hours"
    if s >= 60:
        return f"{s / 60:.1f} GPU-minutes"
    return f"{s:.1f} GPU-seconds"
