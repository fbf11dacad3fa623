"""The metrics ingero exports, declared once: names, kinds, help, labels, histogram buckets.

Both exporters derive from :data:`METRICS` — Prometheus exposition (:mod:`ingero.metrics.prometheus`)
and the OTLP push (:mod:`ingero.metrics.otlp`) — so a metric is added here and nowhere else.

Label cardinality is bounded by construction: ``source``/``op`` come from the catalog (a few dozen
ops), ``state``/``reason``/``severity`` are small fixed sets, ``comm`` (the cluster-wide communicator id in hex, or
``c<k>/<size>``) is capped (:data:`MAX_COMMS`, then ``other``). Pids, tids, pointers and stack hashes never become labels. Every
series also carries the agent's ``node`` and ``rank`` (``rank`` is empty when unknown).

Collective lag: a rank that arrives late at a collective makes its peers wait; its own wait is the
shortest. Each agent exports the wait it measured per communicator and rank
(``ingero_collective_wait_seconds_total`` / ``ingero_collectives_total``); the lag of a rank is
its peers' mean wait minus its own, which the recording rule in ``configs/prometheus/`` computes
across agents (no single agent sees its peers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ingero.metrics.engine_series import EngineFamily

# Latency buckets (seconds): 1 µs … 10 s, 1-2.5-5 steps, fit for kernel launches and for collectives.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

MAX_COMMS = 64  # communicators labelled individually; the rest share comm="other"
GPU_IDLE_MIN_GAP_NS = 1_000_000  # a gap between GPU calls shorter than this is host overhead, not idle
GPU_ACTIVE_WINDOW_NS = 60_000_000_000  # a process with a GPU call this recently counts as a GPU process
OFFCPU_STATES = ("preempted", "sleep", "io")  # sched_switch prev_state: runnable / sleeping / D
SEVERITIES = ("HIGH", "MEDIUM", "LOW")
LOSS_REASONS = {  # kernel counter (ingero.agent.trace.probes.COUNTER_NAMES) -> reason label
    "events_dropped_ring": "ring_full",
    "nest_overflow": "nest_overflow",
    "orphan_returns": "orphan_return",
}
BASE_LABELS = ("node", "rank")


@dataclass(frozen=True)
class MetricDef:
    name: str  # the Prometheus family name (counters get ``_total`` in the exposition)
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""  # OTLP unit (UCUM): s, By, 1

    @property
    def all_labels(self) -> tuple[str, ...]:
        return BASE_LABELS + self.labels


def _m(name: str, kind: str, help_: str, labels: tuple[str, ...] = (), unit: str = "1") -> MetricDef:
    return MetricDef(name, kind, help_, labels, unit)


INFO = _m("ingero_agent_info", "gauge", "Always 1; labels carry the agent version and mode", ("version", "mode"))
EVENTS = _m("ingero_events", "counter", "Events traced, per source and op (host events included)", ("source", "op"))
DURATION = _m(
    "ingero_call_duration_seconds",
    "histogram",
    "Latency of GPU API calls, NCCL collectives, block I/O and socket calls",
    ("source", "op"),
    "s",
)
BYTES = _m(
    "ingero_bytes", "counter", "Bytes moved or allocated (copies, allocations, NCCL, block I/O)", ("source", "op"), "By"
)
OFFCPU = _m(
    "ingero_offcpu_seconds",
    "counter",
    "Time threads of the traced processes spent off-CPU, by why they left (preempted / sleep / io)",
    ("state",),
    "s",
)
GPU_IDLE = _m(
    "ingero_gpu_idle_seconds",
    "counter",
    "Time a traced GPU process had no CUDA/driver/NCCL call in flight, counting gaps of 1 ms or more",
    (),
    "s",
)
GPU_PROCESSES = _m(
    "ingero_gpu_processes",
    "gauge",
    "Processes that made a GPU call in the last minute of traced time (divides GPU idle into a share)",
)
COLLECTIVES = _m(
    "ingero_collectives",
    "counter",
    "NCCL collective calls per communicator and rank",
    ("comm", "comm_rank", "comm_size"),
)
COLLECTIVE_WAIT = _m(
    "ingero_collective_wait_seconds",
    "counter",
    "Time spent inside NCCL collectives per communicator and rank (peers' mean minus own = lag)",
    ("comm", "comm_rank", "comm_size"),
    "s",
)
STORED = _m("ingero_events_stored", "counter", "Events stored as rows (the rest are only aggregated)")
LOST = _m("ingero_events_lost", "counter", "Events the kernel could not deliver, by reason", ("reason",))
DB_SIZE = _m("ingero_db_size_bytes", "gauge", "Size of the trace database (with its WAL)", (), "By")
CHAINS = _m("ingero_causal_chains", "gauge", "Causal chains stored in the database, by severity", ("severity",))
SHIP_BEHIND = _m(
    "ingero_clickhouse_unshipped_rows",
    "gauge",
    "Rows not yet shipped to a ClickHouse store (ingero ship / trace --clickhouse), per store and table",
    ("target", "table"),
)
SHIP_LAG = _m(
    "ingero_clickhouse_lag_seconds",
    "gauge",
    "Age of the oldest row not yet shipped to a ClickHouse store (0: caught up)",
    ("target", "table"),
    "s",
)
EXPORT_SENT = _m("ingero_export_batches", "counter", "Metric batches an exporter delivered", ("exporter",))
EXPORT_DROPPED = _m(
    "ingero_export_dropped", "counter", "Batches an exporter dropped (queue full or collector failed)", ("exporter",)
)

METRICS: tuple[MetricDef, ...] = (
    INFO,
    EVENTS,
    DURATION,
    BYTES,
    OFFCPU,
    GPU_IDLE,
    GPU_PROCESSES,
    COLLECTIVES,
    COLLECTIVE_WAIT,
    STORED,
    LOST,
    DB_SIZE,
    CHAINS,
    SHIP_BEHIND,
    SHIP_LAG,
    EXPORT_SENT,
    EXPORT_DROPPED,
)


@dataclass(frozen=True)
class Sample:
    """One series of a counter or gauge: label values in ``metric.all_labels`` order."""

    metric: MetricDef
    labels: tuple[str, ...]
    value: float


@dataclass(frozen=True)
class HistogramSample:
    """One histogram series: per-bucket counts (not cumulative; the last one is +Inf) and the sum."""

    metric: MetricDef
    labels: tuple[str, ...]
    counts: tuple[int, ...]
    sum: float
    min: float
    max: float

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class Snapshot:
    """Everything one scrape or one push sends; ``start_ns`` is when the counters started. ``engines``:
    the serving engines' own series (:mod:`ingero.metrics.engine_series`), named and typed per family."""

    samples: list[Sample]
    histograms: list[HistogramSample]
    start_ns: int
    time_ns: int
    engines: list[EngineFamily] = field(default_factory=list)
