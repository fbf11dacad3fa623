"""A late rank where the collectives were not recorded (Ingero's layout): told across the nodes.

Without NCCL rows (Ingero 0.9 traces no NCCL) no node shows which collective a rank entered late, and
on the late rank's own node its extra host code is just host code (``idle/host_code``, and at a share
the ledger discounts by the loop's turnaround). What is still recorded is *when* each GPU thread ran
and slept: the ranks advance in lock step, so while one rank runs extra host code before a collective,
every other rank sleeps inside it, waiting.

Per node, each GPU thread's **step gaps** — from the end of each draining call (a sync) to the thread's
next GPU call — with their off-CPU time (any kind) and the host code left, summed up by
:func:`node_steps` into a small :class:`NodeSteps` (bounded: :data:`MAX_GAPS` gaps per thread,
:data:`MAX_THREADS` threads per node): the thread's usual off-CPU time, and only the gaps that can
matter — its long host-code gaps (host code ≥ its median + max(1 ms, 4 robust sigmas):
:func:`ingero.explain.rules_ranks.long_host_code`), and the gaps it slept beyond its usual by at least
:data:`WAIT_FLOOR_NS`. A database with several nodes sums up each one; over the fleet each agent sends
its own (``/api/v1/chains``'s ``steps``) and the client moves it onto one clock
(:meth:`NodeSteps.on_clock`) — either way :func:`late_ranks` judges the same summaries:

* a thread's long host-code gaps are candidates;
* a candidate is **corroborated** when the other nodes' threads slept through it: in their kept gap
  that overlaps it most, off-CPU beyond their own median (0 where no kept gap overlaps: they slept no
  more than :data:`WAIT_FLOOR_NS` beyond their usual) by, on average over the peers, at least half its
  extra host code — the peers waited as long as it ran late (nodes' clocks need agree only within half
  a step; each peer's own arrival jitter averages out);
* the late rank is a thread with at least :data:`~ingero.explain.rules_ranks.MIN_LATE` corroborated
  candidates that did not itself wait in them (its off-CPU there no more than its usual);
* its lost time is ``Σ (host code − median)`` over the corroborated gaps — the time every peer waited
  for it too — never more than its wall time; severity from its share, as for the recorded layout.

The chain names the missing signal (NCCL's collective calls) and how the rank was told instead. The
same thread's ``idle/host_code`` chain of the ledger, which counts part of this time, is folded into it
(one chain per lost time).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import short_ns
from ingero.explain.frame import I64, Frame
from ingero.explain.ledger import DRAINING
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, UNKNOWN, VOL, OffCpu
from ingero.explain.rules_ranks import (
    MIN_COLLECTIVES,
    MIN_LATE,
    MIN_LATE_NS,
    figures,
    long_host_code,
    recommendations,
)
from ingero.store.catalog import NCCL

PEERS_WAITED = 0.5  # the peers waited when their off-CPU beyond their usual is, on average, this share of the extra
WAIT_FLOOR_NS = int(PEERS_WAITED * MIN_LATE_NS) // 2  # a kept wait: beyond the usual by a quarter of the least lateness
MAX_GAPS = 1024  # kept gaps per thread: the long host-code ones first, then the longest waits
MAX_THREADS = 32  # GPU threads per node, the longest-running first (a worst case of ~1.5 MB a node)
_DRAIN_KEYS = np.asarray([s * 256 + o for s, o in DRAINING], dtype=np.int64)
_GAP_FIELDS = ("start", "len", "host", "off", "late")


@dataclass(frozen=True)
class ThreadSteps:
    """One GPU thread's step-gap summary: its usual off-CPU time and the gaps kept, [start, end) on the
    clock the summary is on (the node's own, less ``offset_ns``)."""

    node: str
    pid: int
    tid: int
    name: str | None
    wall_ns: int
    gaps: int  # step gaps in all (kept or not)
    usual_off: int  # median off-CPU time over every gap
    ordinary_off: int  # median off-CPU time over the gaps that are not long host code
    base: float | None  # median host code, where the thread has long host-code gaps
    start: I64
    end: I64
    host: I64
    off: I64
    late: np.ndarray  # bool: a long host-code gap
    truncated: bool = False  # more gaps mattered than MAX_GAPS
    offset_ns: int = 0  # what was taken off the node's own clock

    def as_dict(self) -> dict[str, Any]:
        t0 = int(self.start[0]) if self.start.size else 0
        return {
            "pid": self.pid,
            "tid": self.tid,
            "name": self.name,
            "wall_ns": self.wall_ns,
            "gaps": self.gaps,
            "usual_off_ns": self.usual_off,
            "ordinary_off_ns": self.ordinary_off,
            "base_ns": self.base,
            "truncated": self.truncated,
            "t0_ns": t0,
            "start": (self.start - t0).tolist(),
            "len": (self.end - self.start).tolist(),
            "host": self.host.tolist(),
            "off": self.off.tolist(),
            "late": self.late.astype(np.int64).tolist(),
        }

    @classmethod
    def from_dict(cls, node: str, d: Mapping[str, Any]) -> ThreadSteps:
        """A thread read back from an agent's answer; ValueError/TypeError/KeyError when malformed."""
        cols = {k: np.asarray(d[k], dtype=np.int64).reshape(-1) for k in _GAP_FIELDS}
        if len({c.size for c in cols.values()}) != 1:
            raise ValueError("the step gaps' columns differ in length")
        start = cols["start"] + int(d["t0_ns"])
        base = d.get("base_ns")
        return cls(
            node=node,
            pid=int(d["pid"]),
            tid=int(d["tid"]),
            name=str(d["name"]) if d.get("name") is not None else None,
            wall_ns=int(d["wall_ns"]),
            gaps=int(d["gaps"]),
            usual_off=int(d["usual_off_ns"]),
            ordinary_off=int(d["ordinary_off_ns"]),
            base=float(base) if base is not None else None,
            start=start,
            end=start + cols["len"],
            host=cols["host"],
            off=cols["off"],
            late=cols["late"].astype(bool),
            truncated=bool(d.get("truncated", False)),
        )


@dataclass(frozen=True)
class NodeSteps:
    """A node's step-gap summary: its GPU threads, and whether it recorded NCCL calls (then the
    collectives themselves tell a late rank, and this judge stays out)."""

    node: str
    nccl: bool
    threads: list[ThreadSteps]
    truncated: bool = False  # more GPU threads than MAX_THREADS

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "nccl": self.nccl,
            "truncated": self.truncated,
            "threads": [t.as_dict() for t in self.threads],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], node: str | None = None) -> NodeSteps:
        """Read back (``node`` relabels it: the fleet's label for its agent)."""
        label = node if node is not None else str(d["node"])
        threads = d["threads"]
        if not isinstance(threads, list):
            raise TypeError("'threads' is not a list")
        return cls(label, bool(d["nccl"]), [ThreadSteps.from_dict(label, t) for t in threads], bool(d["truncated"]))

    def on_clock(self, offset_ns: float) -> NodeSteps:
        """The summary on another clock: ``offset_ns`` (> 0: this node's clock is ahead) taken off every time."""
        off = round(offset_ns)
        return replace(
            self,
            threads=[
                replace(t, start=t.start - off, end=t.end - off, offset_ns=t.offset_ns + off) for t in self.threads
            ],
        )


