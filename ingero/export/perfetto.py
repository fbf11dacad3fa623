"""Chrome Trace Event JSON for Perfetto (ui.perfetto.dev, trace_processor) and chrome://tracing.

Layout of the trace
* one **process per node**, named ``"{node} (rank R)"`` and sorted by rank;
* one **thread per traced thread** (``"{comm} {pid}/{tid}"``) carrying its CUDA runtime, driver,
  NCCL and socket calls as slices; other host events (page allocations, process exec/exit/fork,
  OOM kills, TCP retransmits) are instants on it; its off-CPU periods (``sched_switch``) are slices
  on a companion lane right below it (``"... off-CPU"``);
* **block I/O** on per-node lanes (``block I/O #k``): requests overlap, so each lane holds requests
  that do not (greedy interval partitioning);
* the **serving engines' own series** (``trace --inference``) as counter tracks on the node's process
  (:mod:`ingero.export.engine_tracks`);
* **causal chains** as instant markers on per-severity lanes (``causal chains: HIGH`` ...), with
  Chrome's colour names by severity (``cname``) and the chain's summary, root cause and
  recommendations as args.

Timestamps follow the tracers (Ingero's and ours): a CUDA/driver/NCCL/socket call is stamped when it
was entered, so its slice spans ``[timestamp, timestamp + duration]``; an off-CPU period is stamped
when the thread came back on a CPU and a block I/O request when it completed, so those span
``[timestamp - duration, timestamp]``. JSON timestamps are microseconds held in doubles,
which cannot carry Unix-epoch nanoseconds exactly, so every timestamp is written relative to
``base_ns`` (a whole second before the first event), exactly to the nanosecond; ``metadata`` holds
the base and, for fleet exports, each node's clock offset that was subtracted.

Slices on one thread must nest; a call that partially overlaps its enclosing slice (possible only
with clock trouble) is written as an instant with its duration in args rather than dropped.
Thread ids are made unique across nodes (``slot * 10^7 + tid``; off-CPU lanes add 5 * 10^6); the real
pid/tid are in the name and args.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from ingero import __version__
from ingero.explain.model import SEVERITIES, Chain
from ingero.export.engine_tracks import CounterTrack
from ingero.store.annotations import Annotation, format_labels
from ingero.store.catalog import ALLOC_OPS, CUDA, DRIVER, NCCL, NET, SOURCE_NAMES, op_id, op_ids, op_name
from ingero.store.catalog import IO as IO_SOURCE

# (timestamp, pid, tid, source, op, duration, arg0, arg1, ret_code, stack_hash)
ExportRow = tuple[int, int, int, int, int, int, int, int, int, int]
EXPORT_COLUMNS = "timestamp, pid, tid, source, op, duration, arg0, arg1, ret_code, stack_hash"

SLICE_SOURCES = frozenset({CUDA, DRIVER, NCCL, NET})
ENTRY_STAMPED = SLICE_SOURCES  # timestamp = entry; everything else is stamped at its end
SCHED_SWITCH = op_id("sched_switch")
TID_STRIDE = 10_000_000  # > Linux pid_max (4 194 304): slot * stride + tid stays unique per node
OFF_CPU_LANE = 5_000_000  # + tid (< pid_max 4 194 304): a thread's off-CPU lane
CHAIN_LANE = 9_999_900
IO_LANE = 9_999_000
ANNOTATION_LANE = 9_998_000  # + n: label spans (one lane per process scope and label keys)
MAX_ANNOTATION_LANES = 64
MAX_IO_LANES = 64
CHAIN_COLOURS = {"HIGH": "terrible", "MEDIUM": "bad", "LOW": "yellow"}
_ALLOC = frozenset(ALLOC_OPS)
_COPY = frozenset(op_ids("cudaMemcpy", "cudaMemcpyAsync", "cuMemcpy", "cuMemcpyAsync"))
_LAUNCH = frozenset(op_ids("cudaLaunchKernel", "cuLaunchKernel"))
_PAGE_ALLOC = op_id("mm_page_alloc")


@dataclass
class NodeTrace:
    """One node's share of the trace. ``events`` may be a lazy cursor (consumed once)."""

    node: str
    rank: int | None
    world_size: int | None
    first_ns: int | None  # earliest event timestamp (uncorrected), for the trace base
    events: Iterable[ExportRow]
    process_names: dict[int, str] = field(default_factory=dict)
    chains: list[Chain] = field(default_factory=list)
    offset_ns: int = 0  # this node's clock minus the reference clock: subtracted from its timestamps
    offset_uncertainty_ns: int | None = None
    annotations: list[Annotation] = field(default_factory=list)  # ``ingero annotate`` marks of this node
    engine_tracks: list[CounterTrack] = field(default_factory=list)  # serving engines' series (trace --inference)

    @property
    def label(self) -> str:
        if self.rank is None:
            return self.node
        return f"{self.node} (rank {self.rank})"


