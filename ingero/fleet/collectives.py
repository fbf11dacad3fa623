"""Which rank drags the job: the k-th call of each NCCL communicator joined across ranks (numpy).

Input: every node's ``GET /api/v1/collectives`` arrays (:class:`NodeCalls`) and its measured clock
offset with its ± uncertainty (:mod:`ingero.fleet.skew`). A communicator is named cluster-wide by the
splitmix64 fold of its 128-byte ``ncclUniqueId`` (the tracer's ``comm_id``); a call by
``(comm_id, seq)`` — ``seq`` is the k-th call on that communicator in the rank's process.

The join, per call with every rank present:

* entry times are put on this host's clock (``entry − offset``), each carrying its node's ± uncertainty;
* each rank waited ``last arrival − own arrival``; the last rank's *lag* is how much later it came than
  the latest of the others (the time every other rank waited at least);
* the call's *transfer* is ``first completion − last arrival``: the collective's own work once everyone
  is in.

The verdict (:func:`analyze`), in order:

* **hung** — a call some ranks entered and never left (duration −1) that another rank never entered;
* **straggler** — one rank arrives last far more often than chance (binomial z ≥ 4, at least half the
  calls), its median lag is beyond the clock uncertainty, and the others' waiting is not negligible
  (≥ 1 % of their time);
* **inconclusive** — the same, but the median lag is within the clock uncertainty;
* **slow collective** — nobody waits much, but the transfers take a large share of the time: the
  network / NVLink, named with the bytes and the bandwidth reached;
* **no straggler** — otherwise.

Calls missing some rank (a node restarted, a rank outside the window) are counted as incomplete and
left out. A rank whose ``seq`` restarts (its agent restarted: the counter lives in the tracer) or
started late (its agent came up after the others') is re-based segment by segment onto the
communicator's longest segment by matching completion times, which synchronising collectives share
across ranks; clock offsets are trusted within their stated uncertainty for that (an unknown error
beyond half a step would read as a shifted counter).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ingero.fleet.collective_model import (
    KINDS,
    CollectiveVerdict,
    CommSummary,
    NodeCalls,
    RankRow,
    comm_hex,
    fmt_bytes,
    fmt_ms,
    fmt_secs,
)
from ingero.store.catalog import NCCL, lookup_op, op_name

MIN_Z = 4.0  # binomial z-score of "last" counts against chance (1 / nranks)
MIN_LAST_SHARE = 0.5  # the straggler is last in at least half the calls
MIN_WAIT_SHARE = 0.01  # peers' waiting must be at least 1 % of their time to name anyone
CLOCK_SLACK_NS = 1e6  # a wait may exceed the rank's own call time by this much (plus the clocks' ±) before the clocks are said to disagree
SLOW_TRANSFER_SHARE = 0.25  # transfers taking a quarter of the time: the collective itself is slow
UNCERTAINTY_FACTOR = 1.0  # lag must exceed this many times the combined clock uncertainty
COLLECTIVE_OPS_MAX = lookup_op("ncclReduceScatter").op  # NCCL ops 1..5 are collectives; 6, 7 send/recv


@dataclass
class _Flat:
    """Every node's calls concatenated; ``part`` indexes participants (node, comm, rank)."""

    comm: np.ndarray
    seq: np.ndarray
    op: np.ndarray
    nbytes: np.ndarray
    entry: np.ndarray  # float64 ns, on this host's clock
    duration: np.ndarray
    unc: np.ndarray  # float64 ns, the node's ± clock uncertainty
    node: np.ndarray  # index into nodes
    rank: np.ndarray
    nodes: list[NodeCalls]


def _collectives_only(n: NodeCalls) -> NodeCalls:
    """Send/recv are numbered apart from collectives and differ rank by rank: only collectives join."""
    sel = n.op <= COLLECTIVE_OPS_MAX
    if bool(sel.all()):
        return n
    return NodeCalls(
        n.node, n.comm[sel], n.seq[sel], n.op[sel], n.bytes[sel], n.entry_ns[sel], n.duration_ns[sel], n.rank[sel],
        n.nranks, n.offset_ns, n.uncertainty_ns, n.gpu_model,
    )  # fmt: skip


