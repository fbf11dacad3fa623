"""Running per-op statistics of everything drained (stored or not), for the live view and ``--json``.

Counts are exact since the start; percentiles come from the most recent :data:`WINDOW` durations of
each op (a ring of numpy values), so a second of updates costs a few microseconds per op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingero.store import catalog

WINDOW = 50_000
SAMPLE = 4096  # durations kept per op per drain for the percentiles
TAIL_FLAG_RATIO = 10.0  # p99 >= 10x p50: flagged


@dataclass
class _OpRing:
    values: np.ndarray = field(default_factory=lambda: np.zeros(WINDOW, dtype=np.int64))
    filled: int = 0
    pos: int = 0
    count: int = 0
    errors: int = 0
    last_count: int = 0  # count at the previous snapshot (for the rate)

    def add(self, durations: np.ndarray, errors: int) -> None:
        self.count += durations.size
        self.errors += errors
        d = durations[-WINDOW:]
        n = d.size
        end = self.pos + n
        if end <= WINDOW:
            self.values[self.pos : end] = d
        else:
            first = WINDOW - self.pos
            self.values[self.pos :] = d[:first]
            self.values[: n - first] = d[first:]
        self.pos = end % WINDOW
        self.filled = min(WINDOW, self.filled + n)


@dataclass(frozen=True)
class OpLine:
    source: int
    op: int
    name: str
    count: int
    rate: float
    p50_ns: float
    p95_ns: float
    p99_ns: float
    max_ns: float
    errors: int

    @property
    def flags(self) -> list[str]:
        out = []
        if self.errors:
            out.append(f"{self.errors} errors")
        if self.p50_ns > 0 and self.p99_ns >= TAIL_FLAG_RATIO * self.p50_ns:
            out.append(f"tail p99 {self.p99_ns / self.p50_ns:.0f}x p50")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": catalog.SOURCE_NAMES.get(self.source, str(self.source)),
            "op": self.name,
            "count": self.count,
            "rate_per_s": round(self.rate, 1),
            "p50_us": round(self.p50_ns / 1000, 3),
            "p95_us": round(self.p95_ns / 1000, 3),
            "p99_us": round(self.p99_ns / 1000, 3),
            "max_us": round(self.max_ns / 1000, 3),
            "errors": self.errors,
            "flags": self.flags,
        }


class LiveStats:
    """Feed with :meth:`add` (event arrays), read with :meth:`snapshot` once a second."""

    def __init__(self) -> None:
        self._ops: dict[tuple[int, int], _OpRing] = {}
        self.total = 0

    def add(self, ev: np.ndarray) -> None:
        if ev.size == 0:
            return
        code = ev["source"].astype(np.int64) << 8 | ev["op"]
        if code[0] == code[-1] and bool((code == code[0]).all()):  # one op in the whole drain
            self._add(int(code[0]), ev["duration"], int(np.count_nonzero(ev["ret"])))
            return
        order = np.argsort(code, kind="stable")
        code = code[order]
        dur = ev["duration"][order]
        err = ev["ret"][order] != 0
        starts = np.concatenate(([0], np.flatnonzero(code[1:] != code[:-1]) + 1))
        ends = np.append(starts[1:], code.size)
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            self._add(int(code[s]), dur[s:e], int(np.count_nonzero(err[s:e])))

    def _add(self, code: int, durations: np.ndarray, errors: int) -> None:
        if code & 0xFF >= 100:  # control records (NCCL communicators), not events
            return
        self.total += durations.size
        ring = self._ops.setdefault((code >> 8, code & 0xFF), _OpRing())
        if durations.size > SAMPLE:  # percentiles from an even sample, counts exact
            ring.count += durations.size - durations[:: durations.size // SAMPLE + 1].size
            durations = durations[:: durations.size // SAMPLE + 1]
        ring.add(durations.astype(np.int64), errors)

    def add_counts(self, source: int, op: int, count: int) -> None:
        """Count-only input (kernel-aggregated page allocations)."""
        ring = self._ops.setdefault((source, op), _OpRing())
        ring.count += count
        self.total += count

    def snapshot(self, interval_s: float) -> list[OpLine]:
        lines = []
        for (src, op), ring in self._ops.items():
            rate = (ring.count - ring.last_count) / interval_s if interval_s > 0 else 0.0
            ring.last_count = ring.count
            if ring.filled:
                vals = ring.values[: ring.filled]
                p50, p95, p99 = (float(x) for x in np.percentile(vals, [50, 95, 99]))
                mx = float(vals.max())
            else:
                p50 = p95 = p99 = mx = 0.0
            lines.append(OpLine(src, op, catalog.op_name(src, op), ring.count, rate, p50, p95, p99, mx, ring.errors))
        lines.sort(key=lambda x: (-x.count, x.source, x.op))
        return lines
