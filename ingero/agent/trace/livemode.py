"""The live view's model: what a running trace shows each second, and who is told.

The tracer never prints (library code): it reports to a :class:`LiveView` — notes (a new library
probed), a :class:`LiveTick` per second when the view asks for them, and the final summary.
Readiness is reported one way only, by ``task_status.started(TraceReady)``; the caller then calls
``view.started(ready)`` itself (after writing its ready file, say). ``ingero trace`` (:mod:`ingero.cli.trace_view`) turns these
into the live table, JSON lines or a summary; tests and benchmarks pass no observer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ingero.agent.trace.livestats import LiveStats, OpLine

if TYPE_CHECKING:
    from ingero.agent.trace.pipeline import Pipeline

TICK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class LiveTick:
    """One second of a running trace: totals so far, and each op's count, rate and percentiles."""

    elapsed_s: float
    stats: dict[str, int]  # Pipeline.stats(): seen, stored, dropped, ... (kernel counters included)
    events_per_s: float  # drained since the start, per second
    ops: list[OpLine]

    def as_dict(self) -> dict[str, Any]:
        return {"elapsed_s": round(self.elapsed_s, 3), "stats": self.stats, "ops": [o.as_dict() for o in self.ops]}


class LiveView(Protocol):
    """What a caller of :func:`ingero.agent.trace.tracer.run_trace` is told while it runs.

    ``ready`` and ``summary`` are :class:`~ingero.agent.trace.tracer.TraceReady` /
    :class:`~ingero.agent.trace.tracer.TraceSummary` (typed loosely here: this module is imported by the
    tracer, never the other way round).
    """

    wants_ticks: bool  # False: no LiveTick is computed

    def started(self, ready: Any) -> None: ...

    def note(self, message: str) -> None: ...

    def tick(self, tick: LiveTick) -> None: ...

    def finished(self, summary: Any) -> None: ...


async def tick_loop(observer: LiveView, live: LiveStats, pipeline: Pipeline) -> None:
    """One LiveTick per TICK_INTERVAL_S until cancelled (only if the observer wants them)."""
    if not observer.wants_ticks:
        return
    t0 = last = time.monotonic()
    while True:
        await trio.sleep(TICK_INTERVAL_S)
        now = time.monotonic()
        ops = live.snapshot(now - last)
        last = now
        elapsed = now - t0
        rate = pipeline.drained / elapsed if elapsed > 0 else 0.0
        observer.tick(LiveTick(elapsed, pipeline.stats(), rate, ops))