def _flatten(nodes: Sequence[NodeCalls]) -> _Flat:
    keep = [c for c in (_collectives_only(n) for n in nodes) if len(c)]

    def cat(name: str, dtype: Any) -> np.ndarray:
        if not keep:
            return np.zeros(0, dtype=dtype)
        return np.concatenate([np.asarray(getattr(n, name), dtype=dtype) for n in keep])

    entry = np.concatenate([n.entry_ns.astype(np.float64) - n.offset_ns for n in keep]) if keep else np.zeros(0)
    unc = np.concatenate([np.full(len(n), n.uncertainty_ns) for n in keep]) if keep else np.zeros(0)
    node = (
        np.concatenate([np.full(len(n), i, dtype=np.int64) for i, n in enumerate(keep)])
        if keep
        else np.zeros(0, np.int64)
    )
    return _Flat(
        comm=cat("comm", np.uint64),
        seq=cat("seq", np.int64),
        op=cat("op", np.int64),
        nbytes=cat("bytes", np.int64),
        entry=entry,
        duration=cat("duration_ns", np.int64),
        unc=unc,
        node=node,
        rank=cat("rank", np.int64),
        nodes=keep,
    )


def _rebase(f: _Flat, cidx: np.ndarray, pidx: np.ndarray) -> np.ndarray:
    """``seq`` made comparable across ranks whose counters did not start together (see the module
    docstring): an agent restarted, or started after the others.

    Segments are runs of one participant's calls (in entry order) whose seq never decreases. Each
    segment but the communicator's longest is matched to the longest on completion time (within half
    a step); it is shifted by the most common seq difference when that difference holds for at least
    half the matches and twice as many as no shift at all (so clock noise never moves a good one)."""
    seq = f.seq.copy()
    order = np.lexsort((f.entry, pidx))
    sp, ss = pidx[order], f.seq[order]
    brk = np.ones(order.size, dtype=bool)
    brk[1:] = (sp[1:] != sp[:-1]) | (ss[1:] < ss[:-1])
    seg_sorted = np.cumsum(brk) - 1
    nseg = int(seg_sorted[-1]) + 1 if seg_sorted.size else 0
    if nseg == 0:
        return seq
    seg = np.empty(order.size, dtype=np.int64)
    seg[order] = seg_sorted
    seg_len = np.bincount(seg, minlength=nseg)
    seg_comm = np.zeros(nseg, dtype=np.int64)
    seg_comm[seg] = cidx
    # rows of segment s, in entry order: order[bounds[s]:bounds[s + 1]] (one sort, then slices)
    bounds = np.concatenate((np.flatnonzero(brk), [order.size]))
    end_all = f.entry + np.where(f.duration >= 0, f.duration, np.nan)
    for c in np.unique(seg_comm):
        segs = np.flatnonzero(seg_comm == c)
        if segs.size < 2:
            continue
        ref = int(segs[np.argmax(seg_len[segs])])
        rows = order[bounds[ref] : bounds[ref + 1]]
        rows = rows[np.isfinite(end_all[rows])]
        rord = np.argsort(end_all[rows])
        r_end, r_seq = end_all[rows][rord], f.seq[rows][rord]
        if r_end.size < 2:
            continue
        tol = 0.5 * float(np.median(np.diff(r_end)))
        for s in segs:
            if s == ref:
                continue
            mine = order[bounds[s] : bounds[s + 1]]
            m = mine[np.isfinite(end_all[mine])]
            e = end_all[m]
            j = np.clip(np.searchsorted(r_end, e), 1, r_end.size - 1)
            near = np.where(np.abs(r_end[j - 1] - e) <= np.abs(r_end[j] - e), j - 1, j)
            good = np.abs(r_end[near] - e) <= tol
            if not good.any():
                continue
            shifts = r_seq[near][good] - f.seq[m][good]
            unshifted = int(np.count_nonzero(shifts == 0))
            if unshifted * 2 >= shifts.size:
                continue  # the common case: already aligned
            vals, counts = np.unique(shifts, return_counts=True)
            best = int(np.argmax(counts))
            if vals[best] != 0 and counts[best] * 2 >= good.sum() and counts[best] > 2 * unshifted:
                seq[mine] += int(vals[best])
    return seq


