"""Chains from the wall-time ledger: the largest buckets of lost time, each with its measured cause.

Lost time is the ledger's ``gpu_slow`` and its gap buckets' GPU-idle time (:func:`ingero.explain.ledger_gaps.judge_idle`:
gaps of ≥ 1 ms after a synchronizing call, beyond the loop's turnaround; after asynchronous launches, only
what the next sync says the queued work did not cover). Per GPU thread, each bucket of lost time becomes a chain
when it reaches 1 % of the thread's wall time; severity is its share: HIGH ≥ 20 %, MEDIUM ≥ 5 %, LOW ≥ 1 %.
A chain names a root cause only when one share holds at least half of its lost time (a preemptor, a
slow op, a kind of wait); smaller shares are context.

Not every idle second is somebody's fault:

* ``asleep_timer`` — the thread chose to sleep (``usleep``, a poll timeout): between steps, an eval pause.
  A chain (LOW) only when it is most of the wall time.
* ``asleep_network`` — asleep around the thread's own socket calls. A server idle between requests and
  a loop waiting on a remote call (a tool call, remote data) look the same from the scheduler; the
  calls' connections tell them apart (:mod:`ingero.explain.rules_network`): asleep while a request it
  received is unanswered is lost, graded by its share; between requests, nothing is lost (no chain).
  Where no request is seen, the chain is at most LOW and says both.
* ``asleep_unknown`` and ``offcpu_unknown`` — the cause is not measured (woken by another task; or no
  prev_state, as in Ingero's recordings): the lost time is reported with what the recording can still
  say (children active meanwhile, wakeups and their wakers, the thread's own on-CPU time) and the
  signal that is missing; CPU contention is never guessed. At most LOW — a healthy loop's voluntary
  sleeps look the same without prev_state — except ``offcpu_unknown`` over half the wall time (the GPU
  idle most of the run, whatever the kind): MEDIUM.
* ``not_recorded`` — no chain: a note says what selective storage or a hole hides.
* ``host_code`` — own host code: ``idle/host_code`` for incidents (a gap far beyond the loop's usual
  time), ``idle/host_bound`` where most of it is the loop's own pace (CPU-bound at every step: the fix is
  overlap, fewer syncs, CUDA Graphs, larger batches — there is no incident to find).

``gpu_slow`` makes a chain only for an op no other rule explains (the latency and launch rules name
their cause first; one chain per lost time), and never for NCCL (waiting for peers: ``explain --nodes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ingero.explain import causes as cz
from ingero.explain import rules_idle
from ingero.explain.context import Context
from ingero.explain.ledger import (
    ASLEEP_DISK,
    ASLEEP_NETWORK,
    ASLEEP_TIMER,
    ASLEEP_UNKNOWN,
    ASLEEP_WORKERS,
    GAP_BUCKETS,
    GPU_SLOW,
    HOST_CODE,
    NOT_RECORDED,
    OFFCPU_UNKNOWN,
    PREEMPTED,
    Ledger,
    LedgerRow,
    children,
)
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, UNKNOWN, VOL, wakeups
from ingero.explain.rules_idle import ledger_chain, ms
from ingero.explain.rules_network import network_chain, network_waits
from ingero.store.catalog import op_name
from ingero.timeutil import NS_PER_MS

MIN_CALLS = 10  # a thread with fewer GPU calls is not a GPU loop
MIN_LOST_NS = 10 * NS_PER_MS  # below this, nothing worth a chain whatever the share
DOMINANT = 0.5  # a share that names the root cause
AT_MOST_LOW = frozenset((ASLEEP_NETWORK, ASLEEP_UNKNOWN, OFFCPU_UNKNOWN))
MOSTLY_IDLE = 0.5  # offcpu_unknown: the GPU idle most of the run is MEDIUM whatever the kind (never HIGH)
CHOSEN_SHARE = 0.5  # asleep_timer: a chain only past this share of wall time
STARTUP_SHARE = 0.1  # idle mostly in gaps in this first share of a thread's wall time: its start-up ...
STARTUP_MAX = 0.2  # ... at most LOW unless it takes this share of the run
STARTUP_FAMILIES = ("cold-start", "first-launch", "recompile")
RECORD = (
    "Record with `ingero trace`: it writes each sched_switch's prev_state and the task that ran instead, and "
    "sched_wakeup rows with the waker — this off-CPU time then splits into preempted / asleep on workers, "
    "the disk or the network"
)


def severity(lost: int, wall: int) -> str | None:
    """HIGH ≥ 20 %, MEDIUM ≥ 5 %, LOW ≥ 1 % of the wall time lost; None below."""
    if wall <= 0 or lost < MIN_LOST_NS or not cz.worth_a_chain(lost, wall):
        return None
    return cz.severity_of_loss(lost, wall)  # the one ladder (causes.py)


@dataclass(frozen=True)
class _Run:
    """What the chain builders of one ``ledger_chains`` call share beyond their row (built once per node
    per explain run): the ledger, the ops other rules already explain, and the traced process tree."""

    ledger: Ledger
    explained: set[tuple[str, Any, str]]
    tree: frozenset[int]  # ctx.tree: the GPU processes and what they forked

    def waker(self, ctx: Context, w: int, pid: int) -> str:
        """A waker as the chain may name it: only the traced process tree is named; anything else — the
        agent itself included — is context, never a cause."""
        if w == pid:
            return "its own process"
        return ctx.proc(w) if w in self.tree else "a process outside the traced tree"


def ledger_chains(ctx: Context, ledger: Ledger, prior: list[Chain]) -> list[Chain]:
    """One chain per bucket of lost time of each GPU thread in ``ctx`` (its process with ``ctx.pid``)."""
    run = _Run(ledger, _explained_ops(prior), frozenset(ctx.tree.tolist()))
    cold = any(c.family in STARTUP_FAMILIES and c.node == ctx.node for c in prior)
    out: list[Chain] = []
    for row in ledger.rows:
        if (ctx.pid is not None and row.pid != ctx.pid) or row.calls < MIN_CALLS or row.wall_ns <= 0:
            continue
        for bucket in (GPU_SLOW, *GAP_BUCKETS):
            lost = row.buckets[GPU_SLOW] if bucket == GPU_SLOW else row.idle_ns.get(bucket, 0)
            sev = severity(lost, row.wall_ns)
            if sev is None or bucket == NOT_RECORDED:
                continue
            told = bucket == OFFCPU_UNKNOWN and int(row.tid or 0) in ctx.off.woken  # sleeps taken out by wakeups
            net = network_waits(ctx, row) if bucket == ASLEEP_NETWORK else None
            if net is not None and net.served:  # a server: only its waits inside open requests are lost
                lost = net.in_requests
                sev = severity(lost, row.wall_ns)
                if sev is None:
                    continue  # asleep between requests: a server idle at low load, nothing lost
                told = True
            if bucket in AT_MOST_LOW and not told:
                sev = "MEDIUM" if bucket == OFFCPU_UNKNOWN and lost >= MOSTLY_IDLE * row.wall_ns else "LOW"
            if bucket == ASLEEP_TIMER and lost < CHOSEN_SHARE * row.wall_ns:
                continue
            if bucket != GPU_SLOW and _start_up(row) and lost < STARTUP_MAX * row.wall_ns:
                if cold:
                    continue  # the cold-start chain tells the start-up story
                sev = "LOW"
            drop = _same_drop(prior, ctx.node, row, bucket)
            if drop is not None:  # a throughput drop already names this lost time: one chain, the ledger's figure
                drop.evidence[f"ledger_{bucket}_ms"] = round(lost / 1e6, 1)
                continue
            base = _evidence(row, bucket, lost)
            if bucket == ASLEEP_NETWORK:
                chain: Chain | None = network_chain(ctx, row, sev, base, net)
            else:
                chain = _BUILDERS[bucket](ctx, row, "LOW" if bucket == ASLEEP_TIMER else sev, base, run)
            if chain is not None:
                out.append(chain)
    return out


DROP_CAUSES = {PREEMPTED: ("drop/cpu",), ASLEEP_DISK: ("drop/io",), ASLEEP_NETWORK: ("drop/network",)}


def _same_drop(prior: list[Chain], node: str, row: LedgerRow, bucket: str) -> Chain | None:
    """A throughput-drop chain of the same node and process blaming the same cause as ``bucket``: the
    drop's missing calls are this bucket's gap time, told once."""
    causes = DROP_CAUSES.get(bucket, ())
    return next(
        (
            c
            for c in prior
            if causes and c.node == node and c.family.startswith(causes) and c.evidence.get("pid") in (None, row.pid)
        ),
        None,
    )


def _start_up(row: LedgerRow) -> bool:
    """Most of the thread's idle gap time falls in its first STARTUP_SHARE of wall time (one-off warm-up:
    loading, compiling, first requests)."""
    early = row.gap_start < row.start_ns + STARTUP_SHARE * row.wall_ns
    total = float(row.gap_idle.sum())
    return total > 0 and float(row.gap_idle[early].sum()) >= 0.5 * total


def _explained_ops(chains: list[Chain]) -> set[tuple[str, Any, str]]:
    """(node, pid, op) of the ops other rules already explain (their chain's op, or the ops they list)."""
    out: set[tuple[str, Any, str]] = set()
    for c in chains:
        ops = c.evidence.get("ops")
        names = [c.cuda_op, *(ops if isinstance(ops, dict | list) else [])]
        for n in names:
            if n:
                out |= {(c.node, c.evidence.get("pid"), str(n)), (c.node, None, str(n))}
    return out


def _evidence(row: LedgerRow, bucket: str, lost: int) -> dict[str, Any]:
    return {
        "rule": "ledger",
        "pid": row.pid,
        "tid": row.tid,
        "bucket": bucket,
        "lost_ms": round(lost / 1e6, 1),
        "wall_ms": round(row.wall_ns / 1e6, 1),
        "lost_share": round(lost / row.wall_ns, 4),
        "idle_ms": round(sum(row.idle_ns.values()) / 1e6, 1),
        "gaps": int(row.gap_start.size),
        "ledger": dict(row.buckets),
        "score": round(lost / row.wall_ns, 4),
    }


def _host(ctx: Context, row: LedgerRow, sev: str, base: dict[str, Any], *_: Any) -> Chain:
    lost, pid = row.idle_ns[HOST_CODE], int(row.pid or 0)
    pct = 100 * lost / row.wall_ns
    paced = min(row.paced_ns, lost)
    base = {**base, "paced_ms": round(paced / 1e6, 1), "incidents_ms": round((lost - paced) / 1e6, 1)}
    if paced >= DOMINANT * lost:
        return _host_bound(ctx, row, sev, base, lost, paced)
    return ledger_chain(
        ctx,
        row,
        "idle/host_code",
        f"GPU idle {pct:.0f}% of wall time while its thread ran its own host code ({ms(lost)} between GPU calls)",
        f"CPU-bound host loop — after its synchronizing GPU calls the thread driving the GPU (tid {row.tid} of "
        f"{ctx.proc(pid)}) stayed on-CPU running its own code for {ms(lost)} ({pct:.0f}% of its wall time) before "
        "queueing more GPU work: sampling, detokenising, Python overhead or data preparation in the loop",
        [
            f"Profile the host code between GPU calls: py-spy record --native -p {pid} (or py-spy top) shows where "
            "the time goes",
            "Move detokenising, sampling and post-processing off the critical path (a separate thread or process), "
            "or overlap them with GPU work: queue step N+1 before post-processing step N",
            "Avoid host syncs in the loop (.item(), .cpu(), printing tensors); cut launch overhead with CUDA Graphs "
            "or torch.compile",
        ],
        [TimelineEntry("HOST", "on-CPU", f"own host code {ms(lost)} in the gaps (on-CPU, no GPU call)", lost // 1000)],
        base,
        sev,
    )


def _host_bound(ctx: Context, row: LedgerRow, sev: str, base: dict[str, Any], lost: int, paced: int) -> Chain:
    """Own host code at every step: the loop is CPU-bound, not disturbed (no incident to find)."""
    pid, steps = int(row.pid or 0), max(1, int(row.gap_start.size))
    pct = 100 * lost / row.wall_ns
    return ledger_chain(
        ctx,
        row,
        "idle/host_bound",
        f"GPU idle {pct:.0f}% of wall time waiting for its thread's host code, at every step "
        f"({ms(lost)}, ~{ms(paced // steps)} per step)",
        f"CPU-bound loop — at every step, after its synchronizing GPU call, the thread driving the GPU (tid "
        f"{row.tid} of {ctx.proc(pid)}) runs its own code for ~{ms(paced // steps)} before it queues more GPU work "
        f"(beyond a 1 ms turnaround, over {steps} gaps): the GPU waits for the host {pct:.0f}% of the wall time. "
        "No incident: the loop's own pace (sampling, detokenising, building the next batch, Python overhead)",
        [
            "Overlap host work with GPU work: launch step N+1 asynchronously before post-processing step N "
            "(non_blocking copies, a prefetching DataLoader / next-batch thread), and sync only where a result "
            "is needed",
            "Sync less: drop per-step .item() / .cpu() / printing; keep metrics on the GPU and read them every N steps",
            "Cut the host's per-step cost: CUDA Graphs or torch.compile(mode='reduce-overhead') for launch overhead, "
            "larger batches (fewer steps for the same work)",
            f"Profile the host code between GPU calls: py-spy record --native -p {pid}",
        ],
        [
            TimelineEntry(
                "HOST",
                "on-CPU",
                f"own host code {ms(paced)} across {steps} gaps after syncs (every step)",
                lost // 1000,
            )
        ],
        base,
        sev,
    )


def _preempted(ctx: Context, row: LedgerRow, sev: str, base: dict[str, Any], *_: Any) -> Chain:
    lost, pid = row.idle_ns[PREEMPTED], int(row.pid or 0)
    tids = np.full(row.gap_start.size, int(row.tid or 0), dtype=np.int64)
    by = ctx.off.by_who(INVOL, tids, row.gap_start, row.gap_end)
    total = max(1, sum(by.values()))
    top = sorted(by.items(), key=lambda x: -x[1])
    lead = top[0] if top and top[0][0] not in (0, row.tid) and top[0][1] >= DOMINANT * total else None
    if lead is not None:
        root = (
            f"CPU contention — {ctx.proc(lead[0])} ran in the place of the GPU thread of {ctx.proc(pid)} for "
            f"{ms(lead[1])} ({100 * lead[1] / total:.0f}% of its preempted time between GPU calls)"
        )
    else:
        shown = ", ".join(f"{ctx.proc(w)} {100 * ns / total:.0f}%" for w, ns in top[:3] if w) or "not recorded"
        root = (
            f"CPU contention — the GPU thread of {ctx.proc(pid)} was runnable but off-CPU {ms(lost)} between GPU "
            f"calls; no single task took half of it ({shown})"
        )
    return ledger_chain(
        ctx,
        row,
        "idle/preempted",
        f"GPU idle {100 * lost / row.wall_ns:.0f}% of wall time while its thread was preempted ({ms(lost)})",
        root,
        [cz.PIN, cz.NICE],
        [TimelineEntry("HOST", "preemption", f"runnable, off-CPU {ms(lost)} between GPU calls", lost // 1000)],
        {**base, "preempted_by": {str(w): round(ns / 1e6, 1) for w, ns in top[:5]}},
        sev,
    )


def _sleep(ctx: Context, row: LedgerRow, sev: str, base: dict[str, Any], *_: Any) -> Chain:
    lost = row.idle_ns[ASLEEP_TIMER]
    return ledger_chain(
        ctx,
        row,
        "idle/asleep_timer",
        f"GPU idle {100 * lost / row.wall_ns:.0f}% of wall time while its thread slept on a timer ({ms(lost)})",
        f"the GPU thread of {ctx.proc(int(row.pid or 0))} chose to sleep (a timer woke it: usleep, a poll timeout, "
        "a pause): idle by design — or a polling loop whose interval is too long",
        ["If the loop polls for work, wait on an event or a queue instead of sleeping a fixed interval"],
        [TimelineEntry("HOST", "sleep", f"asleep {ms(lost)} until a timer woke it", lost // 1000)],
        base,
        sev,
    )


def _asleep(ctx: Context, row: LedgerRow, sev: str, base: dict[str, Any], run: _Run) -> Chain:
    lost, pid = row.idle_ns[ASLEEP_UNKNOWN], int(row.pid or 0)
    tids = np.full(row.gap_start.size, int(row.tid or 0), dtype=np.int64)
    by = ctx.off.by_who(VOL, tids, row.gap_start, row.gap_end)
    top = [(w, ns) for w, ns in sorted(by.items(), key=lambda x: -x[1]) if w][:3]
    shown = ", ".join(f"{run.waker(ctx, w, pid)} ({ms(ns)})" for w, ns in top)
    return ledger_chain(
        ctx,
        row,
        "idle/asleep_unknown",
        f"GPU idle {100 * lost / row.wall_ns:.0f}% of wall time while its thread slept, woken by another task ({ms(lost)})",
        f"waiting on another task — the GPU thread of {ctx.proc(pid)} slept {ms(lost)} between GPU calls until "
        f"{shown or 'a task the recording does not name'} woke it (a queue, a lock, another thread's work)",
        ["Find what the loop waits on (py-spy dump --native shows the blocking call) and overlap it with GPU work"],
        [
            TimelineEntry(
                "HOST", "sched_wakeup", f"asleep {ms(lost)}, woken by {shown or 'no recorded wakeup'}", lost // 1000
            )
        ],
        {**base, "wakers": {str(w): round(ns / 1e6, 1) for w, ns in top if w in run.tree}},
        sev,
    )


def _offcpu(ctx: Context, row: LedgerRow, sev: str, base: dict[str, Any], run: _Run) -> Chain:
    lost, pid, tid = row.idle_ns[OFFCPU_UNKNOWN], int(row.pid or 0), int(row.tid or 0)
    pct = 100 * lost / row.wall_ns
    kids = np.asarray(sorted(children(ctx.frame.args, pid)), dtype=np.int64)
    fr = ctx.frame
    k = np.searchsorted(row.gap_start, fr.ts_ns, side="right") - 1
    in_gap = (k >= 0) & (fr.ts_ns <= row.gap_end[np.maximum(k, 0)]) if row.gap_start.size else fr.pid < 0
    kid_rows = in_gap & np.isin(fr.pid, kids)
    active = np.unique(fr.pid[kid_rows])
    w_tid, w_ts, w_by = wakeups(fr.args)
    wk = w_tid == tid
    wk_in = wk.copy()
    if row.gap_start.size:
        j = np.searchsorted(row.gap_start, w_ts[wk], side="right") - 1
        wk_in[wk] = (j >= 0) & (w_ts[wk] <= row.gap_end[np.maximum(j, 0)])
    wakers, counts = np.unique(w_by[wk_in], return_counts=True)
    said = [
        f"own host code {ms(row.idle_ns[HOST_CODE])} in the same gaps (on-CPU)",
        f"{kids.size} child process(es) forked by {ctx.proc(pid)}, {active.size} active in those gaps "
        f"({int(kid_rows.sum())} events)"
        + (": if they feed the GPU thread (DataLoader workers), this may be input starvation" if active.size else ""),
        (
            "wakeups in those gaps: "
            + ", ".join(f"{run.waker(ctx, int(w), pid)} x{int(n)}" for w, n in zip(wakers, counts, strict=True))
            if wakers.size
            else "no sched_wakeup rows: what ended each wait was not recorded"
        ),
    ]
    return ledger_chain(
        ctx,
        row,
        "idle/offcpu_unknown",
        f"GPU idle {pct:.0f}% of the time while its thread was off-CPU (kind unknown)",
        f"not measured — the GPU thread of {ctx.proc(pid)} (tid {tid}) was off-CPU {ms(lost)} between GPU calls, but "
        "the recording has no prev_state on sched_switch (Ingero's layout): preempted, asleep on workers, the disk "
        "or the network cannot be told apart, so no cause is named",
        [RECORD],
        [TimelineEntry("HOST", "context", s) for s in said]
        + [
            TimelineEntry(
                "HOST", "sched_switch", f"off-CPU {ms(lost)} of unknown kind (missing: prev_state)", lost // 1000
            )
        ],
        {
            **base,
            "missing_signal": "prev_state",
            "children_active": [int(p) for p in active[:10]],
            "wakers": {str(int(w)): int(n) for w, n in zip(wakers, counts, strict=True)},
            "host_code_ms": round(row.idle_ns[HOST_CODE] / 1e6, 1),
        },
        sev,
    )


def _slow(ctx: Context, row: LedgerRow, sev: str, base: dict[str, Any], run: _Run) -> Chain | None:
    ops = row.slow_ops()
    lost = row.buckets[GPU_SLOW]
    if not ops or lost <= 0:
        return None
    name, op_ns = ops[0]
    if op_ns < DOMINANT * lost or (ctx.node, row.pid, name) in run.explained or (ctx.node, None, name) in run.explained:
        return None  # no op dominates, or another rule already names this op's cause
    key = next(k for k in row.slow_by_op if op_name(*k) == name)
    g = ctx.gpu
    m = (g.tid == row.tid) & (g.pid == row.pid) & (g.source == key[0]) & (g.op == key[1])
    level = run.ledger.steady.get(key, 0)
    s, e = g.ts_ns[m] + level, g.ts_ns[m] + g.dur[m]
    slow = e > s
    s, e = s[slow], e[slow]
    tids = np.full(s.size, int(row.tid or 0), dtype=np.int64)
    tail = max(1, int((e - s).sum()))
    kinds = {k: int(ctx.off.covered(k, tids, s, e).sum()) for k in (INVOL, VOL, UNKNOWN)}
    kinds["on-CPU"] = max(0, tail - sum(kinds.values()))
    cause, ns = max(kinds.items(), key=lambda x: x[1])
    shares = {k: round(v / tail, 3) for k, v in kinds.items()}
    pct = 100 * lost / row.wall_ns
    if ns < DOMINANT * tail:
        cause = "mixed"
    words = {
        INVOL: ("cpu", "CPU contention — the thread was preempted inside its slow calls", [cz.PIN, cz.NICE]),
        VOL: (
            "gpu",
            "a slower GPU regime — the thread slept inside the calls while the GPU took longer (thermal or power "
            "throttling, heavier work, another process on the GPU)",
            ["Check nvidia-smi -q -d PERFORMANCE,CLOCK for throttle reasons; compare the op's time across nodes"],
        ),
        UNKNOWN: ("offcpu", "not measured — off-CPU inside the calls, of unknown kind (no prev_state)", [RECORD]),
        "on-CPU": (
            "gpu",
            "a slower GPU regime — the thread spun on-CPU inside the calls waiting for the GPU",
            ["Check nvidia-smi -q -d PERFORMANCE,CLOCK for throttle reasons; compare the op's time across nodes"],
        ),
        "mixed": ("mixed", "no single cause holds half of the slow time", []),
    }
    family, root, recs = words[cause]
    context = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items())
    return ledger_chain(
        ctx,
        row,
        f"slow/{family}",
        f"{name} ran beyond its steady level: {ms(lost)} lost ({pct:.0f}% of wall time)",
        f"{root} ({name}, {100 * kinds.get(cause, 0) / tail:.0f}% of its slow time)" if cause != "mixed" else root,
        recs,
        [
            TimelineEntry(
                "CUDA", name, f"{ms(op_ns)} beyond {ms(level)} steady; inside the slow part: {context}", op_ns // 1000
            )
        ],
        {**base, "op": name, "steady_us": round(level / 1000, 1), "inside_slow": shares},
        "LOW" if cause in (UNKNOWN, "mixed") else sev,
        next((o for o in ctx.ops if o.name == name), None),
    )


_BUILDERS: dict[str, Any] = {
    GPU_SLOW: _slow,
    HOST_CODE: _host,
    PREEMPTED: _preempted,
    ASLEEP_WORKERS: lambda ctx, row, sev, base, *_: rules_idle.workers_chain(ctx, row, sev, base),
    ASLEEP_DISK: lambda ctx, row, sev, base, *_: rules_idle.io_chain(ctx, row, sev, base),
    ASLEEP_TIMER: _sleep,
    ASLEEP_UNKNOWN: _asleep,
    OFFCPU_UNKNOWN: _offcpu,
}
