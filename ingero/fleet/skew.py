"""Clock skew between this host and each agent: NTP's four-timestamp method.

One sample is one round trip — every answer of an agent carries its ``t2``/``t3`` in the
``x-ingero-receive-ns``/``x-ingero-transmit-ns`` headers (so the query itself is a sample), and
``GET /api/v1/time`` returns them in its body:

* ``t1`` — this host's wall clock when the request leaves,
* ``t2`` — the agent's wall clock when the request arrived (``receive_ns``),
* ``t3`` — the agent's wall clock when the answer left (``transmit_ns``),
* ``t4`` — this host's wall clock when the answer arrived.

``offset = ((t2 − t1) + (t3 − t4)) / 2`` is how far the agent's clock is ahead of ours (negative:
behind) and ``delay = (t4 − t1) − (t3 − t2)`` the network round trip. Causality bounds the true
offset to ``[t3 − t4, t2 − t1]``, which is exactly ``offset ± delay / 2``: that is the uncertainty we
report. Several samples are taken per node and the one with the lowest delay wins (the tightest
bound). ``t1``/``t4`` are taken by the fan-out's transport around the bytes on the wire, ``t4`` as
``t1`` plus a ``perf_counter_ns`` interval, so a clock step on this host in the middle of a sample
cannot corrupt it.

This module is the arithmetic of one node's samples in plain Python (what the fan-out computes as each
node ends, without numpy). The fleet's estimate is :mod:`ingero.fleet.fleet_skew`'s, on numpy: arrays
of ``t1..t4`` over every node's samples give each node its lowest-delay sample, its drift in ppm (with
≥ 3 samples), and the fleet's median offset and MAD outliers.

numpy's import (~80 ms of CPU) never delays the first byte on the wire, nor a sample's stamps: this
module and the fan-out's path import no numpy, and :func:`refine` — which ``fleet status`` and ``explain
--nodes`` call once their fan-out's last answer is in, and only when some node has a sample — imports it
in a worker thread (a query keeps each node's own estimate and no numpy). Not earlier, overlapping the
answers in flight: answers that arrive while an import holds the interpreter are stamped late (``t4``),
which widens every bound they give. Measured (6 local agents, fresh processes, a loaded 2-core host):
starting the import at a fan-out's first sample doubled the median uncertainty (5.1 ms vs 2.3 ms; one
agent: 2.3 vs 1.1 ms) to save 40–80 ms of wall time; a shorter GIL switch interval did not help.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ingero.timeutil import NS_PER_MS

if TYPE_CHECKING:
    from types import ModuleType

RECEIVE_HEADER = "x-ingero-receive-ns"  # t2, on every agent answer
TRANSMIT_HEADER = "x-ingero-transmit-ns"  # t3
FIT_MODULE = "ingero.fleet.fleet_skew"  # the numpy estimator, imported off the wire path


# an agent clock's rate may be off by this much (20,000 ppm: NTP allows 500) over its hold time, t3 - t2
HOLD_RATE_TOLERANCE = 0.02


@dataclass(frozen=True)
class TimeSample:
    """One /time round trip (all wall-clock Unix ns)."""

    t1: int
    t2: int
    t3: int
    t4: int

    @property
    def offset_ns(self) -> float:
        return ((self.t2 - self.t1) + (self.t3 - self.t4)) / 2

    @property
    def delay_ns(self) -> float:
        """The round trip less the agent's hold time, at least 0 (see :attr:`plausible`)."""
        return max(0.0, float((self.t4 - self.t1) - (self.t3 - self.t2)))

    @property
    def plausible(self) -> bool:
        """Whether the sample can be used: its delay is negative by no more than the agent's hold time
        (``t3 − t2``, read on its own clock) can be off at :data:`HOLD_RATE_TOLERANCE` — a clock running
        fast stretches the hold past a short round trip; beyond that the clock stepped or is broken."""
        hold = self.t3 - self.t2
        return (self.t4 - self.t1) - hold >= -HOLD_RATE_TOLERANCE * max(0, hold)