def analyze(nodes: Sequence[NodeCalls], *, as_of_ns: float | None = None) -> CollectiveVerdict:
    """The collective-aware verdict across every node's calls (see the module docstring)."""
    f = _flatten(nodes)
    if f.seq.size == 0:
        return CollectiveVerdict("no-collectives", "no NCCL collectives in the window")
    comm_ids, cidx = np.unique(f.comm, return_inverse=True)
    cidx = cidx.astype(np.int64)
    # participants: (comm, node, rank)
    pkey = (cidx * (len(f.nodes) + 1) + f.node) * (int(f.rank.max()) + 2) + (f.rank + 1)
    pkeys, pidx = np.unique(pkey, return_inverse=True)
    pidx = pidx.astype(np.int64)
    npart = pkeys.size
    part_comm = np.zeros(npart, dtype=np.int64)
    part_comm[pidx] = cidx
    part_node = np.zeros(npart, dtype=np.int64)
    part_node[pidx] = f.node
    part_rank = np.zeros(npart, dtype=np.int64)
    part_rank[pidx] = f.rank
    part_unc = np.zeros(npart)
    part_unc[pidx] = f.unc
    seq = _rebase(f, cidx, pidx)

    # One row per (participant, seq): duplicates (merged recordings) dropped.
    _, first = np.unique(pidx * (int(seq.max()) - int(seq.min()) + 2) + (seq - int(seq.min())), return_index=True)
    rows = np.sort(first)
    cidx, pidx, seq = cidx[rows], pidx[rows], seq[rows]
    entry, dur, unc, nbytes, op = f.entry[rows], f.duration[rows], f.unc[rows], f.nbytes[rows], f.op[rows]

    # Calls: (comm, seq). Sorted by call then entry: the last arrival closes each group.
    span = int(seq.max()) - int(seq.min()) + 1
    call_key = cidx * span + (seq - int(seq.min()))
    order = np.lexsort((entry, call_key))
    ck = call_key[order]
    starts = np.flatnonzero(np.concatenate(([True], ck[1:] != ck[:-1])))
    ends = np.concatenate((starts[1:], [ck.size]))
    size = ends - starts
    call_comm = cidx[order][starts]
    comm_nranks = _nranks(f.nodes, comm_ids, cidx, pidx, part_rank)
    want = comm_nranks[call_comm]
    in_flight_call = np.maximum.reduceat((dur[order] < 0).astype(np.int64), starts) > 0
    complete = (size == want) & ~in_flight_call & (size >= 2)

    # Hung: a call some ranks are stuck in while another rank never entered it.
    hung = _hung(
        f,
        comm_ids,
        call_comm,
        seq[order][starts],
        size,
        want,
        in_flight_call,
        order,
        starts,
        ends,
        pidx,
        part_node,
        part_rank,
        part_comm,
        entry,
        dur,
        as_of_ns,
    )

    sel_calls = np.flatnonzero(complete)
    last_pos = ends[sel_calls] - 1
    prev_pos = ends[sel_calls] - 2
    o_entry = entry[order]
    o_dur = dur[order]
    o_part = pidx[order]
    o_unc = unc[order]
    last_part = o_part[last_pos]
    lag = o_entry[last_pos] - o_entry[prev_pos]
    lag_unc = o_unc[last_pos] + o_unc[prev_pos]
    # per-row waits on complete calls: the last arrival minus the row's own, never more than the row's
    # own time in the call (measured on its own clock: the call returns only once everyone is in). A
    # wait beyond that by more than both clocks' uncertainty means the clocks disagree (a node's
    # offset is wrong): the row is counted as a clock conflict.
    row_call = np.repeat(np.arange(starts.size), size)
    row_ok = complete[row_call]
    last_entry_of_call = o_entry[ends - 1]
    raw_wait = last_entry_of_call[row_call] - o_entry
    own = np.maximum(o_dur, 0).astype(np.float64)
    conflict = row_ok & (raw_wait > own + o_unc + o_unc[ends - 1][row_call] + CLOCK_SLACK_NS)
    wait = np.where(row_ok, np.clip(raw_wait, 0.0, own), 0.0)
    end_t = o_entry + o_dur
    first_done = np.minimum.reduceat(np.where(row_ok, end_t, np.inf), starts)
    # the transfer can last no longer than any rank's own time in the call (its own clock)
    shortest = np.minimum.reduceat(np.where(row_ok, own, np.inf), starts)
    transfer = np.clip(first_done - last_entry_of_call, 0.0, shortest)[sel_calls]
    call_bytes = np.maximum.reduceat(nbytes[order], starts)[sel_calls]
    call_op = op[order][starts]

    part_wait = np.bincount(o_part, weights=wait, minlength=npart)
    part_conflicts = np.bincount(o_part[conflict], minlength=npart)
    part_calls = np.bincount(o_part[row_ok], minlength=npart)
    part_last = np.bincount(last_part, minlength=npart)
    ok_rows = np.flatnonzero(row_ok)
    span_lo = np.full(npart, np.inf)
    span_hi = np.full(npart, -np.inf)
    np.minimum.at(span_lo, o_part[ok_rows], o_entry[ok_rows])
    np.maximum.at(span_hi, o_part[ok_rows], end_t[ok_rows])
    part_span = np.where(span_hi > span_lo, span_hi - span_lo, 0.0)

    comms: list[CommSummary] = []
    for c in range(comm_ids.size):
        mine = call_comm[sel_calls] == c
        parts = np.flatnonzero(part_comm == c)
        ranks = []
        for p in parts[np.argsort(part_rank[parts])]:
            lags = lag[mine & (last_part == p)]
            share = part_wait[p] / part_span[p] if part_span[p] > 0 else 0.0
            ranks.append(
                RankRow(
                    node=f.nodes[part_node[p]].node,
                    comm=comm_hex(int(comm_ids[c])),
                    rank=int(part_rank[p]),
                    calls=int(part_calls[p]),
                    last=int(part_last[p]),
                    median_lag_ms=float(np.median(lags)) / 1e6 if lags.size else 0.0,
                    wait_s=float(part_wait[p]) / 1e9,
                    wait_share=float(share),
                    uncertainty_ms=float(part_unc[p]) / 1e6,
                    gpu_model=f.nodes[part_node[p]].gpu_model,
                    clock_conflicts=int(part_conflicts[p]),
                )
            )
        all_calls = call_comm == c
        tr = transfer[mine]
        bts = call_bytes[mine]
        med_tr = float(np.median(tr)) if tr.size else 0.0
        med_b = float(np.median(bts)) if bts.size else 0.0
        spans = part_span[parts]
        ops = call_op[all_calls]
        comms.append(
            CommSummary(
                comm=comm_hex(int(comm_ids[c])),
                nranks=int(comm_nranks[c]),
                op=op_name(NCCL, int(np.bincount(ops).argmax())) if ops.size else "",
                complete=int(mine.sum()),
                incomplete=int((all_calls & ~complete & ~in_flight_call).sum()),
                in_flight=int((all_calls & in_flight_call).sum()),
                median_bytes=med_b,
                median_transfer_ms=med_tr / 1e6,
                bandwidth_gbps=(med_b / med_tr) if med_tr > 0 else 0.0,
                transfer_share=float(tr.sum() / np.median(spans)) if spans.size and np.median(spans) > 0 else 0.0,
                ranks=ranks,
            )
        )
    if hung is not None:
        hung.comms = comms
        return hung
    return _verdict(comms, lag, lag_unc, last_part, call_comm[sel_calls], part_comm, part_node, part_rank, f)


