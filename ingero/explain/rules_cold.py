"""Cold start: a fresh process's first GPU calls pay CUDA initialisation — context creation in its first
call, lazy kernel-module loading and allocator warm-up in each op's first calls.

Per process: each op's first calls (1 %, 3 to 20) against the same op's steady median, named when they
are :data:`COLD_RATIO` x slower and :data:`COLD_GATE` x the steady p95 (an op with big and small calls
must not look cold because its first calls are the big ones) — in median, or each of the first calls
that is, when no later call of the op is as slow (lazy loading of a few kernels leaves the median of
the first calls normal: without this their time went to a slower GPU regime); and the process's very first call when it
created the context (at least :data:`CONTEXT_MIN_NS`). Time lost: their excess over steady. One-off
start-up costs are at most LOW unless they exceed a fifth of the run (:func:`causes.startup_severity`).
"""

from __future__ import annotations

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, short_ns
from ingero.explain.frame import I64
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.rules_events import MIN_CALLS
from ingero.explain.rules_launch import first_launches_chained
from ingero.store.catalog import op_name
from ingero.timeutil import NS_PER_MS, fmt_ts

COLD_RATIO = 20.0
COLD_GATE = 10.0
CONTEXT_MIN_NS = 10 * NS_PER_MS  # a first call this long created the CUDA context


def _context_creation(src: I64, op: I64, dur: I64, ts: I64, counted: set[str]) -> tuple[str, float, float] | None:
    """The process's first GPU call when it created the CUDA context (op, x its op's later median, excess
    ns): at least CONTEXT_MIN_NS and COLD_GATE x the p95 of the op's later calls, if any; its excess over
    their median (all of it without later calls). None when its op's cold calls are counted already."""
    if ts.size == 0:
        return None
    i = int(np.argmin(ts))
    s, o, d = int(src[i]), int(op[i]), float(dur[i])
    name = op_name(s, o)
    if name in counted or d < CONTEXT_MIN_NS:
        return None
    later = dur[(src == s) & (op == o) & (ts > ts[i])]
    if later.size and d < COLD_GATE * float(np.percentile(later, 95)):
        return None
    base = float(np.median(later)) if later.size else 0.0
    return name, d / base if base > 0 else 0.0, d - base  # 0: no later call to compare with


def _told_as_first_launches(ctx: Context, s: int, o: int) -> bool:
    """The op's slow calls are kernels' first launches with a first-launch chain of their own (over a fifth
    of the run): told there, not counted twice."""
    st = next((x for x in ctx.ops if (x.source, x.op) == (s, o)), None)
    return st is not None and first_launches_chained(ctx, st)