@dataclass(frozen=True)
class SkewEstimate:
    """The best (lowest-delay) sample's offset, with its ±delay/2 uncertainty; after the fleet pass
    (:func:`refine`) also the node's drift and how it stands against the fleet's median offset."""

    offset_ns: float  # > 0: the agent's clock is ahead of this host's
    delay_ns: float  # round trip of the winning sample
    samples: int  # samples that succeeded
    failed: int = 0  # samples that did not (they never drop the node)
    points: tuple[TimeSample, ...] = field(default=(), repr=False, compare=False)  # the samples that succeeded
    drift_ppm: float | None = None  # agent clock rate minus ours, ppm (> 0: it runs fast); None under 3 samples
    drift_uncertainty_ppm: float | None = None  # ± its 95 % interval
    fleet_median_ns: float | None = None  # median offset of the fleet's nodes (None: fewer than 3)
    z: float | None = None  # robust z-score of this offset against the fleet (median/MAD)
    outlier: bool = False  # z past the threshold *and* off the median by more than the clocks' uncertainty

    @property
    def uncertainty_ns(self) -> float:
        return self.delay_ns / 2

    @property
    def offset_ms(self) -> float:
        return self.offset_ns / NS_PER_MS

    @property
    def uncertainty_ms(self) -> float:
        return self.uncertainty_ns / NS_PER_MS

    def contains(self, true_offset_ns: float, slack_ns: float = 0.0) -> bool:
        """Is ``true_offset_ns`` inside ``offset ± uncertainty`` (plus ``slack_ns``)?"""
        return abs(self.offset_ns - true_offset_ns) <= self.uncertainty_ns + slack_ns

    def short(self) -> str:
        """``+47.2 ms ±0.4 ms`` for tables (``(outlier)`` after it when the fleet pass flagged it)."""
        return f"{_signed_ms(self.offset_ns)} ±{_fmt_ms(self.uncertainty_ns)}" + (" (outlier)" if self.outlier else "")

    def drift_short(self) -> str:
        """``+50.2 ±3.1`` (ppm) for tables; empty without a drift estimate."""
        if self.drift_ppm is None or self.drift_uncertainty_ppm is None:
            return ""
        return f"{self.drift_ppm:+.1f} ±{self.drift_uncertainty_ppm:.1f}"

    def describe(self, node: str) -> str:
        """``gpu-node-02 is ~47 ms ahead of this host (±1 ms)``."""
        if self.offset_ns == 0:
            return f"{node}'s clock matches this host's (±{_fmt_ms(self.uncertainty_ns)})"
        direction = "ahead of" if self.offset_ns > 0 else "behind"
        return f"{node} is ~{_fmt_ms(abs(self.offset_ns))} {direction} this host (±{_fmt_ms(self.uncertainty_ns)})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "offset_ms": round(self.offset_ms, 3),
            "uncertainty_ms": round(self.uncertainty_ms, 3),
            "rtt_ms": round(self.delay_ns / NS_PER_MS, 3),
            "samples": self.samples,
            "failed": self.failed,
            "drift_ppm": _round(self.drift_ppm, 3),
            "drift_uncertainty_ppm": _round(self.drift_uncertainty_ppm, 3),
            "fleet_median_ms": _round(None if self.fleet_median_ns is None else self.fleet_median_ns / NS_PER_MS, 3),
            "z": None if self.z is None or not math.isfinite(self.z) else round(self.z, 2),
            "outlier": self.outlier,
        }


def estimate(samples: Sequence[TimeSample], failed: int = 0) -> SkewEstimate | None:
    """One node's lowest-delay sample, in plain Python (the fan-out's per-node figure and the reference
    the numpy pass is tested against). ``None`` when no sample succeeded.

    Samples with a negative delay beyond what the agent clock's rate error explains (it claims to
    have spent longer than the round trip — a broken agent clock or a clock step inside the sample)
    are discarded (:attr:`TimeSample.plausible`).
    """
    valid = tuple(s for s in samples if s.plausible)
    if not valid:
        return None
    best = min(valid, key=lambda s: s.delay_ns)
    return SkewEstimate(
        offset_ns=best.offset_ns,
        delay_ns=best.delay_ns,
        samples=len(valid),
        failed=failed + len(samples) - len(valid),
        points=valid,
    )


