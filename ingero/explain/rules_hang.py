"""A GPU process that fell silent: it stopped making GPU calls while the recording went on — a hung
rank (stuck on a lock, or waiting forever in a collective a peer never entered) or a stalled job.

After a thread's last GPU call its wall-time ledger ends, so no other rule sees the time that follows.
What shows it is the *silence*: the process's last GPU call ended at ``t``, the node's recording went
on to ``end`` (its last row of any kind), and the process did not exit. The silence is a finding when
it is :data:`SILENCE_GAPS` times the longest gap between two of the process's GPU calls before it (the
job never paused like that while it ran), and it loses ≥ 1 % of the wall time. A short silence (under
5 % of the wall time, LOW) is said with its other reading: the recording may have stopped mid-job,
its last rows being unrelated host activity — which one cannot be told from the rows.

Time lost: the silence, ``end − t``; the wall time runs from the process's first GPU call to ``end``,
so the share is in [0, 1] by construction. Severity from that share, like every other loss. The chain
says what the recording can and cannot tell: that the process stopped, when, and what its threads did
meanwhile (its scheduler rows); not which rank hung first — with NCCL rows, ``ingero explain --nodes``
and the collectives view name the rank that never entered the call the others wait in.
"""

from __future__ import annotations

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, short_ns
from ingero.explain.model import Chain, TimelineEntry
from ingero.store.catalog import op_id
from ingero.timeutil import fmt_ts

SILENCE_GAPS = 5.0  # the silence is this many times the longest gap the process made while it ran
MIN_CALLS = 20  # GPU calls before the silence: a process that ran, not one that just started
PROCESS_EXIT = op_id("process_exit")


def silence(starts: np.ndarray, ends: np.ndarray, end_ns: int) -> tuple[int, int]:
    """(silence ns, longest earlier gap ns) of one process's GPU calls (any order) before ``end_ns``:
    the time from its last call's end to ``end_ns``, and the longest stretch between one call's end
    and the next call's start (both ≥ 0)."""
    if starts.size == 0:
        return 0, 0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    gaps = s[1:] - e[:-1]
    longest = int(max(0, int(gaps.max()))) if gaps.size else 0
    return max(0, int(end_ns - e[-1])), longest


def hang_chains(ctx: Context) -> list[Chain]:
    g, fr = ctx.gpu, ctx.frame
    end = fr.last_ns
    exited = set(fr.pid[fr.is_op(*PROCESS_EXIT)].tolist())
    out: list[Chain] = []
    for pid in g.pids.tolist():
        if pid in exited:
            continue
        m = g.pid == pid
        if int(m.sum()) < MIN_CALLS:
            continue
        starts, ends = g.ts_ns[m], g.ts_ns[m] + np.maximum(g.dur[m], 0)
        quiet, longest = silence(starts, ends, end)
        wall = max(1, end - int(starts.min()))
        lost = min(quiet, wall)
        if lost < SILENCE_GAPS * max(longest, 1) or not cz.worth_a_chain(lost, wall):
            continue
        out.append(_chain(ctx, int(pid), end - quiet, end, lost, wall, longest))
    return out


def _threads_meanwhile(ctx: Context, pid: int, since: int) -> str:
    """What the process's threads did after their last GPU call, from the scheduler rows."""
    fr = ctx.frame
    switch = fr.is_op(*op_id("sched_switch")) & (fr.pid == pid) & (fr.ts_ns > since)
    n = int(switch.sum())
    if n == 0:
        return "no scheduler row of its threads since (asleep, never woken — or spinning on-CPU)"
    return f"{n} scheduler row(s) of its threads since: they still ran, but made no GPU call"


def _chain(ctx: Context, pid: int, last: int, end: int, lost: int, wall: int, longest: int) -> Chain:
    share = lost / wall
    meanwhile = _threads_meanwhile(ctx, pid, last)
    return ctx.chain(
        cid=ctx.chain_id("hang", f"pid{pid}" if ctx.pid is None else ""),
        detected_at=end,
        severity=cz.severity_of_loss(lost, wall),
        summary=(
            f"{ctx.proc(pid)} stopped making GPU calls at {fmt_ts(last)} and stayed silent for {short_ns(lost)} "
            f"while the recording went on ({100 * share:.1f}% of its wall time) — "
            + ("hung or stalled" if share >= cz.MEDIUM_SHARE else "hung, stalled, or the recording stopped mid-job")
        ),
        root_cause=(
            "the GPU process is hung or stalled: no GPU call for far longer than it ever paused while it ran, and it "
            "did not exit (a rank stuck on a lock or in a collective a peer never entered, a deadlock, a dead peer)"
        ),
        explanation=(
            f"Its longest pause between GPU calls while it ran was {short_ns(longest)}; after its last call it was "
            f"silent for {short_ns(lost)} until the recording ended, {100 * share:.1f}% of the {short_ns(wall)} from "
            f"its first GPU call. {meanwhile}. Which rank hung first cannot be told from one node's GPU calls: with "
            "NCCL recorded, the rank that never entered the call its peers wait in is the hung one."
        ),
        recommendations=[
            f"Dump the stacks of the stuck process: py-spy dump --pid {pid} (and gdb -p {pid} -batch -ex 'thread apply "
            "all bt' for native frames)",
            "Compare the ranks: ingero explain --nodes <all> (the collectives view names the rank that never entered "
            "the call); set NCCL_DEBUG=INFO and TORCH_NCCL_ASYNC_ERROR_HANDLING=1 with a collective timeout so a hang "
            "fails loudly",
        ],
        family="hang/silent",
        evidence={
            "rule": "hang",
            "pid": pid,
            "last_gpu_call_ns": last,
            "recording_end_ns": end,
            "silent_ms": round(lost / 1e6, 1),
            "longest_gap_ms": round(longest / 1e6, 1),
            "lost_share": round(share, 4),
            "score": round(share, 4),
        },
        timeline=[
            TimelineEntry("CUDA", "all", f"last GPU call of {ctx.proc(pid)} ends at {fmt_ts(last)}"),
            TimelineEntry("HOST", "sched_switch", meanwhile),
        ],
    )
