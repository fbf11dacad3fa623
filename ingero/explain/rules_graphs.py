"""CUDA Graphs (Ingero's source 8): re-capture / re-instantiate churn, and graph launches the host delays.

A graph pays off when it is captured and instantiated once and replayed many times. Two findings:

* **churn** — a process keeps capturing and instantiating (``cudaStreamEndCapture`` /
  ``cudaGraphInstantiate`` all through the window: dynamic shapes, a capture per step, a graph
  rebuilt after every parameter change) with fewer than :data:`MIN_REPLAYS` launches per
  instantiation. Time lost: every capture and instantiation but the first.
* **late launches** — replays should come at a steady period; a launch that comes more than
  :data:`LATE_FACTOR` × the median period after the previous one, when the launching thread spent the
  extra time outside GPU calls (not waiting in a synchronize), was delayed by the host (data loading,
  Python overhead, the CPU taken away). Time lost: the excess over the median period, minus the
  thread's time in GPU calls within that excess. At least :data:`MIN_LATE` late launches.

Severity from time lost (:func:`ingero.explain.causes.severity_of_loss`).
"""

from __future__ import annotations

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context
from ingero.explain.frame import I64, distinct, member
from ingero.explain.model import Chain, TimelineEntry
from ingero.store.catalog import CUDA_GRAPH, lookup_op
from ingero.timeutil import NS_PER_MS, fmt_duration

BEGIN = lookup_op("cudaStreamBeginCapture").op
END = lookup_op("cudaStreamEndCapture").op
INSTANTIATE = lookup_op("cudaGraphInstantiate").op
LAUNCH = lookup_op("cudaGraphLaunch").op
MIN_INSTANTIATIONS = 8
MIN_REPLAYS = 20  # launches per instantiation below this: the graph is not amortised
LATE_FACTOR = 3.0
MIN_LATE = 5
HOST_SHARE = 0.5  # of a late gap's excess spent outside GPU calls: the host delayed it


def graph_chains(ctx: Context) -> list[Chain]:
    fr = ctx.frame
    is_graph = fr.source == CUDA_GRAPH
    if not is_graph.any():
        return []
    pids = ctx.traced if ctx.pid is None else np.asarray([ctx.pid], dtype=np.int64)
    wall = max(1, fr.last_ns - fr.first_ns)
    out: list[Chain] = []
    for pid in distinct(fr.pid[is_graph & member(fr.pid, pids)]).tolist():
        m = is_graph & (fr.pid == pid)
        op, ts, dur, tid = fr.op[m], fr.ts_ns[m], fr.dur[m], fr.tid[m]
        c = _churn(ctx, int(pid), op, ts, dur, wall)
        if c is not None:
            out.append(c)
        c = _late(ctx, int(pid), ts[op == LAUNCH], tid[op == LAUNCH], wall)
        if c is not None:
            out.append(c)
    return out


