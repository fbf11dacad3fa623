"""Allocator churn: the caching allocator emptied and refilled (``torch.cuda.empty_cache()`` in a loop).

PyTorch's caching allocator keeps freed blocks; ``empty_cache()`` hands them all back to the driver at
once — a *burst* of ``cudaFree`` calls — and the next steps must ``cudaMalloc`` fresh memory from the
driver, each call far slower than a cache hit. The evidence is that sequence on one process: a burst of
frees, then allocations within :data:`FOLLOW_NS`, again and again. Time lost: the frees plus the
following allocations' excess over the allocation's steady p50 (the median of the allocations that
follow no release; none: a cache hit makes no driver call, so a driver allocation is all excess), and
the first synchronisation after them: its excess over the sync's steady level (the re-paged memory,
the KV cache refilled, is waited for there). Each allocation and sync belongs to the release before
it only (up to the next release), so no time is counted twice; the loss is never more than the wall.

The sets are narrower than the catalog's ``ALLOC_OPS``/``FREE_OPS`` on purpose (the leak rule, which
matches pointers and drops nested calls, takes the catalog's): a release is counted in runtime frees,
because libcudart's ``cudaFree`` calls libcuda's ``cuMemFree`` and counting both would make a burst of
two frees look like four; ``cudaFreeAsync`` returns memory to a stream-ordered pool, not to the driver,
so it is no release of the cache.

When the periodic rule already reported the allocation spikes of that process, the measured churn is
added to its chain (one diagnosis); otherwise it makes its own.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ingero.explain import causes as cz
from ingero.explain.context import Context
from ingero.explain.frame import I64
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.regimes import steady_level
from ingero.store.catalog import op_ids
from ingero.timeutil import NS_PER_MS, NS_PER_S, fmt_duration

FREE_OPS = op_ids("cudaFree")
MALLOC_OPS = op_ids("cudaMalloc", "cuMemAlloc")
SYNC_OPS = op_ids("cudaStreamSync", "cudaDeviceSync", "cuCtxSynchronize", "cudaEventSynchronize")
MIN_BASELINE = 3  # allocations outside the releases' windows before their median is the steady cost
BURST_GAP_NS = 50 * NS_PER_MS  # frees closer than this belong to one release
MIN_FREES = 4  # frees in a release
FOLLOW_NS = 2 * NS_PER_S  # allocations this soon after a release refill the cache
MIN_EPISODES = 3


def _mask(ctx: Context, ops: tuple[tuple[int, int], ...], pid: int) -> npt.NDArray[np.bool_]:
    g = ctx.gpu
    m = np.zeros(g.size, dtype=bool)
    for s, o in ops:
        m |= (g.source == s) & (g.op == o)
    out: npt.NDArray[np.bool_] = m & (g.pid == pid)
    return out


def _bursts(ts: I64, alloc_ts: I64) -> list[tuple[int, int, int]]:
    """(start, end, count) of runs of ≥ MIN_FREES timestamps with gaps < BURST_GAP_NS and no allocation
    between them (two releases in a row are two releases, each with its own refill)."""
    if ts.size < MIN_FREES:
        return []
    allocs_before = np.searchsorted(np.sort(alloc_ts), ts)
    brk = np.flatnonzero((np.diff(ts) >= BURST_GAP_NS) | (np.diff(allocs_before) > 0)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [ts.size]))
    return [(int(ts[a]), int(ts[b - 1]), int(b - a)) for a, b in zip(starts, ends, strict=True) if b - a >= MIN_FREES]


def _syncs(ctx: Context, pid: int) -> tuple[I64, I64, int]:
    """The process's synchronisations (start, duration, in time order) and their steady level."""
    m = _mask(ctx, SYNC_OPS, pid)
    ts, dur = ctx.gpu.ts_ns[m], ctx.gpu.dur[m]
    order = np.argsort(ts, kind="stable")
    return ts[order], dur[order], steady_level(dur[order])


