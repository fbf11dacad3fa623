"""A hung rank: a collective some ranks entered and never left, that another rank never entered.

After a thread's last GPU call its wall-time ledger ends, so no per-thread rule sees the time that
follows. A GPU process that stops making GPU calls while the recording goes on is *not* evidence of a
hang by itself: a job that finished looks the same when the recording has no exit rows (Ingero's own
recordings have none: its sample jobs stop their GPU calls 1.2 s, over a third of the recording, before
it ends, and nothing is wrong). What proves a hang is NCCL's call table (``nccl_calls``, ingero's NCCL
tracing): a call recorded as entered and never returned (duration −1).

Across the nodes of the database, per communicator (its cluster-wide id), per call number ``seq``:

* ranks in flight at ``seq`` wait for the others;
* a rank of that communicator whose calls stop before ``seq`` never entered it: the **hung rank** —
  its node gets the chain;
* when every rank is in flight (none missing), the collective itself is stuck (transport, a dead peer
  outside the recording): every waiting rank's node gets a chain.

Time lost on a node: the silence of the rank's process — from the end of its last GPU call to the end
of the node's recording — over its wall time from its first GPU call to that end (a share in [0, 1] by
construction); severity from that share. Without NCCL rows (Ingero's layout) nothing here can tell a
hang from a finished job: no chain (the issue's rule: name the missing signal, never guess the cause).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import short_ns
from ingero.explain.frame import Frame
from ingero.explain.model import Chain, TimelineEntry
from ingero.store.catalog import NCCL, U64, op_name
from ingero.store.nccl import IN_FLIGHT
from ingero.store.window import Window
from ingero.timeutil import fmt_ts


@dataclass(frozen=True)
class Stuck:
    """One communicator's call that some rank never returned from: who waits, who never came."""

    comm_id: int
    seq: int
    op: int
    entered_ns: int  # the first waiting rank's entry
    nranks: int
    waiting: tuple[tuple[str, int, int], ...]  # (node, pid, rank)
    missing: tuple[tuple[str, int, int, int], ...]  # (node, pid, rank, its last seq)


def _tables(conn: sqlite3.Connection) -> bool:
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return {"nccl_calls", "nccl_comms"} <= names


def stuck_calls(conn: sqlite3.Connection, window: Window) -> list[Stuck]:
    """Every in-flight collective of the window, with the ranks that wait in it and those that never
    entered it (their calls on that communicator stop before it)."""
    if not _tables(conn):
        return []
    where, params = window.clause("c.timestamp")
    rows = conn.execute(
        "SELECT m.comm_id, c.seq, c.op, c.timestamp, c.node, c.pid, m.rank, m.nranks FROM nccl_calls c "
        "JOIN nccl_comms m ON m.node = c.node AND m.pid = c.pid AND m.comm = c.comm "
        f"WHERE c.duration = ? AND m.comm_id != 0 AND {where} ORDER BY c.timestamp",
        (IN_FLIGHT, *params),
    ).fetchall()
    out: list[Stuck] = []
    seen: set[tuple[int, int]] = set()
    for comm_id, seq, op, _ts, *_ in rows:
        if (comm_id, seq) in seen:
            continue
        seen.add((comm_id, seq))
        mine = [r for r in rows if r[0] == comm_id and r[1] == seq]
        last = conn.execute(
            "SELECT m.node, m.pid, m.rank, max(c.seq) FROM nccl_comms m JOIN nccl_calls c "
            "ON m.node = c.node AND m.pid = c.pid AND m.comm = c.comm WHERE m.comm_id = ? GROUP BY m.node, m.pid",
            (comm_id,),
        ).fetchall()
        missing = tuple((str(n), int(p), int(r), int(s)) for n, p, r, s in last if s < seq)
        waiting = tuple((str(r[4]), int(r[5]), int(r[6])) for r in mine)
        out.append(Stuck(int(comm_id), int(seq), int(op), int(mine[0][3]), int(mine[0][7]), waiting, missing))
    return out


def silence(frame: Frame, pid: int) -> tuple[int, int, int]:
    """(last GPU call's end, silence until the node's recording ends, wall from the first GPU call to
    that end) of one process on one node (ns; all 0 without GPU calls)."""
    g = frame.gpu_mask() & (frame.pid == pid)
    if not g.any():
        return 0, 0, 0
    end = frame.last_ns
    last = int((frame.ts_ns[g] + np.maximum(frame.dur[g], 0)).max())
    return last, max(0, end - last), max(1, end - int(frame.ts_ns[g].min()))


