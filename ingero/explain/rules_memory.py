"""Allocator churn: the caching allocator emptied and refilled (``torch.cuda.empty_cache()`` in a loop).

PyTorch's caching allocator keeps freed blocks; ``empty_cache()`` hands them all back to the driver at
once — a *burst* of ``cudaFree`` calls — and the next steps must ``cudaMalloc`` fresh memory from the
driver, each call far slower than a cache hit. The evidence is that sequence on one process: a burst of
frees, then allocations within :data:`FOLLOW_NS`, again and again. Time lost: the frees plus the
following allocations' excess over the allocation's steady p50.

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
from ingero.store.catalog import op_ids
from ingero.timeutil import NS_PER_MS, NS_PER_S, fmt_duration

FREE_OPS = op_ids("cudaFree")
MALLOC_OPS = op_ids("cudaMalloc", "cuMemAlloc")
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


def _bursts(ts: I64) -> list[tuple[int, int, int]]:
    """(start, end, count) of runs of ≥ MIN_FREES timestamps with gaps < BURST_GAP_NS."""
    if ts.size < MIN_FREES:
        return []
    brk = np.flatnonzero(np.diff(ts) >= BURST_GAP_NS) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [ts.size]))
    return [(int(ts[a]), int(ts[b - 1]), int(b - a)) for a, b in zip(starts, ends, strict=True) if b - a >= MIN_FREES]


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
        p50 = float(np.median(m_dur))
        bursts = _bursts(f_ts)
        episodes: list[tuple[int, int, int, int]] = []  # start, frees, mallocs after, lost ns
        for a, b, n in bursts:
            after = (m_ts > b) & (m_ts <= b + FOLLOW_NS)
            if not after.any():
                continue
            freed = int(f_dur[(f_ts >= a) & (f_ts <= b)].sum())
            lost = freed + int(np.clip(m_dur[after] - p50, 0, None).sum())
            episodes.append((a, n, int(after.sum()), lost))
        if len(episodes) < MIN_EPISODES:
            continue
        lost = sum(e[3] for e in episodes)
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