def _episodes(
    bursts: list[tuple[int, int, int]], f_ts: I64, f_dur: I64, m_ts: I64, m_dur: I64, s_ts: I64, s_dur: I64, steady: int
) -> tuple[list[tuple[int, int, int, int]], float]:
    """(start, frees, allocations after, lost ns) per release that allocations follow, and the
    allocation's steady cost. A release's window runs from its last free to FOLLOW_NS later or the next
    release, whichever is first; its loss is its frees, its allocations' excess over the steady cost and
    the first sync after its last allocation beyond the sync's steady level."""
    if not bursts:
        return [], 0.0
    b = np.asarray([x[1] for x in bursts], dtype=np.int64)
    nxt = np.append(np.asarray([x[0] for x in bursts[1:]], dtype=np.int64), np.iinfo(np.int64).max)
    end = np.minimum(b + FOLLOW_NS, nxt)
    k = np.searchsorted(b, m_ts, side="left") - 1  # the release before each allocation
    inside = (k >= 0) & (m_ts > b[np.maximum(k, 0)]) & (m_ts <= end[np.maximum(k, 0)])
    outside = m_dur[~inside]
    p50 = float(np.median(outside)) if outside.size >= MIN_BASELINE else 0.0
    excess = np.clip(m_dur - p50, 0, None) * inside
    alloc_lost = np.bincount(k[inside], weights=excess[inside], minlength=b.size)
    n_alloc = np.bincount(k[inside], minlength=b.size)
    last_alloc = np.full(b.size, -1, dtype=np.int64)
    np.maximum.at(last_alloc, k[inside], m_ts[inside])
    out = []
    for i, (a, z, n) in enumerate(bursts):
        if n_alloc[i] == 0:
            continue
        freed = int(f_dur[(f_ts >= a) & (f_ts <= z)].sum())
        j = int(np.searchsorted(s_ts, last_alloc[i], side="right"))
        spike = int(max(0, s_dur[j] - steady)) if j < s_ts.size and s_ts[j] <= end[i] else 0
        out.append((a, n, int(n_alloc[i]), freed + int(alloc_lost[i]) + spike))
    return out, p50


def churn_chains(ctx: Context, chains: list[Chain]) -> list[Chain]:
    out: list[Chain] = []
    g = ctx.gpu
    wall = max(1, g.last_ns - g.first_ns)
    for pid in g.pids.tolist():
        fm, mm = _mask(ctx, FREE_OPS, pid), _mask(ctx, MALLOC_OPS, pid)
        if int(fm.sum()) < MIN_FREES * MIN_EPISODES or int(mm.sum()) < 2:
            continue
        f_ts, f_dur = g.ts_ns[fm], g.dur[fm]
        order = np.argsort(f_ts, kind="stable")
        f_ts, f_dur = f_ts[order], f_dur[order]
        m_ts, m_dur = g.ts_ns[mm], g.dur[mm]
        episodes, p50 = _episodes(_bursts(f_ts, m_ts), f_ts, f_dur, m_ts, m_dur, *_syncs(ctx, pid))
        if len(episodes) < MIN_EPISODES:
            continue
        lost = min(sum(e[3] for e in episodes), wall)
        frees = sum(e[1] for e in episodes)
        evidence = {
            "releases": len(episodes),
            "frees_in_releases": frees,
            "mallocs_after": sum(e[2] for e in episodes),
            "churn_lost_ms": round(lost / 1e6, 1),
        }
        words = (
            f"{len(episodes)} releases of the allocator cache ({frees} cudaFree calls in bursts), each followed by "
            f"fresh allocations from the driver; {fmt_duration(round(lost / NS_PER_MS) * NS_PER_MS)} lost"
        )
        periodic = next(
            (
                c
                for c in chains
                if c.family == "periodic"
                and c.evidence.get("pid", ctx.pid) == ctx.pid
                and any(c.cuda_op == n for n in ("cudaMalloc", "cuMemAlloc"))
            ),
            None,
        )
        if periodic is not None:
            periodic.evidence.update(evidence)
            periodic.explanation += f" Measured churn: {words}."
            periodic.timeline.insert(0, TimelineEntry("CUDA", "cudaFree", words))
            continue
        sev = cz.severity_of_loss(lost, wall)
        out.append(
            ctx.chain(
                cid=ctx.chain_id("alloc-churn", f"pid{pid}" if ctx.pid is None else ""),
                detected_at=int(episodes[-1][0]),
                severity=sev,
                summary=f"allocator churn: {words}",
                root_cause=(
                    f"the CUDA caching allocator is being emptied — {ctx.proc(pid)} releases its cached blocks "
                    f"in bursts ({len(episodes)} times) and pays cudaMalloc from the driver again each time "
                    "(torch.cuda.empty_cache() in the loop, or memory pressure forcing releases)"
                ),
                explanation=(
                    f"{words}: {100 * lost / wall:.1f}% of wall time. Allocation p50 is {fmt_duration(round(p50))}; "
                    "after each release the allocations go to the driver instead of the cache."
                ),
                recommendations=[
                    "Drop torch.cuda.empty_cache() from the training loop (call it, if at all, between phases)",
                    "Keep tensor shapes static so cached blocks are reused; "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation",
                ],
                family="alloc-churn",
                evidence={
                    "rule": "alloc-churn",
                    **evidence,
                    "lost_share": round(lost / wall, 4),
                    "score": round(lost / wall, 4),
                },
                timeline=[TimelineEntry("CUDA", "cudaFree", words, lost // 1000)],
            )
        )
    return out