def _churn(ctx: Context, pid: int, op: I64, ts: I64, dur: I64, wall: int) -> Chain | None:
    inst = int((op == INSTANTIATE).sum())
    launches = int((op == LAUNCH).sum())
    if inst < MIN_INSTANTIATIONS or launches >= MIN_REPLAYS * inst:
        return None
    building = np.isin(op, (BEGIN, END, INSTANTIATE))
    order = np.argsort(ts[building], kind="stable")
    b_ts, b_dur, b_op = ts[building][order], dur[building][order], op[building][order]
    first_inst = int(np.flatnonzero(b_op == INSTANTIATE)[0])
    lost = int(b_dur[first_inst + 1 :].sum())  # every capture and instantiation after the first graph
    words = (
        f"{inst} graph instantiations and {int((op == END).sum())} captures for {launches} launches "
        f"({launches / inst:.1f} per graph); {fmt_duration(round(lost / NS_PER_MS) * NS_PER_MS)} spent rebuilding"
    )
    return ctx.chain(
        cid=ctx.chain_id("graph-churn", f"pid{pid}" if ctx.pid is None else ""),
        detected_at=int(b_ts[-1]),
        severity=cz.severity_of_loss(lost, wall),
        summary=f"CUDA Graph churn: {words}",
        root_cause=(
            f"{ctx.proc(pid)} re-captures and re-instantiates its CUDA graphs instead of replaying them "
            "(shapes that change between steps, a capture per step, a graph rebuilt after a parameter change)"
        ),
        explanation=(
            f"{words}: {100 * lost / wall:.1f}% of wall time. A graph is worth capturing when it is launched many "
            f"times; here each instantiation is launched {launches / inst:.1f} times."
        ),
        recommendations=[
            "Keep shapes static (pad to buckets) so one captured graph is replayed; torch.compile mode="
            "'reduce-overhead' records one graph per shape",
            "Update a graph's parameters with cudaGraphExecUpdate / cudaGraphExecKernelNodeSetParams "
            "instead of capturing it again",
        ],
        family="graph-churn",
        evidence={
            "rule": "graph-churn",
            "pid": pid,
            "instantiations": inst,
            "captures": int((op == END).sum()),
            "launches": launches,
            "rebuild_lost_ms": round(lost / 1e6, 1),
            "lost_share": round(lost / wall, 4),
            "score": round(lost / wall, 4),
        },
        timeline=[TimelineEntry("CUDA", "cudaGraphInstantiate", words, lost // 1000)],
    )


def _late(ctx: Context, pid: int, ts: I64, tid: I64, wall: int) -> Chain | None:
    if ts.size < 2 * MIN_LATE:
        return None
    order = np.argsort(ts, kind="stable")
    ts, tid = ts[order], tid[order]
    gaps = np.diff(ts)
    period = float(np.median(gaps))
    if period <= 0:
        return None
    late = np.flatnonzero(gaps > LATE_FACTOR * period)
    g = ctx.gpu
    own = g.pid == pid
    o = np.argsort(g.ts_ns[own], kind="stable")
    g_ts, g_dur, g_tid = g.ts_ns[own][o], g.dur[own][o], g.tid[own][o]
    longest = int(g_dur.max()) if g_dur.size else 0
    host_lost, n = 0, 0
    for i in late.tolist():
        # the part of the gap beyond one period: GPU calls there (a synchronize) are the GPU's delay
        a, b = int(ts[i]) + round(period), int(ts[i + 1])
        lo, hi = np.searchsorted(g_ts, [a - longest, b])  # the calls that can overlap [a, b]
        w_ts, w_end = g_ts[lo:hi], g_ts[lo:hi] + g_dur[lo:hi]
        same = g_tid[lo:hi] == tid[i + 1]
        inside = np.clip(np.minimum(w_end[same], b) - np.maximum(w_ts[same], a), 0, None).sum()
        excess = b - a
        host = excess - float(inside)
        if host >= HOST_SHARE * excess:
            host_lost += int(host)
            n += 1
    if n < MIN_LATE:
        return None
    words = (
        f"{n} of {ts.size} graph launches came late (more than {LATE_FACTOR:.0f}x the {fmt_duration(round(period))} "
        f"replay period) while the launching thread was outside CUDA calls; "
        f"{fmt_duration(round(host_lost / NS_PER_MS) * NS_PER_MS)} lost between replays"
    )
    return ctx.chain(
        cid=ctx.chain_id("graph-late", f"pid{pid}" if ctx.pid is None else ""),
        detected_at=int(ts[late[-1] + 1]),
        severity=cz.severity_of_loss(host_lost, wall),
        summary=f"CUDA Graph launches delayed by the host: {words}",
        root_cause=(
            f"the host side of {ctx.proc(pid)} does not feed its graph replays in time: between launches the thread "
            "is neither launching nor waiting on the GPU (input pipeline, Python work, or the CPU taken away)"
        ),
        explanation=(
            f"{words}: {100 * host_lost / wall:.1f}% of wall time. Graph replays amortise launch cost only when the "
            "next replay is issued before the GPU drains."
        ),
        recommendations=[
            "Prefetch the next batch (DataLoader workers, pin_memory, non_blocking copies) so the replay is not "
            "waiting for input",
            "Check the host chains for the same process (CPU contention, I/O) in those windows",
        ],
        family="graph-late",
        evidence={
            "rule": "graph-late",
            "pid": pid,
            "late_launches": n,
            "launches": int(ts.size),
            "period_ns": round(period),
            "host_lost_ms": round(host_lost / 1e6, 1),
            "lost_share": round(host_lost / wall, 4),
            "score": round(host_lost / wall, 4),
        },
        timeline=[TimelineEntry("CUDA", "cudaGraphLaunch", words, host_lost // 1000)],
    )
