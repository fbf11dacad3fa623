"""GPU idle / starvation: what the GPU thread did between its GPU calls.

The gaps between one thread's GPU calls are where the GPU runs out of queued work. Each gap of at least
:data:`GAP_NS` is classified by the thread's own intervals in it (:mod:`ingero.explain.offcpu`):

* asleep until a **forked child** woke it (``sched_wakeup`` arg0 = the waker's tgid is a process the GPU
  process forked) — the classic DataLoader input starvation: the trainer waits for its workers' batches;
  a single long wait right after a fork is *waiting on a child* (compile, checkpoint writer);
* asleep and woken by anything else (a timer: ``usleep``, the disk, a peer) — waiting, said as context;
* on-CPU (the gap minus its off-CPU time) — the process's own host code (Python overhead);
* preempted — counted by the CPU-contention rules, not here.

A chain is made only when waiting on forked workers loses real time (severity from the time lost, as
everywhere). Workers oversubscribing the cores (forked workers ≥ cores) is said with it.
"""

from __future__ import annotations

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context
from ingero.explain.frame import I64
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, IOWAIT, VOL
from ingero.store.catalog import op_id
from ingero.timeutil import NS_PER_MS, NS_PER_S, fmt_duration, fmt_ts

PROCESS_FORK = op_id("process_fork")  # pid = parent, arg1 = child
GAP_NS = NS_PER_MS  # gaps shorter than this are the launch loop itself
MIN_SHARE = 0.05  # of the thread's wall time spent waiting on workers before it is a finding
CHILD_WAIT_NS = NS_PER_S  # one wait this long right after a fork: waiting on a child
IO_SHARE = 0.2  # of wall time asleep in D state between GPU calls: the loop waits on the disk


def _gaps(ts: I64, dur: I64) -> tuple[I64, I64]:
    order = np.argsort(ts, kind="stable")
    ts, end = ts[order], ts[order] + dur[order]
    reach = np.maximum.accumulate(end)
    a, b = reach[:-1], ts[1:]
    keep = (b - a) >= GAP_NS
    return a[keep], b[keep]


def _children(ctx: Context, pid: int) -> tuple[set[int], dict[int, int]]:
    """Processes forked by ``pid`` (transitively), with the time each was forked."""
    a = ctx.frame.args
    m = a.is_op(PROCESS_FORK)
    parent, child, ts = a.pid[m].tolist(), a.arg1[m].tolist(), a.ts_ns[m].tolist()
    kids: dict[int, int] = {}
    frontier = {pid}
    while frontier:
        new = {c: t for p, c, t in zip(parent, child, ts, strict=True) if p in frontier and c not in kids and c != pid}
        kids.update(new)
        frontier = set(new)
    return set(kids), kids


