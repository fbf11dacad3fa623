"""Periodic spikes: slow calls (≥ 10x p50) that recur at a regular interval with no host evidence — an
in-process cause (allocator churn, a periodic eval/checkpoint step), reported with its period in
iterations of the process's synchronisation op. A kernel's first launches are not spikes
(:mod:`ingero.explain.rules_launch`).
"""

from __future__ import annotations

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, fmt_ns, layer_of, short_ns
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.rules_latency import MIN_CALLS
from ingero.explain.rules_launch import LAUNCH_OPS, first_launch_mask
from ingero.explain.stats import OpStats
from ingero.store.catalog import op_ids
from ingero.timeutil import NS_PER_S

SPIKE_RATIO = 10.0
MIN_SPIKES = 4
MAX_CV = 0.35
SYNC_OPS = op_ids("cudaStreamSync", "cudaDeviceSync", "cuCtxSynchronize")
ALLOC_OPS = set(op_ids("cudaMalloc", "cudaFree", "cudaMallocManaged", "cuMemAlloc", "cuMemAllocManaged"))


def periodic_chains(ctx: Context, candidates: list[OpStats]) -> list[Chain]:
    chains: list[Chain] = []
    for st in candidates:
        if st.count < 5 * MIN_CALLS or st.p50_ns <= 0 or st.max_ns < SPIKE_RATIO * st.p50_ns:
            continue
        rows = ctx.rows(st)
        keep = np.ones(rows.ts_ns.size, dtype=bool)
        if (st.source, st.op) in LAUNCH_OPS:
            first = first_launch_mask(ctx, rows)  # first launches are the launch rule's, not spikes
            if first is not None:
                keep = ~first
        order = np.argsort(rows.ts_ns, kind="stable")
        order = order[keep[order]]
        ts, dur = rows.ts_ns[order], rows.dur[order]
        spike_ts = ts[dur >= SPIKE_RATIO * st.p50_ns]
        if spike_ts.size < MIN_SPIKES:
            continue
        gap = max(ctx.grid.width_ns, NS_PER_S)
        starts = spike_ts[np.concatenate(([True], np.diff(spike_ts) > gap))]
        if starts.size < MIN_SPIKES:
            continue
        intervals = np.diff(starts).astype(np.float64)
        mean = float(intervals.mean())
        cv = float(intervals.std() / mean) if mean > 0 else 1.0
        if cv > MAX_CV:
            continue
        marker, unit = _marker(ctx, st)
        mts = np.sort(marker)
        between = np.diff(np.searchsorted(mts, starts))
        per = float(np.median(between)) if between.size else 0.0
        spikes = dur >= SPIKE_RATIO * st.p50_ns
        excess = float((dur[spikes] - st.p50_ns).sum())
        span = max(1, ctx.gpu.last_ns - ctx.gpu.first_ns)  # wall time, as every rule's share
        share = excess / span
        if not cz.worth_a_chain(excess, span):
            ctx.notes.append(
                f"{ctx.node}: {st.name} spikes {short_ns(mean)} apart ({starts.size} of them) cost "
                f"{short_ns(excess)}, {100 * share:.2f}% of wall time: too little for a chain"
            )
            continue
        sev = cz.severity_of_loss(excess, span)
        alloc = (st.source, st.op) in ALLOC_OPS
        every = f"every ~{per:.0f} {unit}" if per >= 2 else f"every {short_ns(mean)}"
        summary = (
            f"{st.name} spikes {every} ({short_ns(mean)} apart): {starts.size} spikes up to {fmt_ns(st.max_ns)} "
            f"({st.max_ns / st.p50_ns:.0f}x p50)"
        )
        if alloc:
            root = (
                f"periodic allocator churn — {every} the caching allocator releases cached blocks and {st.name} "
                "has to get fresh memory from the driver (torch.cuda.empty_cache(), a periodic eval/logging step, "
                "or changing tensor shapes)"
            )
            recs = [
                "Do not call torch.cuda.empty_cache() inside the training loop",
                "Keep tensor shapes static (pad variable-length batches to a few fixed sizes) so cached blocks are reused",
                "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce fragmentation",
                "If a periodic eval/checkpoint step allocates, pre-allocate its buffers once",
            ]
        else:
            root = (
                f"a periodic in-process step {every} stalls {st.name}; no host evidence in the same windows, "
                "so the cause is inside the process (evaluation, checkpoint, logging, metric sync)"
            )
            recs = [
                f"Find what runs {every} (eval, checkpoint, logging, metric sync) and make it asynchronous or less frequent",
                "Query the slow calls' stacks: SELECT e.timestamp, e.duration, s.frames FROM events e "
                f"JOIN stack_traces s ON e.stack_hash = s.hash WHERE e.duration > {int(SPIKE_RATIO * st.p50_ns)}",
            ]
        chains.append(
            ctx.chain(
                cid=ctx.chain_id("periodic", "", st.name),
                detected_at=int(starts[-1]),
                severity=sev,
                summary=summary,
                root_cause=root,
                explanation=(
                    f"{int(spikes.sum())} of {st.count} {st.name} calls took ≥ {SPIKE_RATIO:.0f}x p50 "
                    f"({fmt_ns(st.p50_ns)}), in {starts.size} bursts {short_ns(mean)} apart (variation {100 * cv:.0f}%), "
                    f"{every}. The regular period and the absence of host evidence point to the program's own "
                    f"schedule rather than interference. Spikes cost {short_ns(excess)} ({100 * share:.1f}% of the time)."
                ),
                recommendations=recs,
                family="periodic",
                evidence={
                    "rule": "periodic",
                    "op": st.name,
                    "spikes": int(spikes.sum()),
                    "bursts": int(starts.size),
                    "period_ms": round(mean / 1e6, 1),
                    "period_cv": round(cv, 3),
                    "iterations_between": round(per, 1),
                    "iteration_unit": unit,
                    "excess_ms": round(excess / 1e6, 1),
                    "score": round(share, 4),
                },
                timeline=[
                    TimelineEntry(
                        layer_of(st.source),
                        st.name,
                        f"{starts.size} spikes {every}, worst {fmt_ns(st.max_ns)} ({st.max_ns / st.p50_ns:.0f}x p50={fmt_ns(st.p50_ns)})",
                        round(st.max_ns / 1000),
                    )
                ],
                st=st,
            )
        )
    return chains


def _marker(ctx: Context, st: OpStats) -> tuple[np.ndarray, str]:
    """Timestamps of the op that marks iterations (the busiest sync op), and the word for them."""
    best: OpStats | None = None
    for o in ctx.ops:
        if (o.source, o.op) in SYNC_OPS and (best is None or o.count > best.count):
            best = o
    if best is None or best.count < st.count / 10:
        return ctx.rows(st).ts_ns, "calls"
    return ctx.rows(best).ts_ns, "iterations"
