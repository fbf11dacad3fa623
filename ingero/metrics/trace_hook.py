"""The tracer's side of the metrics: what ``ingero trace`` hands the pipeline (its one observer point).

:class:`TraceMetrics` satisfies :class:`ingero.agent.trace.tracer.TraceObserver`: ``on_events`` receives
every drained batch (before selective storage) and folds it into the state with numpy; ``attach``
gets the running pipeline, whose counters (stored, lost in the kernel, page allocations counted in
the kernel) are read at scrape time — never by re-querying SQLite.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ingero.metrics import registry as r
from ingero.metrics.dbfeed import attach_database
from ingero.metrics.state import MetricState, op_labels
from ingero.store import catalog

if TYPE_CHECKING:
    from ingero.agent.trace.pipeline import Pipeline

PAGE_ALLOC = catalog.op_id("mm_page_alloc")  # counted in the kernel, never in a drained batch


class TraceMetrics:
    def __init__(self, state: MetricState, db_path: Path) -> None:
        self.state = state
        self._pipeline: Pipeline | None = None
        state.add_provider(self._pipeline_samples)
        attach_database(state, db_path)

    def attach(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    def on_events(self, ev: np.ndarray) -> None:
        self.state.observe(ev)

    def _pipeline_samples(self) -> list[r.Sample]:
        p = self._pipeline
        if p is None:
            return []
        base = self.state.base_labels()
        kernel = p.kernel_counters()
        out = [r.Sample(r.STORED, base, float(p.recorder.stored))]
        for counter, reason in r.LOSS_REASONS.items():
            out.append(r.Sample(r.LOST, (*base, reason), float(kernel.get(counter, 0))))
        pages = p.recorder.by_op.get(PAGE_ALLOC, 0)
        if pages:
            src, op = op_labels(PAGE_ALLOC[0] << 8 | PAGE_ALLOC[1])
            out.append(r.Sample(r.EVENTS, (*base, src, op), float(pages)))
        return out