def starvation_chains(ctx: Context) -> list[Chain]:
    chains: list[Chain] = []
    gpu = ctx.gpu
    if gpu.size == 0 or not ctx.off.has_state:
        return chains
    for pid in gpu.pids.tolist():
        m = gpu.pid == pid
        tids, counts = np.unique(gpu.tid[m], return_counts=True)
        tid = int(tids[np.argmax(counts)])  # the thread that drives the GPU
        k = m & (gpu.tid == tid)
        if int(k.sum()) < 10:
            continue
        a, b = _gaps(gpu.ts_ns[k], gpu.dur[k])
        if a.size == 0:
            continue
        wall = max(1, int(gpu.ts_ns[k].max() + gpu.dur[k][np.argmax(gpu.ts_ns[k])] - gpu.ts_ns[k].min()))
        t_arr = np.full(a.size, tid, dtype=np.int64)
        idle = int((b - a).sum())
        vol_by = ctx.off.by_who(VOL, t_arr, a, b)
        inv = int(ctx.off.covered(INVOL, t_arr, a, b).sum())
        vol = sum(vol_by.values())
        kids, forked_at = _children(ctx, int(pid))
        on_workers = {w: ns for w, ns in vol_by.items() if w in kids}
        waited = sum(on_workers.values())
        cores = _cores(ctx)
        if cores is not None and len(kids) >= cores:
            ctx.notes.append(
                f"{ctx.node}: {ctx.proc(int(pid))} forked {len(kids)} processes on {cores} cores: its workers "
                "oversubscribe the CPU (self-inflicted contention: use fewer workers than cores)"
            )
        iowait = int(ctx.off.covered(IOWAIT, t_arr, a, b).sum())
        if (not kids or waited < MIN_SHARE * wall) and iowait >= IO_SHARE * wall:
            chains.append(_io_chain(ctx, int(pid), tid, a, b, iowait, idle, wall))
            continue
        if not kids or waited < MIN_SHARE * wall:
            continue
        sev = cz.severity_of_loss(waited, wall)
        if sev == "LOW" and waited < 0.2 * wall:
            continue
        oncpu = max(0, idle - vol - inv)
        workers = sorted(on_workers, key=lambda w: -on_workers[w])
        shown = ", ".join(ctx.proc(w) for w in workers[:4]) + (", ..." if len(workers) > 4 else "")
        longest = _longest_child_wait(ctx, tid, a, b, kids)
        child_wait = (
            longest is not None
            and longest[1] >= CHILD_WAIT_NS
            and longest[1] >= 0.5 * waited
            and 0 <= longest[2] - forked_at.get(longest[0], longest[2] + 1) <= CHILD_WAIT_NS
        )
        n_kids = len(kids)
        over = cores is not None and n_kids >= cores
        share = waited / wall
        if child_wait and longest is not None:
            who, ns, at = longest
            summary = (
                f"GPU idle {fmt_duration(round(ns / NS_PER_MS) * NS_PER_MS)} waiting on child {ctx.proc(who)} "
                f"right after it was forked"
            )
            root = (
                f"waiting on a child process — the GPU thread of {ctx.proc(int(pid))} slept "
                f"{fmt_duration(round(ns / NS_PER_MS) * NS_PER_MS)} at {fmt_ts(at)} until {ctx.proc(who)} woke it "
                "(a compile step, a checkpoint writer, a subprocess the loop waits for)"
            )
            recs = [
                "Make the child's work asynchronous (async checkpointing, background compilation) or move it "
                "off the training loop's critical path",
                "Cache compiled artifacts (TORCHINDUCTOR_CACHE_DIR, CUDA_CACHE_PATH) so restarts do not recompile",
            ]
            family = "idle/child"
        else:
            summary = (
                f"input starvation: GPU thread blocked {100 * share:.0f}% of wall time waiting for "
                f"{len(workers)} forked worker(s) ({fmt_duration(round(waited / NS_PER_MS) * NS_PER_MS)})"
            )
            root = (
                f"input pipeline starvation — between its GPU calls the thread driving the GPU "
                f"({ctx.proc(int(pid))}) slept {100 * share:.0f}% of its wall time until a forked worker "
                f"woke it ({shown}): the workers do not produce batches as fast as the GPU consumes them"
            )
            recs = [
                "Raise DataLoader num_workers (up to the free cores) and prefetch_factor; "
                "set persistent_workers=True so workers are not re-forked every epoch",
                "Make each sample cheaper: decode/augment on the GPU (DALI, torchvision.transforms.v2 on cuda), "
                "pre-process the dataset once, read from local NVMe or /dev/shm",
                "pin_memory=True so batches are copied to the GPU asynchronously",
            ]
            family = "idle/input"
        if over:
            recs.insert(
                0,
                f"{n_kids} forked workers on {cores} cores oversubscribe the CPU: the workers and the trainer "
                "preempt each other — use fewer workers than cores",
            )
        tl = [
            TimelineEntry("HOST", "process_fork", f"{n_kids} child process(es) forked by {ctx.proc(int(pid))}"),
            TimelineEntry(
                "HOST",
                "sched_wakeup",
                f"GPU thread asleep {fmt_duration(round(waited / NS_PER_MS) * NS_PER_MS)} until woken by its "
                f"workers ({shown})",
                waited // 1000,
            ),
            TimelineEntry(
                "CUDA",
                "idle",
                f"{a.size} gaps between GPU calls, {fmt_duration(round(idle / NS_PER_MS) * NS_PER_MS)} idle "
                f"({100 * idle / wall:.0f}% of wall time)",
                idle // 1000,
            ),
        ]
        chains.append(
            ctx.chain(
                cid=ctx.chain_id(family.replace("/", "-"), f"pid{int(pid)}" if ctx.pid is None else ""),
                detected_at=int(b.max()),
                severity=sev,
                summary=summary,
                root_cause=root,
                explanation=(
                    f"The thread that drives the GPU ({ctx.proc(int(pid))}, tid {tid}) left {a.size} gaps of ≥ 1 ms "
                    f"between its GPU calls, {100 * idle / wall:.0f}% of its {fmt_duration(round(wall / NS_PER_MS) * NS_PER_MS)}. "
                    f"In them it was asleep until a forked worker woke it for "
                    f"{fmt_duration(round(waited / NS_PER_MS) * NS_PER_MS)}, asleep otherwise for "
                    f"{fmt_duration(round((vol - waited) / NS_PER_MS) * NS_PER_MS)}, preempted for "
                    f"{fmt_duration(round(inv / NS_PER_MS) * NS_PER_MS)}, and running its own host code for "
                    f"{fmt_duration(round(oncpu / NS_PER_MS) * NS_PER_MS)}. While it waits no work is queued, so the "
                    "GPU sits idle: this is time lost, not contention."
                ),
                recommendations=recs,
                family=family,
                evidence={
                    "rule": "starvation",
                    "pid": int(pid),
                    "tid": tid,
                    "gaps": int(a.size),
                    "idle_ms": round(idle / 1e6, 1),
                    "waited_on_workers_ms": round(waited / 1e6, 1),
                    "asleep_other_ms": round((vol - waited) / 1e6, 1),
                    "preempted_ms": round(inv / 1e6, 1),
                    "host_code_ms": round(oncpu / 1e6, 1),
                    "wall_ms": round(wall / 1e6, 1),
                    "lost_ms": round(waited / 1e6, 1),
                    "lost_share": round(share, 4),
                    "workers": workers,
                    "forked": sorted(kids),
                    "cores": cores,
                    "score": round(share, 4),
                },
                timeline=tl,
            )
        )
    return chains