def hang_chains(conn: sqlite3.Connection, window: Window, frames: dict[str, Frame]) -> list[Chain]:
    """A chain per hung rank (or, when none is missing, per rank stuck in the collective) whose node is
    among ``frames``; its lost time is the process's silence (see the module docstring)."""
    out: list[Chain] = []
    for st in stuck_calls(conn, window):
        blamed = [(n, p, r) for n, p, r, _ in st.missing] or list(st.waiting)
        for node, pid, rank in blamed:
            fr = frames.get(node)
            if fr is None:
                continue
            last, quiet, wall = silence(fr, pid)
            lost = min(quiet, wall)
            if cz.worth_a_chain(lost, wall):
                out.append(_chain(st, node, pid, rank, last, lost, wall, bool(st.missing)))
    return out


def _chain(st: Stuck, node: str, pid: int, rank: int, last: int, lost: int, wall: int, missing: bool) -> Chain:
    name = op_name(NCCL, st.op)
    share = lost / wall
    waiting = ", ".join(f"rank {r} ({n})" for n, _, r in st.waiting[:4])
    comm = f"{st.comm_id & U64:016x}"
    if missing:
        summary = (
            f"hung rank: rank {rank} (pid {pid}) never entered {name} #{st.seq} that {waiting} entered at "
            f"{fmt_ts(st.entered_ns)} and still wait in; its GPU has been silent {short_ns(lost)} "
            f"({100 * share:.1f}% of its wall time)"
        )
        root = (
            f"rank {rank} is hung before collective #{st.seq} of communicator {comm}: the other ranks entered it "
            "and wait forever (a deadlock, a lock, a crash of this rank's host code, or a rank-dependent branch that "
            "skips the collective)"
        )
    else:
        summary = (
            f"stuck collective: {name} #{st.seq} entered by every rank ({waiting}) at {fmt_ts(st.entered_ns)} "
            f"never returned; GPU silent {short_ns(lost)} ({100 * share:.1f}% of the wall time)"
        )
        root = (
            f"collective #{st.seq} of communicator {comm} never completed although all recorded ranks entered it: "
            "the transport (network, NVLink) or a rank outside this recording"
        )
    return Chain(
        id=f"{node}:hang-{comm}-{st.seq}-pid{pid}",
        node=node,
        detected_at=st.entered_ns,
        severity=cz.severity_of_loss(lost, wall),
        summary=summary,
        root_cause=root,
        explanation=(
            f"nccl_calls records {name} #{st.seq} as entered and never returned (duration −1) by "
            f"{len(st.waiting)} of {st.nranks} ranks. Rank {rank}'s last GPU call ended at {fmt_ts(last)}; "
            f"the recording of {node} went on for {short_ns(lost)} more, {100 * share:.1f}% of the "
            f"{short_ns(wall)} since its first GPU call."
        ),
        recommendations=[
            f"Dump the stacks of the stuck rank: py-spy dump --pid {pid} (gdb -p {pid} -batch -ex 'thread apply "
            "all bt' for native frames)",
            "Make hangs fail loudly: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 with a collective timeout, NCCL_DEBUG=INFO; "
            "look for a rank-dependent branch around the collective",
        ],
        timeline=[
            TimelineEntry("NCCL", name, f"#{st.seq} entered by {waiting} at {fmt_ts(st.entered_ns)}, never returned"),
            TimelineEntry("CUDA", "all", f"rank {rank} (pid {pid}): last GPU call ends at {fmt_ts(last)}"),
        ],
        origin="computed",
        family="hang/collective" if missing else "hang/stuck-collective",
        evidence={
            "rule": "hang",
            "node": node,
            "pid": pid,
            "rank": rank,
            "comm": comm,
            "seq": st.seq,
            "waiting_ranks": [r for _, _, r in st.waiting],
            "nranks": st.nranks,
            "silent_ms": round(lost / 1e6, 1),
            "lost_ms": round(lost / 1e6, 1),
            "lost_share": round(share, 4),
            "score": round(share, 4),
        },
    )