def _gaps(off: OffCpu, g: Frame, m: I64, tid: int) -> tuple[I64, I64, I64, I64, int] | None:
    """A thread's step gaps [a, b), host code and off-CPU time in each, and its wall time (``m``: its
    GPU calls' rows in ``g``, in time order)."""
    s, e = g.ts_ns[m], g.ts_ns[m] + np.maximum(g.dur[m], 0)
    drain = np.flatnonzero(np.isin(g.source[m] * 256 + g.op[m], _DRAIN_KEYS)[:-1])
    if drain.size < MIN_COLLECTIVES:
        return None
    a, b = np.maximum.accumulate(e)[drain], s[drain + 1]
    keep = b > a
    a, b = a[keep], b[keep]
    asleep = np.zeros(a.size, dtype=np.int64)
    for kind in (INVOL, VOL, UNKNOWN):  # off-CPU of any kind
        th = off.threads[kind].get(tid)
        if th is not None:
            asleep += th.covered(a, b)
    return a, b, np.clip(b - a - asleep, 0, None), asleep, int(e.max() - s[0])


def _summary(node: str, pid: int, tid: int, name: str | None, gaps: tuple[I64, I64, I64, I64, int]) -> ThreadSteps:
    """What of a thread's gaps can matter to :func:`late_ranks`, at most MAX_GAPS of them."""
    a, b, host, asleep, wall = gaps
    usual = int(np.median(asleep)) if asleep.size else 0
    found = long_host_code(host)
    late = found[0] if found is not None else np.zeros(a.size, dtype=bool)
    base = found[1] if found is not None else None
    ordinary = int(np.median(asleep[~late])) if (~late).any() else usual
    beyond = asleep - usual
    kept = np.flatnonzero(late | (beyond >= WAIT_FLOOR_NS))
    truncated = kept.size > MAX_GAPS
    if truncated:  # long host code first (the most extra first), then the longest waits
        order = np.lexsort((-np.where(late[kept], host[kept], beyond[kept]), ~late[kept]))
        kept = np.sort(kept[order[:MAX_GAPS]])
    return ThreadSteps(
        node, pid, tid, name, wall, int(a.size), usual, ordinary, base,
        a[kept], b[kept], host[kept], asleep[kept], late[kept], truncated,
    )  # fmt: skip