@dataclass
class ExportStats:
    nodes: int = 0
    threads: int = 0
    slices: int = 0
    instants: int = 0
    chains: int = 0
    overlaps: int = 0
    io_lanes: int = 0
    counters: int = 0  # counter-track points (serving engines' series)
    base_ns: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def _us(rel_ns: int) -> float | int:
    """Relative ns → µs for JSON, exact: integers when whole, else 3 decimals (rel_ns is small)."""
    if rel_ns % 1000 == 0:
        return rel_ns // 1000
    return round(rel_ns / 1000, 3)


def _args(source: int, op: int, pid: int, tid: int, arg0: int, arg1: int, ret: int, stack: int) -> dict[str, Any]:
    args: dict[str, Any] = {"pid": pid, "tid": tid}
    key = (source, op)
    if key in _ALLOC or key in _COPY or source in (NCCL, IO_SOURCE) or key == _PAGE_ALLOC:
        args["bytes"] = arg0
    elif key in _LAUNCH:
        args["func"] = hex(arg0)
    elif arg0:
        args["arg0"] = arg0
    if key in _COPY:
        args["direction"] = arg1
    elif source == NCCL:
        args["comm"] = hex(arg1)
    elif arg1:
        args["arg1"] = arg1
    if ret:
        args["ret_code"] = ret
    if stack:
        args["stack_hash"] = stack
    return args