class HasSkew(Protocol):
    """What :func:`refine` needs of a node's outcome."""

    skew: SkewEstimate | None

    @property
    def answered(self) -> bool: ...


OutcomeT = TypeVar("OutcomeT", bound=HasSkew)

# Set once the estimator is fully imported: a module merely present in sys.modules may still be
# initialising in another thread (two fan-outs of one process refining at once).
_fit_loaded = threading.Event()


def _import_fit() -> ModuleType:
    """The numpy estimator; while another thread imports it, import_module waits for that import."""
    module = importlib.import_module(FIT_MODULE)
    _fit_loaded.set()
    return module


async def refine(outcomes: list[OutcomeT]) -> list[OutcomeT]:
    """The fleet pass: replace every outcome's estimate by :func:`ingero.fleet.fleet_skew.fleet_estimates`'
    (numpy, all nodes at once: drift, fleet median, MAD outliers). Imports numpy the first time — in a
    worker thread, so the event loop stays free — and only when some node has an estimate."""
    if not any(o.skew is not None for o in outcomes):
        return outcomes
    if _fit_loaded.is_set():
        fit = _import_fit()
    else:
        import trio

        fit = await trio.to_thread.run_sync(_import_fit)
    answered = [o.answered for o in outcomes]  # the fleet's median is the answering nodes'
    for o, est in zip(outcomes, fit.fleet_estimates([o.skew for o in outcomes], answered), strict=True):
        o.skew = est
    return outcomes


def sample_from_body(t1: int, t4: int, body: dict[str, Any]) -> TimeSample:
    """Build a sample from a ``/api/v1/time`` answer; ValueError when the answer is malformed."""
    t2, t3 = body.get("receive_ns"), body.get("transmit_ns")
    if not isinstance(t2, int) or not isinstance(t3, int) or isinstance(t2, bool) or isinstance(t3, bool):
        raise ValueError("/time answer lacks integer receive_ns/transmit_ns")
    return TimeSample(t1, t2, t3, t4)


def sample_from_headers(t1: int, t4: int, headers: Mapping[str, str]) -> TimeSample | None:
    """The sample an answer carries: the transport's ``t1`` and first-byte ``t4``, the agent's ``t2``/``t3``
    headers. None when the agent sent none (an older agent)."""
    raw2, raw3 = headers.get(RECEIVE_HEADER), headers.get(TRANSMIT_HEADER)
    if not t1 or not t4 or raw2 is None or raw3 is None:
        return None
    try:
        return TimeSample(t1, int(raw2), int(raw3), t4)
    except ValueError:
        return None


def exceeds(est: SkewEstimate | None, threshold_ms: float) -> bool:
    """Is the clock off by more than the threshold *for sure*: ``|offset| − uncertainty > threshold``?

    An offset within its own uncertainty of the threshold could be a slow round trip, not skew.
    """
    return est is not None and abs(est.offset_ms) - est.uncertainty_ms > threshold_ms


def warning(node: str, est: SkewEstimate | None, threshold_ms: float) -> str | None:
    """The stderr warning for a node whose clock is off by more than the threshold, else None."""
    if est is None or not exceeds(est, threshold_ms):
        return None
    return est.describe(node) + f"; timestamps from {node} are shifted by that much (threshold {threshold_ms:g} ms)"


def _fmt_ms(ns: float) -> str:
    ms = abs(ns) / NS_PER_MS
    if ms >= 10 or math.isclose(ms, round(ms)):
        return f"{ms:.0f} ms"
    if ms >= 0.1:
        return f"{ms:.1f} ms"
    return f"{ms:.2f} ms"


def _signed_ms(ns: float) -> str:
    return ("+" if ns >= 0 else "-") + _fmt_ms(ns)


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)
