"""A late rank where the collectives were not recorded (Ingero's layout): told across the nodes.

Without NCCL rows (Ingero 0.9 traces no NCCL) no node shows which collective a rank entered late, and
on the late rank's own node its extra host code is just host code (``idle/host_code``, and at a share
the ledger discounts by the loop's turnaround). What is still recorded is *when* each GPU thread ran
and slept: the ranks advance in lock step, so while one rank runs extra host code before a collective,
every other rank sleeps inside it, waiting.

For a database with several nodes, per node's GPU thread, the **step gaps** — from the end of each
draining call (a sync) to the thread's next GPU call — with their off-CPU time (any kind) and the host
code left (:func:`ingero.explain.rules_ranks.long_host_code`):

* a thread's long host-code gaps are candidates (host code ≥ its median + max(1 ms, 4 robust sigmas));
* a candidate is **corroborated** when the other nodes' threads slept through it: in their step gap
  that overlaps it most, off-CPU beyond their own median by, on average over the peers, at least half
  its extra host code — the peers waited as long as it ran late (nodes' clocks need agree only within
  half a step; each peer's own arrival jitter averages out);
* the late rank is a thread with at least :data:`~ingero.explain.rules_ranks.MIN_LATE` corroborated
  candidates that did not itself wait in them (its off-CPU there no more than its usual);
* its lost time is ``Σ (host code − median)`` over the corroborated gaps — the time every peer waited
  for it too — never more than its wall time; severity from its share, as for the recorded layout.

The chain names the missing signal (NCCL's collective calls) and how the rank was told instead. The
same thread's ``idle/host_code`` chain of the ledger, which counts part of this time, is folded into it
(one chain per lost time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import short_ns
from ingero.explain.frame import I64, Frame
from ingero.explain.ledger import DRAINING
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, UNKNOWN, VOL, OffCpu
from ingero.explain.rules_ranks import MIN_COLLECTIVES, MIN_LATE, figures, long_host_code, recommendations
from ingero.store.catalog import NCCL

PEERS_WAITED = 0.5  # the peers waited when their off-CPU beyond their usual is, on average, this share of the extra
_DRAIN_KEYS = np.asarray([s * 256 + o for s, o in DRAINING], dtype=np.int64)


@dataclass(frozen=True)
class StepGaps:
    """One GPU thread's gaps after its draining calls: [start, end), host code and off-CPU in each."""

    node: str
    pid: int
    tid: int
    start: I64
    end: I64
    host: I64
    off: I64
    wall_ns: int


def step_gaps(fr: Frame) -> list[StepGaps]:
    """Every GPU thread of a node with enough draining calls, and its step gaps."""
    g = fr.select(fr.gpu_mask())
    if g.size == 0:
        return []
    off = OffCpu(fr.args)
    out = []
    for pid, tid in {(int(p), int(t)) for p, t in zip(g.pid.tolist(), g.tid.tolist(), strict=True)}:
        m = np.flatnonzero((g.tid == tid) & (g.pid == pid))
        m = m[np.argsort(g.ts_ns[m], kind="stable")]
        s, e = g.ts_ns[m], g.ts_ns[m] + np.maximum(g.dur[m], 0)
        drain = np.flatnonzero(np.isin(g.source[m] * 256 + g.op[m], _DRAIN_KEYS)[:-1])
        if drain.size < MIN_COLLECTIVES:
            continue
        a, b = np.maximum.accumulate(e)[drain], s[drain + 1]
        keep = b > a
        a, b = a[keep], b[keep]
        tids = np.full(a.size, tid, dtype=np.int64)
        asleep = sum(off.covered(kind, tids, a, b) for kind in (INVOL, VOL, UNKNOWN))
        host = np.clip(b - a - asleep, 0, None)
        out.append(StepGaps(fr.node, pid, tid, a, b, host, np.asarray(asleep, dtype=np.int64), int(e.max() - s[0])))
    return out


def _beyond_usual(peer: StepGaps, a: I64, b: I64) -> I64:
    """Per interval [a, b): ``peer``'s off-CPU time beyond its usual in its step gap that overlaps the
    interval most (0 where none does)."""
    usual = np.int64(np.median(peer.off))
    k = np.clip(np.searchsorted(peer.start, b, side="left") - 1, 0, peer.start.size - 1)
    best = np.zeros(a.size, dtype=np.int64)
    beyond = np.zeros(a.size, dtype=np.int64)
    for j in (k - 1, k, k + 1):  # the nearest gaps: the one it overlaps most
        jj = np.clip(j, 0, peer.start.size - 1)
        over = np.clip(np.minimum(b, peer.end[jj]) - np.maximum(a, peer.start[jj]), 0, None)
        better = over > best
        best = np.where(better, over, best)
        beyond = np.where(better, peer.off[jj] - usual, beyond)
    return beyond