class TraceWriter:
    """Streams one JSON trace to ``out``: metadata events, then each node's events as produced."""

    def __init__(self, out: IO[str], base_ns: int, metadata: dict[str, Any]) -> None:
        self.out = out
        self.base_ns = base_ns
        self.metadata = metadata
        self.stats = ExportStats(base_ns=base_ns)
        self._first = True

    def _emit(self, event: dict[str, Any]) -> None:
        self.out.write(("[\n" if self._first else ",\n") + json.dumps(event, separators=(",", ":")))
        self._first = False

    def begin(self) -> None:
        self.out.write('{"displayTimeUnit":"ns","traceEvents":')

    def end(self) -> None:
        if self._first:
            self.out.write("[")
        self.out.write("\n],\n")
        self.out.write('"metadata":' + json.dumps(self.metadata, default=str) + "}\n")

    # --- one node ------------------------------------------------------------------------------

    def add_node(self, slot: int, nt: NodeTrace) -> None:
        """``slot`` (1-based) is the node's synthetic pid."""
        self.stats.nodes += 1
        base = TID_STRIDE * slot
        self._meta(slot, None, "process_name", {"name": nt.label})
        self._meta(slot, None, "process_sort_index", {"sort_index": nt.rank if nt.rank is not None else 1000 + slot})
        labels = [f"node {nt.node}"]
        if nt.rank is not None:
            labels.append(f"rank {nt.rank}" + (f" of {nt.world_size}" if nt.world_size else ""))
        if nt.offset_ns:
            labels.append(f"clock offset {nt.offset_ns / 1e6:+.3f} ms corrected")
        self._meta(slot, None, "process_labels", {"labels": ", ".join(labels)})

        by_tid: dict[int, list[tuple[int, int, ExportRow]]] = {}
        off_cpu: dict[int, list[tuple[int, int, ExportRow]]] = {}
        pid_of: dict[int, int] = {}
        io: list[tuple[int, int, ExportRow]] = []
        shift = self.base_ns + nt.offset_ns
        for row in nt.events:
            ts, pid, tid, source, op, dur = row[0], row[1], row[2], row[3], row[4], row[5]
            if source in ENTRY_STAMPED:
                start = ts - shift
                end = start + max(dur, 0)
            else:
                end = ts - shift
                start = end - max(dur, 0)
            if source == IO_SOURCE:
                io.append((start, end, row))
                continue
            pid_of.setdefault(tid, pid)
            if (source, op) == SCHED_SWITCH:
                off_cpu.setdefault(tid, []).append((start, end, row))
            elif source in SLICE_SOURCES:
                by_tid.setdefault(tid, []).append((start, end, row))
            else:
                self._instant(slot, base + tid, end, row)
        for tid in sorted(pid_of, key=lambda t: (pid_of[t], t)):
            pid = pid_of[tid]
            comm = nt.process_names.get(pid, "")
            name = f"{comm} {pid}/{tid}" if comm else f"pid {pid} tid {tid}"
            self._meta(slot, base + tid, "thread_name", {"name": name})
            self._meta(slot, base + tid, "thread_sort_index", {"sort_index": pid})
            self.stats.threads += 1
            self._thread_slices(slot, base + tid, by_tid.get(tid, []))
            if tid in off_cpu:  # its own lane: scheduling next to the calls, never forced to nest in them
                lane = base + OFF_CPU_LANE + tid
                self._meta(slot, lane, "thread_name", {"name": f"{name} off-CPU"})
                self._meta(slot, lane, "thread_sort_index", {"sort_index": pid})
                self.stats.threads += 1
                self._thread_slices(slot, lane, off_cpu[tid])
        self._io_lanes(slot, base, io, nt.process_names)
        self._chains(slot, base, nt, shift)
        self._annotations(slot, base, nt, shift)
        self._counters(slot, nt, shift)

    def _meta(self, pid: int, tid: int | None, name: str, args: dict[str, Any]) -> None:
        ev: dict[str, Any] = {"ph": "M", "pid": pid, "name": name, "args": args}
        if tid is not None:
            ev["tid"] = tid
        self._emit(ev)

    def _slice(self, pid: int, tid: int, start: int, end: int, row: ExportRow, **extra: Any) -> None:
        _ts, rpid, rtid, source, op, _dur, arg0, arg1, ret, stack = row
        name = op_name(source, op)
        args = _args(source, op, rpid, rtid, arg0, arg1, ret, stack) | extra
        self._emit(
            {
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": _us(start),
                "dur": _us(end - start),
                "name": "off-CPU" if (source, op) == SCHED_SWITCH else name,
                "cat": SOURCE_NAMES.get(source, str(source)),
                "args": args,
            }
        )
        self.stats.slices += 1

    def _instant(self, pid: int, tid: int, at: int, row: ExportRow, **extra: Any) -> None:
        _ts, rpid, rtid, source, op, dur, arg0, arg1, ret, stack = row
        args = _args(source, op, rpid, rtid, arg0, arg1, ret, stack) | extra
        if dur:
            args["dur_us"] = round(dur / 1000, 3)
        self._emit(
            {
                "ph": "i",
                "s": "t",
                "pid": pid,
                "tid": tid,
                "ts": _us(at),
                "name": op_name(source, op),
                "cat": SOURCE_NAMES.get(source, str(source)),
                "args": args,
            }
        )
        self.stats.instants += 1

    def _thread_slices(self, pid: int, tid: int, items: list[tuple[int, int, ExportRow]]) -> None:
        """Slices of one thread, properly nested; partial overlaps become instants."""
        items.sort(key=lambda x: (x[0], -x[1]))
        open_ends: list[int] = []
        for start, end, row in items:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            if open_ends and end > open_ends[-1]:
                self.stats.overlaps += 1
                self._instant(pid, tid, end, row, overlaps_enclosing_slice=True)
                continue
            self._slice(pid, tid, start, end, row)
            open_ends.append(end)

    def _io_lanes(self, pid: int, base: int, io: list[tuple[int, int, ExportRow]], names: dict[int, str]) -> None:
        if not io:
            return

        def issuer(row: ExportRow) -> dict[str, Any]:
            return {"process": names[row[1]]} if row[1] in names else {}

        io.sort(key=lambda x: (x[0], x[1]))
        free: list[int] = []  # lanes whose last request has ended, lowest first
        busy: list[tuple[int, int]] = []  # (end, lane)
        used = 0
        for start, end, row in io:
            while busy and busy[0][0] <= start:
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                lane = heapq.heappop(free)
            elif used < MAX_IO_LANES:
                lane = used
                used += 1
                self._meta(pid, base + IO_LANE + lane, "thread_name", {"name": f"block I/O #{lane + 1}"})
                self._meta(pid, base + IO_LANE + lane, "thread_sort_index", {"sort_index": 10_000_000 + lane})
            else:  # queue deeper than MAX_IO_LANES: mark it on the last lane
                self._instant(pid, base + IO_LANE + MAX_IO_LANES - 1, end, row, lane_overflow=True)
                continue
            self._slice(pid, base + IO_LANE + lane, start, end, row, **issuer(row))
            heapq.heappush(busy, (end, lane))
        self.stats.io_lanes += used
        self.stats.threads += used

    def _chains(self, pid: int, base: int, nt: NodeTrace, shift: int) -> None:
        lanes_done: set[str] = set()
        for ch in nt.chains:
            sev = ch.severity if ch.severity in SEVERITIES else "LOW"
            tid = base + CHAIN_LANE + SEVERITIES.index(sev)
            if sev not in lanes_done:
                lanes_done.add(sev)
                self._meta(pid, tid, "thread_name", {"name": f"causal chains: {sev}"})
                self._meta(pid, tid, "thread_sort_index", {"sort_index": -10 + SEVERITIES.index(sev)})
                self.stats.threads += 1
            what = ch.cuda_op or ch.family or "chain"
            self._emit(
                {
                    "ph": "i",
                    "s": "t",
                    "pid": pid,
                    "tid": tid,
                    "ts": _us(ch.detected_at - shift),
                    "name": f"{sev} {what}: {ch.summary}"[:160],
                    "cat": "causal_chain",
                    "cname": CHAIN_COLOURS[sev],
                    "args": {
                        "id": ch.id,
                        "severity": sev,
                        "summary": ch.summary,
                        "root_cause": ch.root_cause,
                        "explanation": ch.explanation,
                        "recommendations": ch.recommendations,
                        "tail_ratio": ch.tail_ratio,
                        "p99_us": ch.cuda_p99_us,
                        "p50_us": ch.cuda_p50_us,
                        "origin": ch.origin,
                    },
                }
            )
            self.stats.chains += 1

    def _counters(self, pid: int, nt: NodeTrace, shift: int) -> None:
        """Serving engines' series: one counter track (ph "C", one arg) per engine process and metric."""
        for track in nt.engine_tracks:
            for ts, value in track.points:
                self._emit(
                    {
                        "ph": "C",
                        "pid": pid,
                        "ts": _us(ts - shift),
                        "name": track.name,
                        "cat": "engine",
                        "args": {"value": value},
                    }
                )
            self.stats.counters += len(track.points)

    def _annotations(self, pid: int, base: int, nt: NodeTrace, shift: int) -> None:
        """``ingero annotate`` marks: process-wide instant events (a line across the node's lanes); label
        spans (``with ingero.annotate.span(step=12)``): slices, one lane per process scope and label keys."""
        lanes: dict[tuple[int, tuple[str, ...]], int] = {}
        for a in nt.annotations:
            lane_key = (a.pid, tuple(sorted(a.labels)))
            if a.is_span and (lane_key in lanes or len(lanes) < MAX_ANNOTATION_LANES):
                if lane_key not in lanes:
                    lanes[lane_key] = tid = base + ANNOTATION_LANE + len(lanes)
                    scope = f"pid {a.pid}" if a.pid else "node"
                    self._meta(pid, tid, "thread_name", {"name": f"labels {'/'.join(lane_key[1])} ({scope})"})
                    self._meta(pid, tid, "thread_sort_index", {"sort_index": 9_000_000 + len(lanes)})
                    self.stats.threads += 1
                self._emit(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": lanes[lane_key],
                        "ts": _us(a.span_start - shift),
                        "dur": _us(a.span_end - a.span_start),
                        "name": format_labels(a.labels)[:160],
                        "cat": "annotation",
                        "args": {**a.labels, "pid": a.pid, "id": a.id, "author": a.author},
                    }
                )
                self.stats.slices += 1
                continue
            self._emit(
                {
                    "ph": "i",
                    "s": "p",
                    "pid": pid,
                    "tid": 0,
                    "ts": _us(a.timestamp - shift),
                    "name": f"annotation: {a.message}"[:160],
                    "cat": "annotation",
                    "args": {"message": a.message, "author": a.author, "id": a.id},
                }
            )
            self.stats.instants += 1