def _longest_child_wait(ctx: Context, tid: int, a: I64, b: I64, kids: set[int]) -> tuple[int, int, int] | None:
    """(waker, ns, start) of the thread's longest single sleep in the gaps that a child ended."""
    th = ctx.off.threads[VOL].get(tid)
    if th is None:
        return None
    mine = np.isin(th.who, np.asarray(sorted(kids), dtype=np.int64))
    if not mine.any():
        return None
    s, e, w = th.start[mine], th.end[mine], th.who[mine]
    k = np.searchsorted(b, s, side="left")
    inside = k < b.size
    inside[inside] &= a[k[inside]] <= s[inside]
    if not inside.any():
        return None
    s, e, w = s[inside], np.minimum(e[inside], b[k[inside]]), w[inside]
    i = int(np.argmax(e - s))
    return int(w[i]), int(e[i] - s[i]), int(s[i])


def _cores(ctx: Context) -> int | None:
    cores = ctx.cpu_cores
    return cores if cores and cores > 0 else None


def _io_chain(ctx: Context, pid: int, tid: int, a: I64, b: I64, iowait: int, idle: int, wall: int) -> Chain:
    """The GPU thread waits on disk I/O itself between its GPU calls (uninterruptible sleeps)."""
    share = iowait / wall
    ms = fmt_duration(round(iowait / NS_PER_MS) * NS_PER_MS)
    return ctx.chain(
        cid=ctx.chain_id("idle-io", f"pid{pid}" if ctx.pid is None else ""),
        detected_at=int(b.max()),
        severity=cz.severity_of_loss(iowait, wall),
        summary=f"GPU idle on disk I/O: the GPU thread slept {100 * share:.0f}% of wall time in uninterruptible I/O ({ms})",
        root_cause=(
            f"synchronous disk I/O in the training loop — between its GPU calls the thread driving the GPU "
            f"({ctx.proc(pid)}) waited {ms} in uninterruptible sleep (reading data or writing checkpoints itself)"
        ),
        explanation=(
            f"The GPU thread left {a.size} gaps of ≥ 1 ms between GPU calls "
            f"({fmt_duration(round(idle / NS_PER_MS) * NS_PER_MS)}); {ms} of them it slept in D state, "
            "waiting for the disk. No work is queued meanwhile, so the GPU idles."
        ),
        recommendations=[
            "Load data in DataLoader workers (num_workers > 0) so reads overlap GPU work; keep the dataset on "
            "local NVMe or in /dev/shm",
            "Write checkpoints asynchronously (torch.distributed.checkpoint.async_save) or from a background thread",
        ],
        family="idle/io",
        evidence={
            "rule": "starvation",
            "pid": pid,
            "tid": tid,
            "iowait_ms": round(iowait / 1e6, 1),
            "idle_ms": round(idle / 1e6, 1),
            "lost_ms": round(iowait / 1e6, 1),
            "lost_share": round(share, 4),
            "score": round(share, 4),
        },
        timeline=[
            TimelineEntry(
                "IO", "uninterruptible", f"GPU thread asleep in D state {ms} between GPU calls", iowait // 1000
            ),
            TimelineEntry("CUDA", "idle", f"{a.size} gaps, {100 * idle / wall:.0f}% of wall time", idle // 1000),
        ],
    )
