"""Explain by label: the wall-time ledger of each labelled span (``explain --by step``,
``explain --annotation step=12``).

A label value's spans come from the annotations (:mod:`ingero.store.annotations`): a span row
(``span_start``/``span_end``) is its own span; an instant (``point(step=12)``) holds from its timestamp
until the next instant of the same key in the same scope (node, pid), or the end of the recording. A
pid-scoped span covers that process's GPU threads; an unscoped one every GPU thread of its node.

Each GPU thread's ledger (:mod:`ingero.explain.ledger`: every nanosecond of its wall time in one bucket)
is cut at the spans' edges with the ledger's own machinery: the frame is loaded once, the thread's calls
are cut into busy stretches, slow time and judged gaps once (:func:`~ingero.explain.ledger_calls.thread_calls`),
and one painting and judging of its gaps (:func:`~ingero.explain.ledger_gaps.paint`) gives each span's
buckets (cumulative sums at every span edge: a span costs O(log n) whatever the count). A span's wall
time for a thread is the part of the span inside the thread's wall (first GPU call to last); its buckets
add up to it exactly. Steady levels are the node's over the whole loaded window, so a step whose calls
are all slow shows as ``gpu_slow``.

Lost time of a value is the ledger's: ``gpu_slow`` (time beyond the op's steady level) and each gap
bucket's GPU idle as :func:`~ingero.explain.ledger_gaps.judge_idle` judges it for the whole run — after a
sync, the time beyond the loop's turnaround and pace; after asynchronous launches, the part the next
sync says the queued work did not cover (sync shrinkage). A judged gap's idle time is spread evenly over
the gap (where in it the turnaround fell cannot be told), so the values' lost times add up to the
whole-run ledger's over the same spans. ``not_recorded`` is never lost; unstored calls (selective
storage) are not taken out of the gaps here. The top cause is the bucket holding most of the lost time; it
is named only when the lost time reaches the ledger chains' MEDIUM share of the value's wall time (and
their absolute floor) — a healthy step has none — and called the root cause when it holds the dominant
share (at least half).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ingero.errors import StoreError, UsageError
from ingero.explain import causes as cz
from ingero.explain.frame import I64, Frame
from ingero.explain.frame_load import load_frames
from ingero.explain.ledger import children, thread_evidence
from ingero.explain.ledger_calls import op_keys, steady_ns, thread_calls
from ingero.explain.ledger_gaps import (
    BUCKETS,
    GAP_BUCKETS,
    GPU_SLOW,
    GPU_STEADY,
    HOST_CODE,
    IDX,
    NOT_RECORDED,
    ThreadEvidence,
    gap_classes,
    paint,
)
from ingero.explain.offcpu import Intervals, OffCpu
from ingero.explain.rules_ledger import DOMINANT, MIN_LOST_NS
from ingero.explain.storage import aggregate_scopes, load_storage
from ingero.store.annotation_join import MAX_ANNOTATIONS
from ingero.store.annotations import TABLE, has_annotations
from ingero.store.window import Window
from ingero.timeutil import fmt_latency

MARGIN_NS = 10 * 1_000_000_000  # loaded around the spans: the calls that bound a gap a span starts in
NAMED_SHARE = cz.MEDIUM_SHARE  # lost share of a value's wall time that names a cause
CAUSES = {
    GPU_SLOW: "GPU calls slower than steady",
    HOST_CODE: "own host code (CPU-bound)",
    "preempted": "preempted (CPU contention)",
    "asleep_workers": "asleep on forked workers (input starvation)",
    "asleep_disk": "asleep on disk I/O",
    "asleep_network": "asleep on the network",
    "asleep_timer": "asleep on a timer (a chosen sleep)",
    "asleep_unknown": "asleep, woken by another task",
    "offcpu_unknown": "off-CPU (kind unknown: no prev_state)",
}
LOSABLE = tuple(b for b in GAP_BUCKETS if b != NOT_RECORDED)


@dataclass(frozen=True)
class LabelSpan:
    """Where one label value held: [start_ns, end_ns) on ``node`` for ``pid`` (0: every process)."""

    value: str
    node: str
    pid: int
    start_ns: int
    end_ns: int


@dataclass
class ValueLedger:
    """One label value: its spans' elapsed time and the ledger of the GPU threads inside them."""

    value: str
    start_ns: int
    end_ns: int
    spans: int = 0
    threads: int = 0
    wall_ns: int = 0  # thread time: the sum of each thread's part of the spans
    buckets: dict[str, int] = field(default_factory=dict)  # every bucket of BUCKETS, once judged
    lost: dict[str, int] = field(default_factory=dict)
    median_ratio: float = 0.0
    cause: str | None = None

    @property
    def elapsed_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def lost_ns(self) -> int:
        return sum(self.lost.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "elapsed_ns": self.elapsed_ns,
            "x_median": round(self.median_ratio, 2),
            "spans": self.spans,
            "threads": self.threads,
            "wall_ns": self.wall_ns,
            "buckets": dict(self.buckets),
            "lost_ns": self.lost_ns,
            "lost": dict(self.lost),
            "cause": self.cause,
            "cause_share": round(self.lost[self.cause] / self.lost_ns, 3) if self.cause else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ValueLedger:
        """The value back from :meth:`as_dict` (an agent's answer): raises on a malformed one."""
        return cls(
            str(d["value"]),
            int(d["start_ns"]),
            int(d["end_ns"]),
            int(d["spans"]),
            int(d["threads"]),
            int(d["wall_ns"]),
            {str(k): int(v) for k, v in dict(d["buckets"]).items()},
            {str(k): int(v) for k, v in dict(d["lost"]).items()},
            float(d["x_median"]),
            None if d.get("cause") is None else str(d["cause"]),
        )


@dataclass
class ByLabel:
    key: str
    values: list[ValueLedger]
    median_ns: int
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "median_ns": self.median_ns,
            "values": [v.as_dict() for v in self.values],
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ByLabel:
        values = [ValueLedger.from_dict(v) for v in d["values"]]
        return cls(str(d["key"]), values, int(d["median_ns"]), [str(n) for n in d.get("notes") or []])


def label_spans(
    conn: sqlite3.Connection, key: str, window: Window | None = None, node: str | None = None
) -> list[LabelSpan]:
    """Every span of label ``key`` in ``window`` (see the module docstring), in time order."""
    window = window or Window()
    if not has_annotations(conn):
        return []
    lo = -(1 << 63) if window.start_ns is None else window.start_ns
    hi = (1 << 63) - 1 if window.end_ns is None else window.end_ns
    cols = {r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")}
    nd = "node" if "node" in cols else "''"
    value = "json_extract(labels, ?)"
    rows = conn.execute(
        f"SELECT {nd}, pid, timestamp, span_start, span_end, {value} FROM {TABLE} "
        f"WHERE json_valid(labels) AND {value} IS NOT NULL "
        "AND (timestamp BETWEEN ? AND ? OR (span_end >= ? AND span_start <= ? AND span_start > 0)) "
        "ORDER BY timestamp, id LIMIT ?",
        (_path(key), _path(key), lo, hi, lo, hi, MAX_ANNOTATIONS),
    ).fetchall()
    out: list[LabelSpan] = []
    points: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for n, pid, ts, a, b, v in rows:
        n, pid, v = str(n or ""), int(pid or 0), v if isinstance(v, str) else json.dumps(v)
        if node is not None and n and n != node:
            continue
        if a or b:
            out.append(LabelSpan(v, n, pid, int(a), int(b)))
        else:
            points.setdefault((n, pid), []).append((int(ts), v))
    if points:
        last = _last_event(conn, window)
        for (n, pid), seq in points.items():  # in time order: each holds until the next
            ends = [t for t, _ in seq[1:]] + [max(last, seq[-1][0])]
            out += [LabelSpan(v, n, pid, t, e) for (t, v), e in zip(seq, ends, strict=True)]
    return sorted((s for s in out if s.end_ns > s.start_ns), key=lambda s: (s.start_ns, s.node, s.pid))


def _path(key: str) -> str:
    """The JSON path of a label key (quoted: keys may hold dots; SQLite's paths cannot quote a quote)."""
    if '"' in key:
        raise UsageError(f"label key {key!r}: a key with a double quote cannot be selected")
    return f'$."{key}"'


def check_key(key: str) -> str:
    """A label key as ``--by`` takes it (one-line UsageError for one that cannot be selected)."""
    _path(key)
    return key


def _last_event(conn: sqlite3.Connection, window: Window) -> int:
    row = conn.execute("SELECT max(timestamp) FROM events").fetchone()
    last = int(row[0]) if row and row[0] is not None else 0
    return min(last, window.end_ns) if window.end_ns is not None else last


def parse_selector(text: str) -> tuple[str, str]:
    """``step=12`` -> ("step", "12"); a one-line UsageError otherwise."""
    k, sep, v = text.partition("=")
    if not sep or not k.strip() or not v.strip():
        raise UsageError(f"--annotation {text!r}: expected KEY=VALUE", hint="e.g. --annotation step=12")
    return k.strip(), v.strip()


def span_window(spans: list[LabelSpan], key: str, value: str) -> tuple[Window, int | None]:
    """The window of one label value's spans, and the process they are scoped to (None: several or none)."""
    mine = [s for s in spans if s.value == value]
    if not mine:
        raise UsageError(f"no span of {key}={value} in the window", hint=f"list them: ingero explain --by {key}")
    pids = {s.pid for s in mine}
    pid = next(iter(pids)) if len(pids) == 1 and 0 not in pids else None
    return Window(min(s.start_ns for s in mine), max(s.end_ns for s in mine) - 1), pid  # [start, end)


def explain_value(
    conn: sqlite3.Connection, selector: str, window: Window, *, node: str | None = None, threads: int = 1
) -> tuple[Window, int | None, str, ValueLedger]:
    """``--annotation step=12``: the window of that value's span(s), the process they are scoped to
    (None: several or none), the key, and the value's ledger among its key's values in ``window``."""
    key, value = parse_selector(selector)
    span, pid = span_window(label_spans(conn, key, window, node), key, value)
    every = by_label(conn, key, window, node=node, threads=threads)
    return span, pid, key, next(v for v in every.values if v.value == value)


def by_label(
    conn: sqlite3.Connection, key: str, window: Window | None = None, *, node: str | None = None, threads: int = 1
) -> ByLabel:
    """The ledger of every value of label ``key`` (see the module docstring)."""
    window = window or Window()
    try:
        spans = label_spans(conn, key, window, node)
        if not spans:
            return ByLabel(key, [], 0, [f"no annotations with the label {key!r} in the window"])
        lo, hi = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
        # the spans and a margin; the whole recording when no window was asked for (a whole-table read
        # is split by rowid and skips the time index: faster than any window over most of the table)
        load = window if window.unbounded else Window(lo - MARGIN_NS, hi + MARGIN_NS)
        frames = load_frames(conn, load, node=node, threads=threads)
        holes = {n: load_storage(conn, load, None, by).holes for n, by in aggregate_scopes(conn, list(frames)).items()}
    except sqlite3.Error as e:
        raise StoreError(f"cannot read the trace database: {e}") from None
    index: dict[str, int] = {}
    of = np.asarray([index.setdefault(s.value, len(index)) for s in spans], dtype=np.int64)
    s0 = np.asarray([s.start_ns for s in spans], dtype=np.int64)
    s1 = np.asarray([s.end_ns for s in spans], dtype=np.int64)
    first = np.full(len(index), np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(len(index), np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(first, of, s0)
    np.maximum.at(last, of, s1)
    acc = np.zeros((len(index), len(BUCKETS)), dtype=np.int64)
    lost = np.zeros_like(acc)
    threads_in = np.zeros(len(index), dtype=np.int64)
    scope = np.asarray([s.pid for s in spans], dtype=np.int64)
    for fr in frames.values():
        here = np.asarray([not s.node or s.node == fr.node for s in spans], dtype=bool)
        for k, part, gone in _node_parts(fr, s0, s1, scope, here, holes.get(fr.node, [])):
            np.add.at(acc, of[k], part)
            np.add.at(lost, of[k], gone)
            np.add.at(threads_in, of[k], 1)
    counts = np.bincount(of, minlength=len(index))
    out = [ValueLedger(v, int(first[i]), int(last[i]), int(counts[i]), int(threads_in[i])) for v, i in index.items()]
    median = int(np.median(last - first))
    _judge(out, acc, lost, median)
    notes = [] if frames else ["no events around the labelled spans"]
    return ByLabel(key, out, median, notes)


def _node_parts(
    fr: Frame, s0: I64, s1: I64, scope: I64, here: npt.NDArray[np.bool_], holes: list[Any]
) -> Iterator[tuple[I64, I64, I64]]:
    """Per GPU thread of the node: the spans it has a part in (indices), their buckets and their lost
    time per bucket (rows)."""
    gpu = fr.select(fr.gpu_mask())
    if gpu.size == 0 or not here.any():
        return
    ev = thread_evidence(fr, OffCpu(fr.args), holes)
    steady = steady_ns(gpu.source, gpu.op, gpu.dur)
    order = np.lexsort((gpu.ts_ns, gpu.tid, gpu.pid))
    pid, tid, ts = gpu.pid[order], gpu.tid[order], gpu.ts_ns[order]
    end, st = ts + gpu.dur[order], ts + steady[order]
    key = op_keys(gpu.source, gpu.op)[order]
    cut = np.flatnonzero((np.diff(pid) != 0) | (np.diff(tid) != 0)) + 1
    for lo, hi in zip(np.concatenate(([0], cut)), np.concatenate((cut, [ts.size])), strict=True):
        p, t = int(pid[lo]), int(tid[lo])
        mine = np.flatnonzero(here & ((scope == 0) | (scope == p)))
        if mine.size:
            sl = slice(lo, hi)
            th = _ThreadCut(ts[sl], end[sl], st[sl], key[sl], ev, t, set(children(fr.args, p)), s0[mine], s1[mine])
            rows, lost, inside = th.parts()
            yield mine[inside], rows[inside], lost[inside]


class _ThreadCut:
    """One GPU thread's ledger, cut at the edges of the spans [s0, s1): the ledger's own cut of the calls
    (:func:`~ingero.explain.ledger_calls.thread_calls`) and painting and judging of the gaps
    (:func:`~ingero.explain.ledger_gaps.paint`), so a span's lost time is the whole-run ledger's over it."""

    def __init__(
        self,
        ts: I64,
        end: I64,
        steady_end: I64,
        key: I64,
        ev: ThreadEvidence,
        tid: int,
        kids: set[int],
        s0: I64,
        s1: I64,
    ) -> None:
        tc = thread_calls(ts, end, steady_end, key)
        w0, w1 = (tc.w0, tc.w1) if tc is not None else (0, 0)
        self.c0, self.c1 = np.clip(s0, w0, w1), np.clip(s1, w0, w1)
        self.gaps = np.zeros((s0.size, len(BUCKETS)), dtype=np.int64)
        self.idle = np.zeros((s0.size, len(BUCKETS)), dtype=np.int64)
        empty = np.zeros(0, dtype=np.int64)
        self.busy, self.slow = _cumulative(empty, empty), _cumulative(empty, empty)
        if tc is None:
            return
        self.busy, self.slow = _cumulative(tc.b_start, tc.b_end), _cumulative(tc.ss, tc.se)
        g0, g1 = tc.g0, tc.g1
        if g0.size == 0:
            return
        edges = np.unique(np.clip(np.concatenate((self.c0, self.c1)), g0[0], g1[-1]))
        classes = gap_classes(ev, tid, kids)
        painted = paint(
            g0, g1, tc.idle, classes, edges, drained=tc.drained[:-1], sync=tc.sync, short=tc.short, detail=True
        )
        assert painted.per_minute is not None and painted.judged.per_gap is not None
        before = np.cumsum(painted.per_minute, axis=0)  # row i: gap time of each bucket before edges[i]
        i0 = np.searchsorted(edges, np.clip(self.c0, g0[0], g1[-1]))
        i1 = np.searchsorted(edges, np.clip(self.c1, g0[0], g1[-1]))
        self.gaps = np.rint(before[i1] - before[i0]).astype(np.int64)
        # each judged gap's idle time, spread evenly over the gap: where in the gap the turnaround fell
        # cannot be told; rounded at each edge, so spans that tile the wall add up to the ledger's figure
        spread = _Spread(g0[tc.idle], g1[tc.idle], painted.judged.per_gap)
        self.idle = spread.before(self.c1) - spread.before(self.c0)

    def parts(self) -> tuple[I64, I64, npt.NDArray[np.bool_]]:
        """Per span, its buckets for this thread (rows, in BUCKETS order; they add up to the span's part
        of the thread's wall exactly), its lost time per bucket (rows: ``gpu_slow`` and the gap buckets'
        GPU idle), and which spans have a part (inside the thread's wall)."""
        wall = self.c1 - self.c0
        busy = self.busy.covered(self.c0, self.c1)
        slow = self.slow.covered(self.c0, self.c1)
        rows = self.gaps.copy()
        rows[:, IDX[GPU_SLOW]] = slow
        rows[:, IDX[GPU_STEADY]] = busy - slow
        host = IDX[HOST_CODE]
        rows[:, host] += wall - rows.sum(axis=1)  # what no class covers (and rounding) is own host code
        lost = np.zeros_like(rows)
        losable = [IDX[b] for b in LOSABLE]
        lost[:, losable] = self.idle[:, losable]
        lost[:, IDX[GPU_SLOW]] = slow
        return rows, lost, wall > 0


class _Spread:
    """The idle time of judged gaps [a, z) (per bucket: ``per_gap`` rows), each spread evenly over its gap."""

    def __init__(self, a: I64, z: I64, per_gap: npt.NDArray[np.float64]) -> None:
        self.a, self.z, self.per_gap = a, z, per_gap
        self.cum = np.concatenate((np.zeros((1, per_gap.shape[0])), np.cumsum(per_gap.T, axis=0)))

    def before(self, x: I64) -> I64:
        """Per instant of ``x`` (rows), each bucket's idle time before it (rounded to the ns)."""
        k = np.searchsorted(self.a, x, side="right") - 1
        kk = np.maximum(k, 0)
        if self.a.size == 0:
            return np.zeros((x.size, self.cum.shape[1]), dtype=np.int64)
        share = np.where(k >= 0, np.clip((x - self.a[kk]) / np.maximum(self.z[kk] - self.a[kk], 1), 0.0, 1.0), 0.0)
        out = np.where((k >= 0)[:, None], self.cum[kk] + share[:, None] * self.per_gap[:, kk].T, 0.0)
        return np.rint(out).astype(np.int64)


def _cumulative(start: I64, end: I64) -> Intervals:
    """Sorted disjoint intervals, to sum their time between any two instants (none: one empty one)."""
    if start.size == 0:
        start = end = np.zeros(1, dtype=np.int64)
    return Intervals(start, end, np.concatenate(([0], np.cumsum(end - start))), start)


def _judge(values: list[ValueLedger], acc: I64, lost: I64, median: int) -> None:
    """Each value's buckets and lost time (``acc``, ``lost``: rows in ``values`` order), and the top cause
    where the lost time is worth naming."""
    wall = acc.sum(axis=1)
    total = lost.sum(axis=1)
    named = (wall > 0) & (total >= np.maximum(MIN_LOST_NS, NAMED_SHARE * wall))
    top = lost.argmax(axis=1)
    rows, lost_rows = acc.tolist(), lost.tolist()
    for v, w, row, gone, t, n in zip(values, wall.tolist(), rows, lost_rows, top.tolist(), named.tolist(), strict=True):
        v.wall_ns = w
        v.buckets = dict(zip(BUCKETS, row, strict=True))
        v.lost = {b: ns for b, ns in zip(BUCKETS, gone, strict=True) if ns > 0}
        v.median_ratio = v.elapsed_ns / median if median > 0 else 0.0
        v.cause = BUCKETS[t] if n else None


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f} %" if whole > 0 else "0 %"


def render_value(key: str, v: ValueLedger) -> str:
    """'step 7: 3.1 s (3.0x the median) — 2.2 s lost: 71 % asleep on forked workers (input starvation)'."""
    line = f"{key} {_shown(v.value)}: {fmt_latency(v.elapsed_ns)} ({v.median_ratio:.1f}x the median)"
    if v.cause is not None:
        line += f" — {fmt_latency(v.lost_ns)} lost: {_pct(v.lost[v.cause], v.lost_ns)} {CAUSES[v.cause]}"
        if v.lost[v.cause] < DOMINANT * v.lost_ns:
            rest = sorted(((ns, b) for b, ns in v.lost.items() if b != v.cause), reverse=True)[:1]
            line += "".join(f", {_pct(ns, v.lost_ns)} {CAUSES[b]}" for ns, b in rest) + " (no dominant cause)"
    elif v.threads == 0:
        line += " — no GPU thread inside"
    return line


def _shown(value: str) -> str:
    """An integer label value with thousands separators (step 4,812), any other as it is."""
    return f"{int(value):,}" if value.isdigit() and not (len(value) > 1 and value[0] == "0") else value


def render(result: ByLabel) -> str:
    """One line per value: 'step 7: 3.1 s (3.0x the median) — 2.2 s lost: 71 % asleep on forked workers ...'."""
    if not result.values:
        return ""
    worst = max(result.values, key=lambda v: v.elapsed_ns)
    lines = [
        f"by {result.key} ({len(result.values):,} value(s), median {fmt_latency(result.median_ns)}; slowest: "
        f"{result.key} {_shown(worst.value)}, {worst.median_ratio:.1f}x the median):"
    ]
    lines += ["  " + render_value(result.key, v) for v in result.values]
    return "\n".join(lines) + "\n"


__all__ = [
    "ByLabel",
    "LabelSpan",
    "ValueLedger",
    "by_label",
    "check_key",
    "explain_value",
    "label_spans",
    "parse_selector",
    "render",
    "render_value",
    "span_window",
]