def _nranks(
    nodes: Sequence[NodeCalls], comm_ids: np.ndarray, cidx: np.ndarray, pidx: np.ndarray, part_rank: np.ndarray
) -> np.ndarray:
    """Communicator sizes: as the tracer recorded them, else the ranks seen."""
    out = np.zeros(comm_ids.size, dtype=np.int64)
    for i, cid in enumerate(comm_ids.tolist()):
        out[i] = max((n.nranks.get(int(cid), 0) for n in nodes), default=0)
    seen = np.zeros(comm_ids.size, dtype=np.int64)
    parts_comm = np.zeros(int(pidx.max()) + 1, dtype=np.int64)
    parts_comm[pidx] = cidx
    np.add.at(seen, parts_comm, 1)
    return np.where(out > 0, out, seen)


def _hung(
    f: _Flat,
    comm_ids: np.ndarray,
    call_comm: np.ndarray,
    call_seq: np.ndarray,
    size: np.ndarray,
    want: np.ndarray,
    in_flight: np.ndarray,
    order: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    pidx: np.ndarray,
    part_node: np.ndarray,
    part_rank: np.ndarray,
    part_comm: np.ndarray,
    entry: np.ndarray,
    dur: np.ndarray,
    as_of_ns: float | None,
) -> CollectiveVerdict | None:
    stuck = np.flatnonzero(in_flight & (size < want))
    if stuck.size == 0:
        return None
    # The earliest such call (by its first entry): everything after it is a consequence.
    k = int(stuck[np.argmin(entry[order][starts[stuck]])])
    rows = order[starts[k] : ends[k]]
    present = set(pidx[rows].tolist())
    c = int(call_comm[k])
    missing = [p for p in np.flatnonzero(part_comm == c).tolist() if p not in present]
    if not missing:
        return None
    p = min(missing, key=lambda q: int(part_rank[q]))
    as_of = as_of_ns if as_of_ns is not None else float(np.nanmax(np.where(dur >= 0, entry + dur, entry)))
    waited = float(np.sum(np.maximum(as_of - entry[rows], 0.0))) / 1e9
    node = f.nodes[part_node[p]].node
    opn = op_name(NCCL, int(f.op[rows[0]]))
    cid = comm_hex(int(comm_ids[c]))
    line = (
        f"{node} (rank {int(part_rank[p])}) never entered {opn} #{int(call_seq[k])} (comm {cid[:4]}…): "
        f"{len(present)} peer(s) have waited {fmt_secs(waited)} in it"
    )
    return CollectiveVerdict(
        "hung",
        line,
        node,
        int(part_rank[p]),
        cid,
        lag_ms=math.inf,
        peers_wait_s=waited,
        calls=int(want[k]),
        last_calls=0,
    )


