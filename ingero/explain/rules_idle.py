"""GPU idle on the thread's own waits: forked workers (input starvation, a child) and the disk.

The figures come from the wall-time ledger (:mod:`ingero.explain.ledger`): ``asleep_workers`` — asleep
between GPU calls until a process the GPU process forked woke it (``sched_wakeup`` arg0 = the waker's
tgid); ``asleep_disk`` — asleep in uninterruptible state (D), usually reading or writing itself. Only
time where the GPU had no work queued counts (:func:`ingero.explain.ledger_gaps.judge_idle`: after a
synchronizing call; after asynchronous launches, what the next sync did not shrink by), so the lost time
is GPU idle time, not overlap. :mod:`ingero.explain.rules_ledger` calls these builders; this module holds their words:

* the classic DataLoader input starvation: the trainer waits for its workers' batches;
* a single long wait right after a fork is *waiting on a child* (compile, checkpoint writer);
* the loop waiting on the disk itself (no workers: reads or checkpoint writes in the loop).

Workers oversubscribing the cores (forked workers ≥ cores) is said with them.
"""

from __future__ import annotations

import numpy as np

from ingero.explain.context import Context
from ingero.explain.frame import I64
from ingero.explain.ledger import ASLEEP_DISK, ASLEEP_WORKERS, LedgerRow, children, describe
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.offcpu import SCHED_WAKEUP, wakeups
from ingero.explain.stats import OpStats
from ingero.timeutil import NS_PER_MS, NS_PER_S, fmt_duration, fmt_ts

CHILD_WAIT_NS = NS_PER_S  # one wait this long right after a fork: waiting on a child


def ms(ns: float) -> str:
    """A duration rounded to the millisecond: 1.234s, 35ms."""
    return fmt_duration(round(ns / NS_PER_MS) * NS_PER_MS)


def _wakers(ctx: Context, row: LedgerRow, kids: set[int]) -> tuple[list[int], tuple[int, int, int] | None]:
    """The forked processes that woke the GPU thread inside its idle gaps, most often first, and the
    longest single sleep a child ended there: (waker, ns, start)."""
    a = ctx.frame.args
    w_tid, w_ts, w_by = wakeups(a)  # either layout; Ingero's rows carry no time since the thread left (0)
    m = (w_tid == row.tid) & np.isin(w_by, np.asarray(sorted(kids), dtype=np.int64))
    ts, by, dur = w_ts[m], w_by[m], a.dur[a.is_op(SCHED_WAKEUP)][m]
    k = np.searchsorted(row.gap_start, ts, side="right") - 1
    inside = (k >= 0) & (ts <= row.gap_end[np.maximum(k, 0)]) if row.gap_start.size else np.zeros(ts.size, bool)
    ts, by, dur, k = ts[inside], by[inside], dur[inside], k[inside]
    if ts.size == 0:
        return [], None
    who, counts = np.unique(by, return_counts=True)
    order = [int(w) for w in who[np.argsort(-counts, kind="stable")]]
    since_gap = ts - row.gap_start[k]
    asleep = np.where(dur > 0, np.minimum(dur, since_gap), since_gap)  # the sleep's part inside its gap
    i = int(np.argmax(asleep))
    return order, (int(by[i]), int(asleep[i]), int(ts[i] - asleep[i]))


def oversubscribed(ctx: Context, pid: int) -> int | None:
    """The cores, when ``pid`` forked at least as many processes as there are (with a note)."""
    cores = ctx.cpu_cores if ctx.cpu_cores and ctx.cpu_cores > 0 else None
    n = len(children(ctx.frame.args, pid))
    if cores is None or n < cores:
        return None
    ctx.notes.append(
        f"{ctx.node}: {ctx.proc(pid)} forked {n} processes on {cores} cores: its workers oversubscribe the CPU "
        "(self-inflicted contention: use fewer workers than cores)"
    )
    return cores