def fleet_late_ranks(frames: dict[str, Frame], names: dict[int, str], chains: list[Chain]) -> list[Chain]:
    """``chains`` with a late-rank chain for each late rank told across nodes without NCCL rows (and the
    same thread's ``idle/host_code`` chain folded into it)."""
    if len(frames) < 2 or any(bool((fr.source == NCCL).any()) for fr in frames.values()):
        return chains
    threads = [t for fr in frames.values() for t in step_gaps(fr)]
    for t in threads:
        found = long_host_code(t.host)
        peers = [p for p in threads if p.node != t.node]
        if found is None or not peers:
            continue
        late, base = found
        extra = t.host[late] - np.int64(base)
        waited = np.mean([_beyond_usual(p, t.start[late], t.end[late]) for p in peers], axis=0)
        told = waited >= PEERS_WAITED * extra
        own_wait = t.off[late][told]
        if int(told.sum()) < MIN_LATE or float(np.median(own_wait)) > float(np.median(t.off[~late])):
            continue  # peers did not wait for it, or it waited there too: not the last to arrive
        lost = min(float(extra[told].sum()), float(t.wall_ns))
        if not cz.worth_a_chain(lost, t.wall_ns):
            continue
        folded = [c for c in chains if _same_thread_host_code(c, t)]
        chains = [c for c in chains if c not in folded] + [_chain(t, names, late, told, base, lost, folded, len(peers))]
    return chains


def _same_thread_host_code(c: Chain, t: StepGaps) -> bool:
    return c.node == t.node and c.family == "idle/host_code" and c.evidence.get("tid") in (t.tid, None)


def _chain(
    t: StepGaps,
    names: dict[int, str],
    late: np.ndarray,
    told: np.ndarray,
    base: float,
    lost: float,
    folded: list[Chain],
    n_peers: int,
) -> Chain:
    share = lost / t.wall_ns
    name = names.get(t.pid)
    proc = f"pid {t.pid} ({name})" if name else f"pid {t.pid}"
    n_told = int(told.sum())
    host_late = t.host[late][told]
    words = (
        f"{n_told} times its own host code between GPU steps ran {short_ns(float(np.median(host_late)))} "
        f"(usually {short_ns(base)}) while the other {n_peers} rank(s) slept, waiting"
    )
    ledger_ms = [c.evidence.get("lost_ms") for c in folded]
    return Chain(
        id=f"{t.node}:late-rank-tid{t.tid}",
        node=t.node,
        detected_at=int(t.end[late][told].max()),
        severity=cz.severity_of_loss(lost, t.wall_ns),
        summary=f"late rank: {proc} {words}; {short_ns(lost)} lost ({100 * share:.1f}% of wall time), and every "
        "peer waited as long",
        root_cause=(
            f"{proc} runs extra host code at moments when every other rank sleeps: the ranks advance in lock step, "
            "so they waited for it (it arrived last at the collective) — told across the nodes, since this "
            "recording has no collective calls (missing: NCCL's calls, which ingero trace records)"
        ),
        explanation=(
            f"Between its GPU steps the thread's own host code (the gap after a sync, less its off-CPU time) is "
            f"usually {short_ns(base)}; {n_told} times it ran far longer, {short_ns(lost)} beyond the usual in all "
            f"({100 * share:.1f}% of its wall time), and each time the other ranks' GPU threads were off-CPU, on average, "
            "for about as long in their own step — waiting inside the collective this rank had not entered yet. "
            "Without NCCL rows the collective itself is not seen: record with ingero trace to see each call."
        ),
        recommendations=[
            *recommendations(t.pid),
            "Record with ingero trace: it writes each NCCL call, so the late collectives themselves are seen",
        ],
        timeline=[
            TimelineEntry("HOST", "on-CPU", words, int(lost) // 1000),
            TimelineEntry("HOST", "context", "missing: NCCL collective calls (Ingero's layout)"),
        ],
        family="late-rank",
        evidence={
            "node": t.node,
            "rule": "late-rank-across-nodes",
            "peers": n_peers,
            "missing_signal": "nccl_calls",
            **figures(t.pid, t.tid, n_told, base, lost, share),
            **({"ledger_host_code_ms": ledger_ms[0]} if ledger_ms else {}),
        },
    )
