"""GPU memory leak: live bytes of a process grow steadily to the end of the window, no plateau.

Allocations are matched with their frees by pointer (:mod:`ingero.store.allocations`: the tracer
records ``cudaMalloc``'s returned pointer in ``arg1`` and ``cudaFree``'s in ``arg0``). A caching
allocator warming up grows and then stops; a healthy allocate/free loop stays flat; a leak keeps
growing. The window of the process's allocation activity is cut into :data:`SEGMENTS` equal spans and
the live bytes at the end of each compared: a leak is growth of at least :data:`MIN_GROWTH_BYTES`
overall, in at least :data:`STEADY_SHARE` of the steps, with the last span still growing and the
second half holding at least :data:`LATE_SHARE` of the growth.

A leak loses no time until memory runs out (the OOM rules report that), so severity comes from the
memory at stake: MEDIUM from :data:`MEDIUM_BYTES` of growth, LOW below. The chain names the top
allocating stacks of the memory still held (:func:`add_stacks`, from the database).

Runtime allocations (``cudaMalloc``/``cudaFree`` and the stream-ordered ``cudaMallocAsync``/
``cudaFreeAsync``) are read from the loaded frame; the driver's
(``cuMemAlloc``/``cuMemFree``) are counted by :mod:`ingero.store.allocations` for ``live_bytes``
readers but not judged here (the frame does not carry ``cuMemFree``'s pointer).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

import numpy as np

from ingero.explain.context import Context
from ingero.explain.model import Chain, TimelineEntry
from ingero.store import allocations as al
from ingero.store.catalog import ALLOC_OPS, FREE_OPS, op_name
from ingero.store.window import Window
from ingero.timeutil import NS_PER_S, fmt_duration

# Runtime allocations (arg0 = bytes, arg1 = pointer) and the free that releases each (arg0 = pointer)
# Every allocator of the catalog (runtime, async, managed, driver): allocations.live_series drops the inner
# half of a nested runtime→driver call, so a process that allocates through libcuda alone is covered too.
MALLOCS, FREES = ALLOC_OPS, FREE_OPS
# What each allocation is freed with (for the chain's words: "cuMemAlloc without cuMemFree")
FREE_OF = {
    "cudaMalloc": "cudaFree",
    "cudaMallocManaged": "cudaFree",
    "cudaMallocAsync": "cudaFreeAsync",
    "cuMemAlloc": "cuMemFree",
    "cuMemAllocManaged": "cuMemFree",
}
FAMILY = "gpu-leak"
SEGMENTS = 8
MIN_ALLOCS = 16
MIN_GROWTH_BYTES = 64 << 20
MEDIUM_BYTES = 1 << 30
STEADY_SHARE = 0.75  # of the segment-to-segment steps grow
LATE_SHARE = 0.25  # of the growth happens in the second half (no plateau)
TOP_STACKS = 3
MiB = 1 << 20


@dataclass(frozen=True)
class Growth:
    start_ns: int
    end_ns: int
    start_bytes: int
    live_bytes: int
    steps_up: int
    steps: int

    @property
    def growth(self) -> int:
        return self.live_bytes - self.start_bytes

    @property
    def rate_per_s(self) -> float:
        return self.growth * NS_PER_S / max(1, self.end_ns - self.start_ns)


def steady_growth(series: al.LiveSeries, allocations: int) -> Growth | None:
    """The leak-shaped growth of a live-bytes series, or None (see the module docstring)."""
    if allocations < MIN_ALLOCS or series.size < 2:
        return None
    t0, t1 = int(series.ts_ns[0]), int(series.ts_ns[-1])
    if t1 <= t0:
        return None
    # integer edges: nanosecond timestamps (~2^61) do not survive float64, whose rounding could put the
    # last edge before the last row and leave the final allocation out of the live bytes
    edges = t0 + (t1 - t0) * np.arange(1, SEGMENTS + 1, dtype=np.int64) // SEGMENTS
    idx = np.searchsorted(series.ts_ns, edges, side="right") - 1
    ends = np.concatenate(([int(series.live[0])], series.live[np.clip(idx, 0, series.size - 1)]))
    steps = np.diff(ends)
    growth = int(ends[-1] - ends[0])
    half = int(ends[-1] - ends[SEGMENTS // 2])
    up = int((steps > 0).sum())
    if growth < MIN_GROWTH_BYTES or up < STEADY_SHARE * steps.size or steps[-1] <= 0 or half < LATE_SHARE * growth:
        return None
    return Growth(t0, t1, int(ends[0]), int(ends[-1]), up, int(steps.size))


def leak_chains(ctx: Context) -> list[Chain]:
    a = ctx.frame.args
    by_alloc = [a.is_op(op) for op in MALLOCS]
    is_alloc = np.logical_or.reduce(by_alloc)
    is_free = np.logical_or.reduce([a.is_op(op) for op in FREES])
    pids = ctx.gpu.pids if ctx.pid is None else np.asarray([ctx.pid], dtype=np.int64)
    out: list[Chain] = []
    for pid in pids.tolist():
        m = (is_alloc | is_free) & (a.pid == pid)
        if not m.any():
            continue
        alloc = is_alloc[m]
        kind = np.where(alloc, al.ALLOC, al.FREE).astype(np.int64)
        ptr = np.where(alloc, a.arg1[m], a.arg0[m])
        size = np.where(alloc, a.arg0[m], 0)
        series = al.live_series(kind, ptr, a.ts_ns[m], size)
        g = steady_growth(series, int((alloc & (ptr != 0)).sum()))
        if g is not None:
            mine = a.pid == pid
            # the allocator it uses most (ties: the catalog's order, runtime before the driver it calls)
            used = MALLOCS[int(np.argmax([int((k & mine).sum()) for k in by_alloc]))]
            name = op_name(*used)
            pair = (name, FREE_OF.get(name, "a free"))
            out.append(_chain(ctx, int(pid), g, series, int((~alloc).sum()), pair))
    return out


def _chain(ctx: Context, pid: int, g: Growth, series: al.LiveSeries, frees: int, pair: tuple[str, str]) -> Chain:
    span = fmt_duration(g.end_ns - g.start_ns)
    words = (
        f"GPU memory held by {ctx.proc(pid)} grew {g.growth / MiB:.0f} MiB in {span} "
        f"({g.rate_per_s / MiB:.1f} MiB/s) and never levelled off: {g.live_bytes / MiB:.0f} MiB live"
    )
    return ctx.chain(
        cid=ctx.chain_id(FAMILY, f"pid{pid}" if ctx.pid is None else ""),
        detected_at=g.end_ns,
        severity="MEDIUM" if g.growth >= MEDIUM_BYTES else "LOW",
        summary=f"GPU memory leak: {pair[0]} without {pair[1]} — {words}",
        root_cause=(
            f"allocations are kept: {ctx.proc(pid)} frees {series.freed / MiB:.0f} MiB of the "
            f"{series.allocated / MiB:.0f} MiB it allocates, and what stays grows in {g.steps_up} of "
            f"{g.steps} spans of the window (tensors kept alive across steps: a list of losses or outputs, "
            "a growing cache, a graph retained with retain_graph)"
        ),
        explanation=(
            f"{words}. Allocations are matched with their frees by pointer; a caching allocator warming up "
            "levels off, this does not. Left running, the process runs out of GPU memory."
        ),
        recommendations=[
            "Look at the top allocating stacks: what is allocated there and who keeps a reference to it",
            "Store .item() / .detach().cpu() of per-step values, not the tensors; "
            "torch.cuda.memory_summary() between steps confirms the growth",
        ],
        family=FAMILY,
        evidence={
            "rule": FAMILY,
            "pid": pid,
            "live_bytes": g.live_bytes,
            "growth_bytes": g.growth,
            "rate_bytes_per_s": round(g.rate_per_s),
            "allocated_bytes": series.allocated,
            "freed_bytes": series.freed,
            "frees": frees,
            "window_start_ns": g.start_ns,
            "window_end_ns": g.end_ns,
            "top_stacks": [],
        },
        timeline=[TimelineEntry("CUDA", pair[0], words)],
    )


def add_stacks(conn: sqlite3.Connection, chains: list[Chain], window: Window | None = None) -> None:
    """Fill each leak chain's ``top_stacks``: the stacks that allocated the most memory still held, in the
    explain window (the memory the chain measured, not the process's whole history)."""
    for c in chains:
        if c.family != FAMILY:
            continue
        pid = int(c.evidence["pid"])
        known = conn.execute("SELECT 1 FROM events WHERE node = ? LIMIT 1", (c.node,)).fetchone()
        kind, ptr, ts, size, stack = al.load_rows(conn, pid, node=c.node if known else None, window=window)
        held = al.unfreed(kind, ptr, ts, size)
        c.evidence["top_stacks"] = _top(conn, stack[held], size[held])
        if c.evidence["top_stacks"]:
            top = c.evidence["top_stacks"][0]
            c.explanation += f" Most of it was allocated at {' ← '.join(top['frames'][:3]) or 'an unsymbolized stack'}."


def _top(conn: sqlite3.Connection, stack: al.I64, size: al.I64) -> list[dict[str, Any]]:
    if not stack.size:
        return []
    hashes, inv = np.unique(stack, return_inverse=True)
    held = np.bincount(inv, weights=size.astype(np.float64))
    count = np.bincount(inv)
    out: list[dict[str, Any]] = []
    for i in np.argsort(-held, kind="stable")[:TOP_STACKS]:
        h = int(hashes[i])
        row = conn.execute("SELECT frames FROM stack_traces WHERE hash = ?", (h,)).fetchone() if h else None
        out.append({"stack_hash": h, "bytes": int(held[i]), "allocations": int(count[i]), "frames": _frames(row)})
    return out


def _frames(row: tuple[Any, ...] | None) -> list[str]:
    if not row or not row[0]:
        return []
    try:
        frames = json.loads(row[0])
    except ValueError:
        return []
    return [str(f.get("s") or f.get("f") or "?") for f in frames if isinstance(f, dict)]
