"""A GPU thread's calls as the wall-time ledger reads them: each op's steady level, the busy stretches
its calls make (overlapping calls merged), the time beyond steady, and the gaps between the stretches —
which of them are judged for GPU idle, and by what (:func:`~ingero.explain.ledger_gaps.judge_idle`).

The ledger (:mod:`ingero.explain.ledger`) and the ledger per label (:mod:`ingero.explain.by_label`) both
cut a thread's wall time with :func:`thread_calls`: one definition of busy, slow, drained and judged.

``steady_ns`` is the one definition of an op's steady level (the median of the op's calls on the node
plus their noise band); a regime-aware level can replace it here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ingero.explain.frame import I64
from ingero.explain.ledger_gaps import GAP_NS, ends_a_step
from ingero.explain.offcpu import union
from ingero.store.catalog import NCCL, op_ids

__all__ = ["DRAINING", "ThreadCalls", "drains", "op_keys", "steady_levels", "steady_ns", "thread_calls"]

FEW_OPS = 12  # up to this many ops, their calls are grouped by one pass each (_grouped)
NOISE_SIGMAS = 3.0  # a call is slow beyond its op's median plus this many robust sigmas (1.4826 MAD)
# calls that return only once the GPU's queue (a stream, the device) is drained: after them, a gap is GPU idle
DRAINING = op_ids(
    "cudaStreamSync",
    "cudaDeviceSync",
    "cudaEventSynchronize",
    "cuCtxSynchronize",
    "cudaMemcpy",
    "cuMemcpy",
    "cudaMemcpy2D",
    "cudaMemcpyPeer",
    "cudaMemset",
    "cudaFree",
    "cuMemFree",
)
_DRAINS = np.zeros(1 << 12, dtype=bool)  # by (source & 0xF) << 8 | (op & 0xFF), like frame's GPU table
_DRAINS[[(s & 0xF) << 8 | (o & 0xFF) for s, o in DRAINING]] = True


def op_keys(src: I64, op: I64) -> I64:
    """Each call's op key ``(source & 0xF) << 8 | (op & 0xFF)``: what :func:`drains` and
    :func:`~ingero.explain.ledger_gaps.ends_a_step` read."""
    out: I64 = ((src & 0xF) << 8) | (op & 0xFF)
    return out


def drains(keys: I64) -> npt.NDArray[np.bool_]:
    """Which calls (op keys) return only once the GPU's queue is drained (:data:`DRAINING`)."""
    out: npt.NDArray[np.bool_] = _DRAINS[keys]
    return out


def steady_ns(source: I64, op: I64, dur: I64) -> I64:
    """Per call, the steady level of its op on this node: the median of the op's calls plus their
    noise band (``NOISE_SIGMAS`` robust sigmas); an NCCL collective's own duration (its excess is
    waiting for the other ranks, judged across nodes)."""
    return steady_levels(source, op, dur)[0]


def steady_levels(source: I64, op: I64, dur: I64) -> tuple[I64, dict[tuple[int, int], int]]:
    """:func:`steady_ns`, and each op's level."""
    levels: dict[tuple[int, int], int] = {}
    if dur.size == 0:
        return dur.copy(), levels
    key = (((source & 0xFF) << 8) | (op & 0xFF)).astype(np.uint16)  # catalog ids are small
    counts = np.bincount(key, minlength=1 << 16)
    keys = np.flatnonzero(counts).tolist()
    level = np.full(1 << 16, -1, dtype=np.int64)  # per op key; -1: the call's own duration (NCCL)
    for k, d in zip(keys, _grouped(key, dur, keys, counts), strict=True):
        if k >> 8 == NCCL:
            continue
        med = float(np.median(d, overwrite_input=True))  # d: a copy of the op's durations
        dev = d - med
        mad = float(np.median(np.abs(dev, out=dev), overwrite_input=True))
        levels[(k >> 8, k & 0xFF)] = level[k] = round(med + NOISE_SIGMAS * 1.4826 * mad)
    per_call = level[key]
    return np.where(per_call >= 0, per_call, dur), levels


