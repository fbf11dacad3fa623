"""Slower regimes of a GPU op: every stretch where its calls ran slower than their steady level.

A ratio gate (p99 / p50 ≥ 3) misses a slowdown that hits many calls: when a third of the calls run
3x slower, p99 / p50 is just under 3 and seconds of wall time go unreported. Slowdowns are found by
*regime* instead, in three steps, all vectorised with numpy:

1. **The steady level** (:func:`steady_level`): the calls, in time order, are cut into consecutive
   blocks (at most :data:`BLOCKS`, at least :data:`MIN_BLOCK` calls each); the steady level is the
   lower quartile of the block medians. A block median barely moves under call-to-call noise, so an
   op whose calls merely vary gets its median; a slower regime lifts only the blocks it covers, so the
   level stays at the fast regime's as long as a quarter of the run is fast. (The plain median lands
   in the slow mode once half the calls are slow; a fixed percentile of the calls sits below the
   median of any op whose calls vary.)
2. **Slow calls**: a call is slow at ≥ :data:`SLOW_FACTOR` x the steady level (for a call of another
   size, x its ``scale``: a 16 MB copy is judged as 16 MB).
3. **Stretches** (run-length): the slow calls of one thread, in time order, merged across at most
   :data:`MAX_GAP` fast calls between them. A stretch is a regime when it has :data:`MIN_SLOW` slow
   calls, or one call :data:`STALL_FACTOR` x steady (a stall). Its lost time is the excess of its slow
   calls over the steady level: ``Σ (dur − steady x scale)``, never more than their own time.

Why run-length and not a change-point search (measured on synthetic series, 10 seeds, 900 calls of
σ = 5 % jitter with a 3x regime over the middle third hitting 10-100 % of its calls; i.i.d. log-normal
noise alone; one 20x stall): run-length with an 8-call gap found the regime's slow calls with mean
recall 0.61 / 0.92 / 1.0 / 1.0 at 10 / 20 / 40 / 60+ % of the calls hit, and its lost time within
1 % from 40 % up; a rolling median over 9 calls crossing 2x steady (the change-point alternative) had
0.01 / 0.07 / 0.36 / 0.80 (it loses a regime where fewer than half the calls are slow — a pinned CPU
hog that takes the core part of the time) and never saw the stall, which run-length kept 10 times in
10. Noise of σ = 0.3 made a regime once in 10 series (≤ 0.4 % of the op's time); σ = 0.45 (6 % of the
calls ≥ 2x by chance) makes ~12 small ones (~6 % of the op's time): those are left to the host evidence
and the dominant-share test, which is where a cause is decided anyway. The steady level came within
1.3 % of the fast level in every series. Run-length is one pass (a cumulative sum); a change-point
search per op is not.

:func:`steady_level` is the op's regime-aware steady speed for the wall-time ledger too: the time a
call spends beyond it is time lost to a slower regime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Bool = npt.NDArray[np.bool_]

SLOW_FACTOR = 2.0  # a call this many times its op's steady level is slow
MAX_GAP = 8  # fast calls a stretch bridges between two slow ones
MIN_SLOW = 3  # slow calls that make a stretch a regime ...
STALL_FACTOR = 10.0  # ... or a single call this many times steady (a stall)
BLOCKS = 64  # the steady level's blocks of consecutive calls, at most
MIN_BLOCK = 8  # calls per block, at least
STEADY_QUANTILE = 0.25  # of the block medians


def steady_level(dur: npt.ArrayLike) -> int:
    """The regime-aware steady duration (ns) of an op's calls, given in time order (see the module
    docstring): the lower quartile of the medians of consecutive blocks of calls; the median when
    there are too few calls for two blocks; 0 without calls."""
    d = np.asarray(dur, dtype=np.float64)
    n = d.size
    if n == 0:
        return 0
    block = max(MIN_BLOCK, -(-n // BLOCKS))
    k = n // block
    if k < 2:
        return round(float(np.median(d)))
    medians = np.median(d[: k * block].reshape(k, block), axis=1)
    return round(float(np.quantile(medians, STEADY_QUANTILE)))


@dataclass(frozen=True)
class Regimes:
    """The slower regimes of one op. Per call (in the order given to :func:`find`): ``stretch`` (the
    regime it falls in, −1 outside), ``slow`` (a slow call inside a regime) and ``excess`` (its time
    beyond steady, inside a regime; 0 elsewhere). Per regime: its thread, first call's start, last
    call's end, calls, slow calls, lost time and worst call."""

    steady_ns: int
    stretch: I64
    slow: Bool
    excess: I64
    tid: I64
    start_ns: I64
    end_ns: I64
    calls: I64
    slow_calls: I64
    lost_ns: I64
    worst_ns: I64

    @property
    def n(self) -> int:
        return int(self.lost_ns.size)

    @property
    def lost_total_ns(self) -> int:
        return int(self.lost_ns.sum())