def workers_chain(ctx: Context, row: LedgerRow, severity: str, base: dict[str, object]) -> Chain:
    """Input starvation (or a wait on one child right after its fork) from the ledger's asleep_workers."""
    pid = int(row.pid or 0)
    kids = children(ctx.frame.args, pid)
    waited, wall = row.idle_ns[ASLEEP_WORKERS], row.wall_ns
    share = waited / wall
    workers, longest = _wakers(ctx, row, set(kids))
    shown = ", ".join(ctx.proc(w) for w in workers[:4]) + (", ..." if len(workers) > 4 else "")
    cores = oversubscribed(ctx, pid)
    child_wait = (
        longest is not None
        and longest[1] >= CHILD_WAIT_NS
        and longest[1] >= 0.5 * waited
        and 0 <= longest[2] - kids.get(longest[0], longest[2] + 1) <= CHILD_WAIT_NS
    )
    if child_wait and longest is not None:
        who, ns, at = longest
        summary = f"GPU idle {ms(ns)} waiting on child {ctx.proc(who)} right after it was forked"
        root = (
            f"waiting on a child process — the GPU thread of {ctx.proc(pid)} slept {ms(ns)} at {fmt_ts(at)} until "
            f"{ctx.proc(who)} woke it (a compile step, a checkpoint writer, a subprocess the loop waits for)"
        )
        recs = [
            "Make the child's work asynchronous (async checkpointing, background compilation) or move it off the "
            "training loop's critical path",
            "Cache compiled artifacts (TORCHINDUCTOR_CACHE_DIR, CUDA_CACHE_PATH) so restarts do not recompile",
        ]
        family = "idle/child"
    else:
        summary = (
            f"input starvation: GPU thread blocked {100 * share:.0f}% of wall time waiting for {len(workers) or len(kids)} "
            f"forked worker(s) ({ms(waited)})"
        )
        root = (
            f"input pipeline starvation — between its GPU calls the thread driving the GPU ({ctx.proc(pid)}) slept "
            f"{100 * share:.0f}% of its wall time until a forked worker woke it ({shown or 'its workers'}): the "
            "workers do not produce batches as fast as the GPU consumes them"
        )
        recs = [
            "Raise DataLoader num_workers (up to the free cores) and prefetch_factor; set persistent_workers=True so "
            "workers are not re-forked every epoch",
            "Make each sample cheaper: decode/augment on the GPU (DALI, torchvision.transforms.v2 on cuda), "
            "pre-process the dataset once, read from local NVMe or /dev/shm",
            "pin_memory=True so batches are copied to the GPU asynchronously",
        ]
        family = "idle/input"
    if cores is not None:
        recs.insert(
            0,
            f"{len(kids)} forked workers on {cores} cores oversubscribe the CPU: the workers and the trainer preempt "
            "each other — use fewer workers than cores",
        )
    tl = [
        TimelineEntry("HOST", "process_fork", f"{len(kids)} child process(es) forked by {ctx.proc(pid)}"),
        TimelineEntry(
            "HOST",
            "sched_wakeup",
            f"GPU thread asleep {ms(waited)} until woken by its workers ({shown})",
            waited // 1000,
        ),
    ]
    ev = {
        **base,
        "workers": workers,
        "forked": sorted(kids),
        "cores": cores,
        "waited_on_workers_ms": round(waited / 1e6, 1),
    }
    return ledger_chain(ctx, row, family, summary, root, recs, tl, ev, severity)


def io_chain(ctx: Context, row: LedgerRow, severity: str, base: dict[str, object]) -> Chain:
    """The GPU thread waits on disk I/O itself between its GPU calls (uninterruptible sleeps)."""
    pid = int(row.pid or 0)
    iowait, wall = row.idle_ns[ASLEEP_DISK], row.wall_ns
    share = iowait / wall
    summary = (
        f"GPU idle on disk I/O: the GPU thread slept {100 * share:.0f}% of wall time waiting on the disk ({ms(iowait)})"
    )
    root = (
        f"synchronous disk I/O in the training loop — between its GPU calls the thread driving the GPU "
        f"({ctx.proc(pid)}) slept {ms(iowait)} in uninterruptible I/O or with its own block I/O in flight (reading "
        "data or writing checkpoints itself)"
    )
    recs = [
        "Load data in DataLoader workers (num_workers > 0) so reads overlap GPU work; keep the dataset on local NVMe "
        "or in /dev/shm",
        "Write checkpoints asynchronously (torch.distributed.checkpoint.async_save) or from a background thread",
    ]
    tl = [
        TimelineEntry(
            "IO", "uninterruptible", f"GPU thread asleep on the disk {ms(iowait)} between GPU calls", iowait // 1000
        )
    ]
    return ledger_chain(
        ctx, row, "idle/io", summary, root, recs, tl, {**base, "iowait_ms": round(iowait / 1e6, 1)}, severity
    )


def idle_entry(row: LedgerRow) -> TimelineEntry:
    """The CUDA side of an idle chain: the gaps the GPU idled in and their share of wall time."""
    idle = int(sum(row.idle_ns.values()))
    gaps: I64 = row.gap_end - row.gap_start
    longest = f", longest {ms(int(gaps.max()))}" if gaps.size else ""
    return TimelineEntry(
        "CUDA",
        "idle",
        f"{gaps.size} gaps of ≥ 1 ms the GPU idled in, {ms(idle)} with no GPU work queued "
        f"({100 * idle / max(1, row.wall_ns):.0f}% of wall time{longest})",
        idle // 1000,
    )


def ledger_chain(
    ctx: Context,
    row: LedgerRow,
    family: str,
    summary: str,
    root: str,
    recs: list[str],
    tl: list[TimelineEntry],
    ev: dict[str, object],
    severity: str,
    st: OpStats | None = None,
) -> Chain:
    """A chain of the ledger rule for one GPU thread (its explanation: the thread's ledger line)."""
    return ctx.chain(
        cid=ctx.chain_id(family.replace("/", "-"), f"pid{row.pid}" if ctx.pid is None else ""),
        detected_at=int(row.gap_end.max()) if row.gap_end.size else row.end_ns,
        severity=severity,
        summary=summary,
        root_cause=root,
        explanation=explanation(ctx, row),
        recommendations=recs,
        family=family,
        evidence=ev,
        timeline=[*tl, idle_entry(row)] if st is None else tl,
        st=st,
    )


def explanation(ctx: Context, row: LedgerRow) -> str:
    """Where the GPU thread's wall time went (its ledger line), and what counts as lost."""
    return (
        f"The thread that drives the GPU (tid {row.tid} of {ctx.proc(int(row.pid or 0))}) spent its "
        f"{describe(row)}. Only gaps of ≥ 1 ms where the GPU had no work queued count as GPU idle — after a "
        "synchronizing call (a sync, a blocking copy), or after asynchronous launches for what the next sync "
        "says the queued work did not cover — and only beyond the loop's own turnaround in each gap (its first "
        "millisecond)."
    )