def _grouped(key: npt.NDArray[np.uint16], dur: I64, keys: list[int], counts: I64) -> Iterator[I64]:
    """Each op's durations (a copy), op by op in ``keys`` order: a streaming pass per op for the usual
    few ops, one radix sort for many (a sort's gather reads the column out of order: slower on millions)."""
    if len(keys) <= FEW_OPS:
        for k in keys:
            yield dur[key == k]
        return
    sd = dur[np.argsort(key, kind="stable")]  # grouped in key order
    bounds = np.concatenate(([0], np.cumsum(counts[keys]))).tolist()
    for lo, hi in itertools.pairwise(bounds):
        yield sd[lo:hi]


@dataclass
class ThreadCalls:
    """One GPU thread's calls, merged into busy stretches ``[b_start, b_end)``; its slow calls (``slow``,
    each beyond its steady level over ``[slow_from, slow_end)``) and their union ``[ss, se)``; and the gaps
    between the stretches: which follow a draining call (``drained``, per stretch), which are judged
    (``idle``, per gap), the duration and op key of the draining call that ends each judged gap (``sync``,
    -1: none), and the lengths of the gaps after syncs too short to be judged (``short``)."""

    w0: int
    w1: int
    b_start: I64
    b_end: I64
    slow: npt.NDArray[np.bool_]
    slow_from: I64
    slow_end: I64
    ss: I64
    se: I64
    drained: npt.NDArray[np.bool_]
    idle: npt.NDArray[np.bool_]
    sync: tuple[I64, I64]
    short: I64

    @property
    def g0(self) -> I64:
        return self.b_end[:-1]

    @property
    def g1(self) -> I64:
        return self.b_start[1:]


def thread_calls(ts: I64, end: I64, steady_end: I64, key: I64) -> ThreadCalls | None:
    """The thread's calls (in time order; ``key``: :func:`op_keys`) cut into busy stretches and gaps;
    None when they span no time."""
    reach = np.maximum.accumulate(end)
    w0, w1 = int(ts[0]), int(reach[-1])
    if w1 <= w0:
        return None
    new = np.concatenate(([True], ts[1:] > reach[:-1]))
    b_start = ts[new]
    b_end = reach[np.concatenate((new[1:], [True]))]  # a busy stretch ends where the next one starts
    # the draining calls (few: syncs, blocking copies) that end their busy stretch
    cand = np.flatnonzero(drains(key))
    busy_of = np.cumsum(new)[cand] - 1  # each call's stretch
    drained = np.zeros(b_start.size, dtype=bool)
    drained[busy_of[end[cand] == b_end[busy_of]]] = True
    slow = steady_end < end
    slow_from, slow_end = np.maximum(steady_end[slow], ts[slow]), end[slow]
    ss, se = union(slow_from, slow_end)
    g0, g1 = b_end[:-1], b_start[1:]
    long = (g1 - g0) >= GAP_NS
    nxt = np.flatnonzero(new)[1:]  # the call that ends each gap: a sync tells what the GPU did in it
    after = np.flatnonzero(long & ~drained[:-1])  # gaps after launches: judged where a draining call ends them
    idle = long & drained[:-1]  # the gaps judged (ledger_gaps.judge_idle)
    idle[after[drains(key[nxt[after]])]] = True
    at = nxt[idle]  # per judged gap, the call that ends it (ledger_gaps.paint's ``sync``)
    at_key = key[at]
    sync = (np.where(drains(at_key), end[at] - ts[at], -1), at_key)
    short = np.flatnonzero(drained[:-1] & ~long)  # the loop's pace counts its short gaps after syncs too
    short = short[ends_a_step(key[nxt[short] - 1])]
    return ThreadCalls(
        w0, w1, b_start, b_end, slow, slow_from, slow_end, ss, se, drained, idle, sync, g1[short] - g0[short]
    )