def find(
    ts_ns: I64,
    dur: I64,
    tid: I64 | None = None,
    *,
    scale: F64 | None = None,
    ignore: Bool | None = None,
    steady_ns: int | None = None,
) -> Regimes:
    """The slower regimes of one op's calls (see the module docstring).

    ``tid``: the calling thread of each call (stretches never cross threads); ``scale``: each call's
    expected duration relative to the op's typical call (a copy's bytes over the median bytes), 1 when
    omitted; ``ignore``: calls never slow (a kernel's first launch: loading, not a regime);
    ``steady_ns``: the steady level, else :func:`steady_level` of the calls (size-normalised)."""
    n = int(ts_ns.size)
    norm = dur / np.maximum(scale, 1e-12) if scale is not None else dur.astype(np.float64)
    # calls usually come in time order from one thread: then nothing is sorted, gathered or scattered
    in_time = bool((ts_ns[1:] >= ts_ns[:-1]).all())
    time_order = None if in_time else np.argsort(ts_ns, kind="stable")
    in_order = norm if time_order is None else norm[time_order]
    steady = steady_level(in_order) if steady_ns is None else int(steady_ns)
    one_thread = tid is None or n == 0 or bool((tid == tid[0]).all())
    order = time_order if tid is None or one_thread else np.lexsort((ts_ns, tid))
    d = norm if order is None else norm[order]  # in stretch order: per thread, in time
    slow = d >= SLOW_FACTOR * max(steady, 1)
    if ignore is not None:
        slow &= ~(ignore if order is None else ignore[order])
    p = np.flatnonzero(slow)
    if p.size == 0:
        return _empty(n, steady)
    th = None if tid is None else (tid if order is None else tid[order])
    gap = np.diff(p) > MAX_GAP + 1
    if th is not None and not one_thread:
        gap |= th[p[1:]] != th[p[:-1]]
    brk = np.flatnonzero(gap) + 1
    heads = np.concatenate(([0], brk))
    tails = np.concatenate((brk - 1, [p.size - 1]))
    n_slow = np.diff(np.concatenate((heads, [p.size])))
    worst = np.maximum.reduceat(d[p], heads)
    keep = (n_slow >= MIN_SLOW) | (worst >= STALL_FACTOR * max(steady, 1))
    if not keep.any():
        return _empty(n, steady)
    heads, tails, n_slow = heads[keep], tails[keep], n_slow[keep]
    first, last = p[heads], p[tails]
    # the slow calls' excess over steady (the other calls have none): summed per stretch over the slow
    # calls only, the same running sums as over every call
    at = p if order is None else order[p]  # the slow calls, as given
    s_p = 1.0 if scale is None else np.maximum(scale[at], 1e-12)
    excess_p = np.maximum(dur[at] - steady * s_p, 0.0)
    cum = np.concatenate(([0.0], np.cumsum(excess_p)))
    lost = np.round(cum[tails + 1] - cum[heads]).astype(np.int64)
    # per call: the stretch it falls in (every call from a stretch's first slow call to its last)
    lens = last - first + 1
    starts = np.cumsum(lens) - lens
    inside = np.arange(int(lens.sum())) - np.repeat(starts - first, lens)  # positions in stretch order
    sid = np.repeat(np.arange(first.size), lens)
    in_stretch = np.zeros(p.size, dtype=bool)  # slow calls inside a kept stretch
    in_stretch[np.repeat(heads, tails - heads + 1) + _ramp(tails - heads + 1)] = True
    pk = at[in_stretch]
    stretch = np.full(n, -1, dtype=np.int64)
    stretch[inside if order is None else order[inside]] = sid
    slow_out = np.zeros(n, dtype=bool)
    slow_out[pk] = True
    exc_out = np.zeros(n, dtype=np.int64)
    exc_out[pk] = np.round(excess_p[in_stretch]).astype(np.int64)
    g_first, g_last = (first, last) if order is None else (order[first], order[last])
    return Regimes(
        steady_ns=steady,
        stretch=stretch,
        slow=slow_out,
        excess=exc_out,
        tid=(th[first] if th is not None else np.zeros(first.size)).astype(np.int64),
        start_ns=ts_ns[g_first].astype(np.int64),
        end_ns=(ts_ns[g_last] + dur[g_last]).astype(np.int64),
        calls=lens.astype(np.int64),
        slow_calls=n_slow.astype(np.int64),
        lost_ns=lost,
        worst_ns=_worst(dur if order is None else dur[order], first, last),
    )


def _ramp(lens: I64) -> I64:
    """0, 1, ..., len - 1 for each length, concatenated."""
    starts = np.cumsum(lens) - lens
    out: I64 = np.arange(int(lens.sum())) - np.repeat(starts, lens)
    return out


def _worst(dur_sorted: I64, first: I64, last: I64) -> I64:
    """The longest call of each stretch [first, last] (durations in stretch order)."""
    view = dur_sorted[int(first[0]) : int(last[-1]) + 1]  # a view that ends where the last stretch ends
    cut = np.empty(2 * first.size - 1, dtype=np.int64)
    cut[0::2], cut[1::2] = first - first[0], last[:-1] + 1 - first[0]
    red = np.maximum.reduceat(view, cut)
    return red[0::2].astype(np.int64)


def _empty(n: int, steady: int) -> Regimes:
    z = np.zeros(0, dtype=np.int64)
    return Regimes(steady, np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64),
                   z, z, z, z, z, z, z)  # fmt: skip
