"""First launches per kernel and recompilation, from launches keyed by kernel function.

ingero's tracer records the kernel function pointer in ``arg0`` of ``cudaLaunchKernel`` /
``cuLaunchKernel``. A kernel's first launch is slow for reasons of its own — lazy module loading
(``CUDA_MODULE_LOADING=LAZY``), JIT compilation of PTX — and that is neither contention nor a tail:
the tail rule leaves first launches out (:func:`first_launch_mask`), and this rule says what they cost.
Kernels that first appear well into the run mean new code was generated while training: recompilation
(``torch.compile`` on new shapes, CUDA graph capture, a Triton autotune).

A chain is made when the time lost is worth one (severity from time lost, as everywhere); smaller
costs are a note. First launches are start-up, not an incident: LOW (a note) unless they exceed
:data:`~ingero.explain.causes.STARTUP_SHARE` of the run (:func:`~ingero.explain.causes.startup_severity`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ingero.explain import causes as cz
from ingero.explain.context import Context, OpRows, fmt_ns, layer_of
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.stats import OpStats
from ingero.store.catalog import op_ids
from ingero.timeutil import NS_PER_S, fmt_duration, fmt_ts

Bool = npt.NDArray[np.bool_]
LAUNCH_OPS = op_ids("cudaLaunchKernel", "cuLaunchKernel")
WARMUP_SHARE = 0.2  # kernels first launched after this share of the process's GPU span are "mid-run"
WARMUP_MIN_NS = 5 * NS_PER_S
MIN_NEW = 3  # new kernels mid-run before it is called recompilation


def first_launch_mask(ctx: Context, rows: OpRows) -> npt.NDArray[np.bool_] | None:
    """True for each call that is the first launch of its kernel function in its process."""
    fn = ctx.arg0_of(rows)
    if fn is None or not (fn != 0).all():
        return None
    out = np.zeros(fn.size, dtype=bool)
    for p in np.unique(rows.pid).tolist():
        idx = np.flatnonzero(rows.pid == p)
        idx = idx[np.argsort(rows.ts_ns[idx], kind="stable")]
        _, first = np.unique(fn[idx], return_index=True)
        out[idx[first]] = True
    return out


def _slow_first(ctx: Context, st: OpStats) -> tuple[OpRows, float, npt.NDArray[np.float64], Bool] | None:
    """(rows, steady launch, each call's excess over it, the slow first launches) of a launch op, or None."""
    if (st.source, st.op) not in LAUNCH_OPS or st.count < 10:
        return None
    rows = ctx.rows(st)
    first = first_launch_mask(ctx, rows)
    if first is None or first.all():
        return None
    steady = float(np.median(rows.dur[~first]))
    slow_first = first & (rows.dur >= 10 * steady)
    return (rows, steady, np.clip(rows.dur - steady, 0, None), slow_first) if slow_first.any() else None


def first_launches_chained(ctx: Context, st: OpStats) -> bool:
    """Whether the op's slow first launches take a fifth of the run or more (a first-launch chain of their
    own, beyond start-up): the cold-start rule then leaves them out rather than count them twice."""
    found = _slow_first(ctx, st)
    wall = max(1, ctx.gpu.last_ns - ctx.gpu.first_ns)
    return found is not None and cz.startup_severity(float(found[2][found[3]].sum()), wall) != "LOW"


def first_launch_chains(ctx: Context, notes: list[str]) -> list[Chain]:
    chains: list[Chain] = []
    wall = max(1, ctx.gpu.last_ns - ctx.gpu.first_ns)
    for st in ctx.ops:
        found = _slow_first(ctx, st)
        if found is None:
            continue
        rows, steady, excess, slow_first = found
        start = {int(p): int(rows.ts_ns[rows.pid == p].min()) for p in np.unique(rows.pid).tolist()}
        span = {int(p): int(rows.ts_ns[rows.pid == p].max()) - start[int(p)] for p in start}
        t0 = np.asarray([start[int(p)] for p in rows.pid.tolist()], dtype=np.int64)
        cut = np.asarray([max(WARMUP_MIN_NS, WARMUP_SHARE * span[int(p)]) for p in rows.pid.tolist()])
        late = slow_first & (rows.ts_ns - t0 > cut)
        if int(late.sum()) < MIN_NEW:  # a few late first launches: a rarely used code path, not recompilation
            late = np.zeros_like(late)
        early = slow_first & ~late
        for kind, mask in (("first-launch", early), ("recompile", late)):
            n = int(mask.sum())
            if n == 0:
                continue
            lost = int(excess[mask].sum())
            # first launches are start-up: at most LOW unless they take over a fifth of the run
            sev = cz.startup_severity(lost, wall) if kind == "first-launch" else cz.severity_of_loss(lost, wall)
            what = (
                f"{n} kernels' first launches took {fmt_ns(float(rows.dur[mask].min()))}–{fmt_ns(float(rows.dur[mask].max()))} "
                f"(steady launch {fmt_ns(steady)}), {fmt_duration(round(lost / 1e6) * 10**6)} in all"
            )
            if sev == "LOW":
                notes.append(
                    f"{ctx.node}: {st.name}: {what} — "
                    + (
                        "lazy module loading / JIT on first use, not contention"
                        if kind == "first-launch"
                        else f"new kernels first launched mid-run ({n}): recompilation"
                    )
                )
                continue
            chains.append(_chain(ctx, st, rows, mask, kind, n, lost, sev, what, wall))
    return chains


def _chain(
    ctx: Context,
    stats: OpStats,
    rows: OpRows,
    mask: npt.NDArray[np.bool_],
    kind: str,
    n: int,
    lost: int,
    sev: str,
    what: str,
    wall: int,
) -> Chain:
    ts = rows.ts_ns[mask]
    if kind == "recompile":
        summary = f"recompilation: {n} new kernels first launched mid-run, from {fmt_ts(int(ts.min()))} — {what}"
        root = (
            f"code generated during the run — {n} kernel functions appear for the first time well after start "
            "and each pays lazy loading / JIT again (torch.compile recompiling on new shapes, CUDA graph "
            "capture, Triton autotuning)"
        )
        recs = [
            "Keep shapes static (pad variable-length batches to a few buckets) or mark dynamic dims "
            "(torch._dynamo.mark_dynamic) so torch.compile does not recompile",
            "Check recompiles: TORCH_LOGS=recompiles; raise torch._dynamo.config.cache_size_limit only if needed",
            "Warm up every shape/graph before timing or serving",
        ]
    else:
        summary = f"first launches: {what}"
        root = (
            f"lazy module loading / JIT — each of {n} kernels is loaded (or its PTX compiled) on its first launch; "
            "this is start-up cost, not contention"
        )
        recs = [
            "Warm up before timing or serving: run a few iterations of every code path at start",
            "Ship SASS for the GPU's architecture (TORCH_CUDA_ARCH_LIST) so PTX is not JIT-compiled; keep "
            "CUDA_CACHE_PATH on a persistent disk",
            "CUDA_MODULE_LOADING=EAGER moves the loading to start-up (at a memory cost)",
        ]
    return ctx.chain(
        cid=ctx.chain_id(kind, "", stats.name),
        detected_at=int(ts.max()),
        severity=sev,
        summary=summary,
        root_cause=root,
        explanation=(
            f"Launches are keyed by kernel function (the tracer records it in arg0). {what}; "
            f"{100 * lost / wall:.1f}% of wall time."
        ),
        recommendations=recs,
        family=kind,
        evidence={
            "rule": kind,
            "op": stats.name,
            "kernels": n,
            "lost_ms": round(lost / 1e6, 1),
            "lost_share": round(lost / wall, 4),
            "first_at_ns": int(ts.min()),
            "score": round(lost / wall, 4),
        },
        timeline=[
            TimelineEntry(
                layer_of(stats.source),
                stats.name,
                f"{n} first launches, worst {fmt_ns(float(rows.dur[mask].max()))}",
                round(float(rows.dur[mask].max()) / 1000),
            )
        ],
        st=stats,
    )