def _cold_calls(d: I64, wall: int) -> tuple[float, float] | None:
    """(x steady, excess ns) of one op's first calls (durations in time order) when they are cold: their
    median COLD_RATIO x the steady median and COLD_GATE x the steady p95 (an op with two kinds of calls,
    big and small copies, must not look cold because its first calls happen to be the big ones); else
    the first calls that are each that slow, when no later call is (lazy loading of a few kernels: 4
    slow launches in 20 leave the median normal), when their excess is worth a chain of the ``wall`` time
    (a few ordinary first launches are no finding). None when neither."""
    n_cold = int(min(20, max(3, np.ceil(d.size * 0.01))))
    first, rest = d[:n_cold], d[max(n_cold, d.size // 10) :]
    steady = float(np.median(rest))
    if steady <= 0:
        return None
    gate = float(np.percentile(rest, 95))
    cold = float(np.median(first))
    if cold >= COLD_RATIO * steady and cold >= COLD_GATE * gate:
        return cold / steady, float(np.clip(first - steady, 0, None).sum())
    bar = max(COLD_RATIO * steady, COLD_GATE * gate)
    out = first >= bar
    if not out.any() or bool((d[n_cold:] >= bar).any()):  # one as slow later: not start-up
        return None
    excess = float((first[out] - steady).sum())
    return (float(np.median(first[out])) / steady, excess) if cz.worth_a_chain(excess, wall) else None


def cold_start_chains(ctx: Context) -> list[Chain]:
    gpu = ctx.gpu
    wall = max(1, gpu.last_ns - gpu.first_ns)
    found: list[tuple[int, list[tuple[str, float, float]], float, int]] = []  # pid, [(op, ratio, excess)], total, t
    for pid in gpu.pids:
        m = gpu.pid == pid if gpu.pids.size > 1 else slice(None)  # one GPU process: no copies
        src, op, dur, ts = gpu.source[m], gpu.op[m], gpu.dur[m], gpu.ts_ns[m]
        ops: list[tuple[str, float, float]] = []
        keys = np.flatnonzero(np.bincount(src * 256 + op)) if src.size else np.zeros(0, dtype=np.int64)
        for key in keys.tolist():  # the ops of the process (small ids: a count, not a sort)
            s, o = divmod(int(key), 256)
            if gpu.pids.size > 1:
                k = (src == s) & (op == o)
                ts_k, dur_k = ts[k], dur[k]
            else:  # one GPU process: the context's calls of the op, grouped once for every rule
                ts_k, dur_k = ctx.op_calls(s, o)[:2]
            if dur_k.size < 2 * MIN_CALLS:
                continue
            cold_op = _cold_calls(dur_k[np.argsort(ts_k, kind="stable")], wall)
            if cold_op is not None and not _told_as_first_launches(ctx, s, o):
                ops.append((op_name(s, o), *cold_op))
        ctx_op = _context_creation(src, op, dur, ts, {n for n, _, _ in ops})
        if ctx_op is not None:
            ops.append(ctx_op)
        if ops:
            ops.sort(key=lambda x: x[2], reverse=True)
            found.append((int(pid), ops, sum(x[2] for x in ops), int(ts.min())))
    if not found:
        return []
    span = max(1, ctx.gpu.last_ns - ctx.gpu.first_ns)
    total = sum(f[2] for f in found)
    ratios = [r for f in found for _, r, _ in f[1] if r > 0] or [0.0]
    lo, hi = min(ratios), max(ratios)
    worst = max((x for f in found for x in f[1]), key=lambda x: x[2])
    per_op: dict[str, float] = {}
    for f in found:
        for name, r, _ in f[1]:
            if r > 0:
                per_op[name] = max(per_op.get(name, 0.0), r)
    top = ", ".join(f"{n} {r:.0f}x" for n, r in sorted(per_op.items(), key=lambda x: -x[1])[:3])
    times = f"{lo:.0f}x" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}x"
    # only a context creation with no later call of its op to compare with: no ratio to show
    what = (
        f"{times} slower than steady state ({top})" if per_op else f"took {short_ns(total)} creating the CUDA context"
    )
    share = total / span
    sev = cz.startup_severity(total, span)  # start-up is not an incident unless it takes over a fifth of the run
    starts = len(found)
    tl = [TimelineEntry("HOST", "process_exec", f"{ctx.proc(p)} starts at {fmt_ts(t)}") for p, _, _, t in found[:3]]
    tl += [
        TimelineEntry("CUDA", n, f"first calls {r:.0f}x slower than steady state") for n, r in list(per_op.items())[:3]
    ]
    st = next((s for s in ctx.ops if s.name == worst[0]), None)
    return [
        ctx.chain(
            cid=ctx.chain_id("cold-start"),
            detected_at=max(f[3] for f in found),
            severity=sev,
            summary=f"cold start: first CUDA calls {what}" + (f" — {starts} process starts" if starts > 1 else ""),
            root_cause=(
                "CUDA initialisation on process start — context creation, lazy kernel-module loading and allocator "
                + (
                    f"warm-up make each process's first calls {times} slower"
                    if per_op
                    else f"warm-up: its first call {what}"
                )
                + (f"; {starts} processes started in this window and each paid it" if starts > 1 else "")
            ),
            explanation=(
                f"{starts} process(es) made their first GPU calls in this window. Their first calls "
                f"{what if not per_op else f'took {times} the time of the same calls later ({top})'}; together that is "
                f"{short_ns(total)} "
                f"({100 * share:.1f}% of the window) before the processes reached steady state."
            ),
            recommendations=[
                "Warm up before timing or serving: run a few dummy iterations (and torch.cuda.synchronize()) at start",
                "Keep the CUDA context alive: reuse worker processes instead of restarting them per job/request",
                "Enable GPU persistence mode (nvidia-smi -pm 1) so the driver stays initialised between processes",
                "Keep CUDA_MODULE_LOADING=LAZY (default since CUDA 12.2); for torch.compile cache compiled kernels",
            ],
            family="cold-start",
            evidence={
                "rule": "cold-start",
                "processes": [p for p, _, _, _ in found],
                "ratio_min": round(lo, 1),
                "ratio_max": round(hi, 1),
                "ops": {n: round(r, 1) for n, r in per_op.items()},
                "excess_ms": round(total / 1e6, 1),
                "score": round(share, 4),
            },
            timeline=tl,
            st=st,
        )
    ]