def node_steps(
    fr: Frame, names: Mapping[int, str], *, gpu: Frame | None = None, off: OffCpu | None = None
) -> NodeSteps:
    """A node's step-gap summary (every GPU thread with enough draining calls; the longest-running
    MAX_THREADS of them). ``gpu`` (its GPU calls) and ``off`` (its off-CPU intervals): where the caller
    already has them."""
    nccl = bool((fr.source == NCCL).any())
    g = gpu if gpu is not None else fr.select(fr.gpu_mask())
    if g.size == 0:
        return NodeSteps(fr.node, nccl, [])
    off = off if off is not None else OffCpu(fr.args)
    thread = g.pid.astype(np.int64) << 32 | g.tid.astype(np.int64)  # one key a thread (ids are < 2^22)
    order = np.lexsort((g.ts_ns, thread))
    cuts = np.flatnonzero(np.diff(thread[order])) + 1
    threads = []
    for m in np.split(order, cuts):
        pid, tid = int(g.pid[m[0]]), int(g.tid[m[0]])
        gaps = _gaps(off, g, m, tid)
        if gaps is not None:
            threads.append(_summary(fr.node, pid, tid, names.get(pid), gaps))
    threads.sort(key=lambda t: -t.wall_ns)
    return NodeSteps(fr.node, nccl, threads[:MAX_THREADS], len(threads) > MAX_THREADS)


def _beyond_usual(peer: ThreadSteps, a: I64, b: I64) -> I64:
    """Per interval [a, b): ``peer``'s off-CPU time beyond its usual in its kept gap that overlaps the
    interval most (0 where none does)."""
    if peer.start.size == 0:
        return np.zeros(a.size, dtype=np.int64)
    k = np.clip(np.searchsorted(peer.start, b, side="left") - 1, 0, peer.start.size - 1)
    best = np.zeros(a.size, dtype=np.int64)
    beyond = np.zeros(a.size, dtype=np.int64)
    for j in (k - 1, k, k + 1):  # the nearest gaps: the one it overlaps most
        jj = np.clip(j, 0, peer.start.size - 1)
        over = np.clip(np.minimum(b, peer.end[jj]) - np.maximum(a, peer.start[jj]), 0, None)
        better = over > best
        best = np.where(better, over, best)
        beyond = np.where(better, peer.off[jj] - peer.usual_off, beyond)
    return beyond


def late_ranks(nodes: Iterable[NodeSteps], chains: list[Chain]) -> list[Chain]:
    """``chains`` with a late-rank chain for each late rank told across ``nodes`` (summaries on one
    clock) without NCCL rows, and the same thread's ``idle/host_code`` chain folded into it."""
    nodes = list(nodes)
    if len({n.node for n in nodes}) < 2 or any(n.nccl for n in nodes):
        return chains
    threads = [t for n in nodes for t in n.threads]
    for t in threads:
        late = t.late
        peers = [p for p in threads if p.node != t.node]
        if t.base is None or int(late.sum()) < MIN_LATE or not peers:
            continue
        extra = t.host[late] - np.int64(t.base)
        waited = np.mean([_beyond_usual(p, t.start[late], t.end[late]) for p in peers], axis=0)
        told = waited >= PEERS_WAITED * extra
        own_wait = t.off[late][told]
        if int(told.sum()) < MIN_LATE or float(np.median(own_wait)) > float(t.ordinary_off):
            continue  # peers did not wait for it, or it waited there too: not the last to arrive
        lost = min(float(extra[told].sum()), float(t.wall_ns))
        if not cz.worth_a_chain(lost, t.wall_ns):
            continue
        folded = [c for c in chains if _same_thread_host_code(c, t)]
        mine = _chain(t, told, lost, folded, len(peers))
        chains = [c for c in chains if c not in folded and c.id != mine.id] + [mine]
    return chains


def _same_thread_host_code(c: Chain, t: ThreadSteps) -> bool:
    return c.node == t.node and c.family == "idle/host_code" and c.evidence.get("tid") in (t.tid, None)


def _chain(t: ThreadSteps, told: np.ndarray, lost: float, folded: list[Chain], n_peers: int) -> Chain:
    base = float(t.base or 0.0)
    share = lost / t.wall_ns
    proc = f"pid {t.pid} ({t.name})" if t.name else f"pid {t.pid}"
    n_told = int(told.sum())
    host_late = t.host[t.late][told]
    words = (
        f"{n_told} times its own host code between GPU steps ran {short_ns(float(np.median(host_late)))} "
        f"(usually {short_ns(base)}) while the other {n_peers} rank(s) slept, waiting"
    )
    ledger_ms = [c.evidence.get("lost_ms") for c in folded]
    return Chain(
        id=f"{t.node}:late-rank-tid{t.tid}",
        node=t.node,
        detected_at=int(t.end[t.late][told].max()) + t.offset_ns,  # on the node's own clock
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
            **({"summary_truncated": True} if t.truncated else {}),
        },
    )