def _verdict(
    comms: list[CommSummary],
    lag: np.ndarray,
    lag_unc: np.ndarray,
    last_part: np.ndarray,
    lag_comm: np.ndarray,
    part_comm: np.ndarray,
    part_node: np.ndarray,
    part_rank: np.ndarray,
    f: _Flat,
) -> CollectiveVerdict:
    best: CollectiveVerdict | None = None
    for c, cs in enumerate(comms):
        n = cs.complete
        if n == 0 or cs.nranks < 2:
            continue
        parts = np.flatnonzero(part_comm == c)
        counts = np.bincount(last_part[lag_comm == c], minlength=int(part_comm.size))[parts]
        top = int(parts[int(np.argmax(counts))])
        k = int(counts.max())
        p0 = 1.0 / cs.nranks
        z = (k - n * p0) / math.sqrt(n * p0 * (1 - p0))
        mine = (lag_comm == c) & (last_part == top)
        med_lag = float(np.median(lag[mine])) if mine.any() else 0.0
        med_unc = float(np.median(lag_unc[mine])) if mine.any() else 0.0
        peers = [r for r in cs.ranks if not (r.node == f.nodes[part_node[top]].node and r.rank == int(part_rank[top]))]
        peers_wait = sum(r.wait_s for r in peers)
        peers_share = float(np.mean([r.wait_share for r in peers])) if peers else 0.0
        node = f.nodes[part_node[top]].node
        rank = int(part_rank[top])
        short = cs.comm[:4]
        candidate: CollectiveVerdict
        clashing = [r for r in cs.ranks if r.calls and r.clock_conflicts >= MIN_LAST_SHARE * r.calls]
        if clashing:  # who arrives last cannot be told while a node's clock is off by more than its ±
            # a rank behind the others seems to wait longer than its call lasted; when most ranks seem
            # to, the odd one out is ahead
            ahead = len(clashing) * 2 > len(cs.ranks)
            odd = [r for r in cs.ranks if r not in clashing] if ahead else clashing
            suspect = odd[0] if odd else clashing[0]
            worst = max(clashing, key=lambda r: r.clock_conflicts)
            line = (
                f"inconclusive: the clocks of comm {short}…'s ranks disagree — in {worst.clock_conflicts:,} of "
                f"{worst.calls:,} {cs.op} calls {worst.node} (rank {worst.rank}) waited longer than its own call "
                f"lasted, beyond the clocks' ±: {suspect.node} (rank {suspect.rank}) looks "
                f"{'ahead of' if ahead else 'behind'} its peers by more than its measured offset says; fix clock "
                "sync (chrony/PTP) and look again"
            )
            candidate = CollectiveVerdict("inconclusive", line, suspect.node, suspect.rank, cs.comm, calls=n)
        elif z >= MIN_Z and k >= MIN_LAST_SHARE * n and peers_share >= MIN_WAIT_SHARE:
            clock = f" (±{fmt_ms(med_unc / 1e6)} clock)"
            head = f"{node} (rank {rank}) arrived last at {k:,} of {n:,} {cs.op} calls (comm {short}…)"
            if med_lag > UNCERTAINTY_FACTOR * med_unc:
                line = (
                    f"{head}, median {fmt_ms(med_lag / 1e6)} after the others{clock}; "
                    f"peers waited {fmt_secs(peers_wait)} ({peers_share * 100:.1f} % of their time)"
                )
                kind = "straggler"
            else:
                line = (
                    f"inconclusive: {head}, but its median lag {fmt_ms(med_lag / 1e6)} is within the clock "
                    f"uncertainty{clock}; tighten clock sync (chrony/PTP) and look again"
                )
                kind = "inconclusive"
            candidate = CollectiveVerdict(
                kind, line, node, rank, cs.comm, med_lag / 1e6, med_unc / 1e6, k, n, peers_wait, peers_share
            )
        elif cs.transfer_share >= SLOW_TRANSFER_SHARE:
            waits = [r.wait_share for r in cs.ranks]
            line = (
                f"no straggler: the collective itself is slow — {cs.op} of {fmt_bytes(cs.median_bytes)} takes a median "
                f"{fmt_ms(cs.median_transfer_ms)} once every rank is in ({cs.bandwidth_gbps:.2f} GB/s reached, "
                f"comm {short}…), {cs.transfer_share * 100:.0f} % of the time; ranks wait little "
                f"(≤ {max(waits) * 100:.1f} % of their time): look at the network / NVLink"
            )
            candidate = CollectiveVerdict("slow-collective", line, None, None, cs.comm, calls=n)
        else:
            line = (
                f"no straggler: the {cs.nranks} ranks of comm {short}… arrive alike over {n:,} {cs.op} calls "
                f"(most often last: rank {rank}, {k:,} times; peers waited {peers_share * 100:.1f} % of their time)"
            )
            candidate = CollectiveVerdict("no-straggler", line, None, None, cs.comm, calls=n)
        if best is None or _rank(candidate) > _rank(best):
            best = candidate
    if best is None:
        incomplete = sum(c.incomplete for c in comms)
        best = CollectiveVerdict(
            "no-straggler",
            f"no straggler verdict: no NCCL call was seen on every rank of its communicator ({incomplete:,} incomplete)",
        )
    best.comms = comms
    return best


def _rank(v: CollectiveVerdict) -> tuple[int, float]:
    order = {"straggler": 4, "inconclusive": 3, "slow-collective": 2, "no-straggler": 1}
    return order.get(v.kind, 0), v.peers_wait_s


__all__ = ["KINDS", "CollectiveVerdict", "CommSummary", "NodeCalls", "RankRow", "analyze", "comm_hex"]