def base_for(nodes: Iterable[NodeTrace]) -> int:
    """A whole second at or before the earliest corrected timestamp (0 when there is nothing)."""
    firsts = [n.first_ns - n.offset_ns for n in nodes if n.first_ns is not None]
    firsts += [c.detected_at - n.offset_ns for n in nodes for c in n.chains if c.detected_at]
    firsts += [t.points[0][0] - n.offset_ns for n in nodes for t in n.engine_tracks if t.points]
    if not firsts:
        return 0
    return (min(firsts) // 1_000_000_000) * 1_000_000_000


def write_trace(out: IO[str], nodes: list[NodeTrace], metadata: dict[str, Any]) -> ExportStats:
    """Write the whole trace for ``nodes`` (in slot order) to ``out``."""
    base = base_for(nodes)
    meta = {
        "generator": f"ingero-py {__version__}",
        "base_unix_ns": base,
        "timestamps": "microseconds since base_unix_ns; GPU API and socket calls span [timestamp, timestamp + duration], off-CPU and block I/O [timestamp - duration, timestamp]",
        "nodes": [
            {
                "slot": i + 1,
                "node": n.node,
                "rank": n.rank,
                "world_size": n.world_size,
                "clock_offset_ns": n.offset_ns,
                "clock_offset_uncertainty_ns": n.offset_uncertainty_ns,
            }
            for i, n in enumerate(nodes)
        ],
        **metadata,
    }
    writer = TraceWriter(out, base, meta)
    writer.begin()
    for i, nt in enumerate(nodes):
        writer.add_node(i + 1, nt)
    writer.end()
    return writer.stats


def iter_rows(rows: Iterable[Any]) -> Iterator[ExportRow]:
    """Coerce rows (tuples or JSON lists) to ExportRow tuples of ints."""
    for r in rows:
        yield (
            int(r[0]),
            int(r[1]),
            int(r[2]),
            int(r[3]),
            int(r[4]),
            int(r[5] or 0),
            int(r[6] or 0),
            int(r[7] or 0),
            int(r[8] or 0),
            int(r[9] or 0),
        )
