"""Rules on a GPU op's own timing: tail latency, throughput drop, periodic spikes.

* **tail** — an op with ≥ 10 calls and p99 ≥ 3x p50. Its slow calls (≥ 3x p50) mark buckets; runs of
  them (± one bucket) are *episodes*. Each episode's host evidence is weighed against the op's other
  buckets (:func:`ingero.explain.causes.assess`); an episode with no corroborating evidence makes no
  chain. Episodes are folded into one chain per (op, primary cause family), keeping the strongest.
* **drop** — an op's call rate (moving average over ~5 s) falls ≥ 40 % below its baseline for ≥ 2
  buckets while it keeps running, corroborated the same way.
(Periodic spikes: :mod:`ingero.explain.rules_periodic`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, Culprit, OpRows, fmt_ns, layer_of, short_ns, us
from ingero.explain.evidence import Evidence, runs
from ingero.explain.frame import member
from ingero.explain.model import SEVERITY_RANK, Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, UNKNOWN, VOL, Intervals, union
from ingero.explain.rules_launch import LAUNCH_OPS, first_launch_mask
from ingero.explain.stats import OpStats
from ingero.store.catalog import IO, NCCL, op_ids
from ingero.timeutil import NS_PER_S, fmt_ts

TAIL_RATIO = 3.0
MIN_CALLS = 10
DROP = 0.40
MIN_PEAK_RATE = 10.0  # ops/s before rate changes mean anything
MIN_IO_OVERLAP = 0.05  # share of the slow calls' time during which the traced tree's block I/O was in flight
IDLE_SLEEP = 0.25  # a bucket whose GPU thread sleeps this much more than usual is idle, not a drop
COPY_OPS = set(op_ids("cudaMemcpy", "cudaMemcpyAsync", "cuMemcpy", "cuMemcpyAsync"))  # arg0 = bytes


_fmt = fmt_ns
_short = short_ns


def _mask(ctx: Context, ts: np.ndarray, dilate: int = 0) -> np.ndarray:
    m = np.zeros(ctx.grid.n, dtype=bool)
    m[ctx.grid.index(ts)] = True
    if dilate:
        d = m.copy()
        d[:-1] |= m[1:]
        d[1:] |= m[:-1]
        return d
    return m


def _evidence_dict(ep: Evidence, base: Evidence | None) -> dict[str, object]:
    d: dict[str, object] = {
        "sched_switch": ep.sched_n,
        "offcpu_ms": round(ep.offcpu_ns / 1e6, 1),
        "offcpu_share": round(ep.offcpu_frac, 3),
        "block_io": ep.io_n,
        "block_reads": ep.io_reads,
        "block_writes": ep.io_writes,
        "block_io_ms": round(ep.io_ns / 1e6, 1),
        "block_io_peak_ms": round(ep.io_max_ns / 1e6, 2),
        "block_io_mb": round(ep.io_bytes / cz.MIB, 1),
        "page_alloc_gb": round(ep.page_bytes / cz.GIB, 2),
        "tcp_retransmits": ep.tcp_n,
        "socket_ops": ep.net_n,
    }
    for k in ("cpu_max", "mem_max", "swap_max"):
        v = getattr(ep, k)
        if v is not None:
            d[k.replace("_max", "_max_pct" if k != "swap_max" else "_max_mb")] = round(v, 1)
    if base is not None:
        d["baseline_offcpu_share"] = round(base.offcpu_frac, 3)
        d["baseline_block_io_per_s"] = round(base.per_s(base.io_n), 2)
        d["baseline_sched_switch_per_s"] = round(base.per_s(base.sched_n), 2)
    return d


@dataclass
class _Episode:
    b0: int
    b1: int
    found: list[cz.Cause]
    ep: Evidence
    in_ep: np.ndarray  # the op's slow calls in this episode's window
    lost_ns: int


def tail_chains(ctx: Context) -> tuple[list[Chain], list[OpStats]]:
    """Chains for corroborated tails, and the ops whose tails nothing on the host explains.

    Each slow call is intersected with its own thread's off-CPU intervals (involuntary, voluntary,
    unknown): CPU contention is named only with measured overlap. Time spent inside an NCCL collective
    is waiting for peers, never CPU contention. Severity comes from the time lost to the cause across
    all its episodes (excess over p50, bounded by the measured overlap for CPU contention).
    """
    chains: list[Chain] = []
    unexplained: list[OpStats] = []
    wall = max(1, ctx.gpu.last_ns - ctx.gpu.first_ns)
    for st in ctx.ops:
        if st.count < MIN_CALLS or st.p50_ns <= 0 or st.tail_ratio < TAIL_RATIO:
            continue
        rows = ctx.rows(st)
        end_ns = rows.ts_ns + rows.dur
        inv = ctx.off.covered(INVOL, rows.tid, rows.ts_ns, end_ns)
        vol = ctx.off.covered(VOL, rows.tid, rows.ts_ns, end_ns)
        unk = ctx.off.covered(UNKNOWN, rows.tid, rows.ts_ns, end_ns)
        excess = np.clip(rows.dur - st.p50_ns, 0, None).astype(np.int64)
        collective = st.source == NCCL
        slow = rows.dur >= TAIL_RATIO * st.p50_ns
        if (st.source, st.op) in LAUNCH_OPS:
            first = first_launch_mask(ctx, rows)  # a kernel's first launch: loading/JIT, not contention
            if first is not None:
                slow &= ~first
        if (st.source, st.op) in COPY_OPS:
            # copies are judged in bytes/s: a 16 MB copy is not a slow 256 KB one
            nbytes = ctx.arg0_of(rows)
            if nbytes is not None and (nbytes > 0).all():
                per_byte = rows.dur / nbytes
                slow = per_byte >= TAIL_RATIO * float(np.median(per_byte))
                if int(slow.sum()) < max(1, rows.dur.size // 100):
                    continue  # the latency tail is the size mix, not slow copies
        episodes = runs(_mask(ctx, rows.ts_ns[slow]), max_gap=2)  # runs ± one bucket that touch merge
        active = _mask(ctx, rows.ts_ns)
        dilated = _mask(ctx, rows.ts_ns[slow], dilate=1)
        base = ctx.series.over_mask(active & ~dilated)
        g = ctx.grid
        by_family: dict[str, list[_Episode]] = {}
        for b0, b1 in episodes:
            ep = ctx.series.over_range(b0 - 1, b1 + 1)
            w0, w1 = g.start_of(max(0, b0 - 1)), g.end_of(min(g.n - 1, b1 + 1))
            in_ep = slow & (rows.ts_ns >= w0) & (rows.ts_ns < w1)
            ep.slow_ns = int(rows.dur[in_ep].sum())
            ep.slow_inv_ns = int(inv[in_ep].sum())
            ep.slow_vol_ns = int(vol[in_ep].sum())
            ep.slow_unk_ns = int(unk[in_ep].sum())
            found = cz.assess(ep, base, st.p99_ns)
            if collective:  # inside a collective the thread waits for its peers
                found = [c for c in found if c.family not in ("cpu", "offcpu")]
            if any(c.family.startswith("io") for c in found):
                # the traced tree's block I/O must overlap the slow calls in time, not just share a bucket
                # judged on the slow calls that preemption does not explain
                rest = in_ep & (inv < excess // 2)
                rest = rest if rest.any() else in_ep
                ep.io_overlap_ns = io_overlap(ctx, rows.ts_ns[rest], end_ns[rest])
                if ep.io_overlap_ns < MIN_IO_OVERLAP * max(1, int(rows.dur[rest].sum())):
                    found = [c for c in found if not c.family.startswith("io")]
            if not found:
                continue
            fam = found[0].family
            if fam == "cpu":
                lost = int(np.minimum(excess, inv)[in_ep].sum())
            elif fam == "offcpu":
                lost = int(np.minimum(excess, unk)[in_ep].sum())
            else:
                lost = int(excess[in_ep].sum())
            ep.excess_ns = lost
            by_family.setdefault(fam, []).append(_Episode(b0, b1, found, ep, in_ep, lost))
        if not by_family:
            unexplained.append(st)
            continue
        for fam, eps in by_family.items():
            lost = sum(e.lost_ns for e in eps)
            best = max(eps, key=lambda e: e.lost_ns)
            sev = cz.severity_of_loss(lost, wall, fam)
            chains.append(_tail_chain(ctx, st, rows, slow, fam, best, sev, len(eps), lost, wall, base))
    return chains, unexplained


def io_overlap(ctx: Context, a: np.ndarray, b: np.ndarray) -> int:
    """Time during the calls [a, b) when block I/O issued by the traced process tree was in flight."""
    f = ctx.frame
    m = (f.source == IO) & member(f.pid, ctx.tree if ctx.tree.size else ctx.traced)
    if not m.any() or a.size == 0:
        return 0
    io_s, io_e = union(f.ts_ns[m] - f.dur[m], f.ts_ns[m])  # ts = completion, duration = device latency
    in_flight = Intervals.build(io_s, io_e, np.zeros(io_s.size, dtype=np.int64))
    cs, ce = union(a, b)
    return int(in_flight.covered(cs, ce).sum())


def _tail_chain(
    ctx: Context,
    st: OpStats,
    rows: OpRows,
    slow: np.ndarray,
    fam: str,
    e: _Episode,
    sev: str,
    n_episodes: int,
    lost: int,
    wall: int,
    base: Evidence | None,
) -> Chain:
    g = ctx.grid
    b0, b1, found, ep = e.b0, e.b1, e.found, e.ep
    start = max(g.start_of(max(0, b0 - 1)), ctx.frame.first_ns)
    end = min(g.end_of(min(g.n - 1, b1 + 1)), ctx.frame.last_ns + 1)
    ep_slow = e.in_ep
    worst = int(rows.dur[ep_slow].max(initial=0))
    culprits: list[Culprit] = []
    if fam == "cpu":
        culprits = ctx.preemptors(rows.tid[ep_slow], rows.ts_ns[ep_slow], rows.ts_ns[ep_slow] + rows.dur[ep_slow])
        culprits = culprits or ctx.culprits(start, end)
    subject = ctx.subject(rows.pid)
    words = " + ".join(cz.phrase(c, ep) for c in found[:3])
    summary = f"{st.name} p99={_fmt(st.p99_ns)} ({st.tail_ratio:.1f}x p50) — {words}"
    base_txt = ""
    if base is not None and fam.startswith("io"):
        base_txt = f" (elsewhere: {base.per_s(base.io_n):.1f} I/O ops/s)"
    explanation = (
        f"{st.name} ran {st.count} times: p50 {_fmt(st.p50_ns)}, p99 {_fmt(st.p99_ns)}, max {_fmt(st.max_ns)}. "
        f"{int(slow.sum())} calls took ≥ {TAIL_RATIO:.0f}x p50; {int(ep_slow.sum())} of them (up to {_fmt(worst)}) "
        f"fell in {fmt_ts(start)} – {fmt_ts(end)}, where the host shows {words}{base_txt}. "
        + (f"The same cause recurs in {n_episodes} separate windows. " if n_episodes > 1 else "")
        + f"Time lost to it: {_short(lost)} ({100 * lost / wall:.1f}% of wall time). "
        + _mechanism(fam, st.name)
    )
    tl = cz.timeline(found, ep, culprits)
    tl.append(
        TimelineEntry(
            layer_of(st.source),
            st.name,
            f"p99={_fmt(st.p99_ns)} ({st.tail_ratio:.1f}x p50={_fmt(st.p50_ns)}); {int(ep_slow.sum())} slow calls, worst {_fmt(worst)}",
            round(st.p99_ns / 1000),
        )
    )
    evidence = {
        "rule": "tail",
        "op": st.name,
        "count": st.count,
        "p50_us": us(st.p50_ns),
        "p99_us": us(st.p99_ns),
        "tail_ratio": round(st.tail_ratio, 2),
        "slow_calls": int(slow.sum()),
        "slow_calls_in_window": int(ep_slow.sum()),
        "window_start_ns": start,
        "window_end_ns": end,
        "episodes": n_episodes,
        "causes": [c.family for c in found],
        "score": round(found[0].score, 4),
        "lost_ms": round(lost / 1e6, 1),
        "lost_share": round(lost / wall, 4),
        "slow_call_ms": round(ep.slow_ns / 1e6, 1),
        "overlap_involuntary": round(ep.slow_inv_ns / ep.slow_ns, 3) if ep.slow_ns else 0.0,
        "overlap_voluntary": round(ep.slow_vol_ns / ep.slow_ns, 3) if ep.slow_ns else 0.0,
        "overlap_unknown": round(ep.slow_unk_ns / ep.slow_ns, 3) if ep.slow_ns else 0.0,
        "io_overlap_ms": round(ep.io_overlap_ns / 1e6, 1),
        "prev_state": "recorded" if ctx.off.has_state else ("unknown" if ctx.off.has_rows else "no sched rows"),
        "preempted_by": [c.name for c in culprits if c.ns],
        **_evidence_dict(ep, base),
    }
    return ctx.chain(
        cid=ctx.chain_id("tail", fam, st.name),
        detected_at=end,
        severity=sev,
        summary=summary,
        root_cause=cz.root_cause(found[0], ep, subject, culprits),
        explanation=explanation,
        recommendations=cz.recommendations(found, ep),
        family=f"tail/{fam}",
        evidence=evidence,
        timeline=tl,
        st=st,
    )


def _mechanism(family: str, op: str) -> str:
    return {
        "cpu": f"While the calling thread is preempted it cannot issue or return from {op}, so the call's "
        "measured time includes the wait for a CPU; the overlap is measured on the same thread, and its "
        "voluntary sleeps (futex, poll, I/O) are not counted.",
        "offcpu": f"The thread calling {op} was off the CPU during these calls; without prev_state the "
        "recording cannot tell preemption from waiting.",
        "io-write": f"Checkpoint writes saturate the disk and the page cache flush steals CPU and memory bandwidth "
        f"from the process calling {op}.",
        "io-read": f"The input pipeline waits on disk reads, so the process reaches {op} late and the GPU starves.",
        "io": f"Block I/O competes with the process calling {op} for CPU time and memory bandwidth.",
        "memory": f"Host memory pressure (reclaim, page faults) stalls the CPU side of {op}.",
        "network": f"The process blocks on the network (retransmits, remote data) before or inside {op}.",
    }.get(family, "")


# --- throughput drop ---------------------------------------------------------------------------


@dataclass
class _Drop:
    st: OpStats
    b0: int
    b1: int
    found: list[cz.Cause]
    ep: Evidence
    base: Evidence | None
    sev: str
    fall: float
    base_rate: float
    rate: float
    episodes: int


def drop_chains(ctx: Context) -> list[Chain]:
    """Throughput drops, one chain per cause family: the ops of one process slow down together, so the
    drop is reported on its busiest op with the others listed."""
    found_by_family: dict[str, list[_Drop]] = {}
    for st in ctx.ops:
        d = _drop(ctx, st)
        if d is not None:
            found_by_family.setdefault(d.found[0].family, []).append(d)
    chains = []
    for drops in found_by_family.values():
        drops.sort(key=lambda d: (SEVERITY_RANK[d.sev], -d.base_rate))
        chains.append(_drop_chain(ctx, drops[0], drops[1:]))
    return chains


def _drop(ctx: Context, st: OpStats) -> _Drop | None:
    g = ctx.grid
    width_s = g.width_ns / NS_PER_S
    w = max(3, round(5 / width_s)) if width_s < 5 else 1
    if st.count < MIN_CALLS or (st.stored is not None and st.stored < st.count):
        return None  # a sampled op's stored rows do not give its rate (event_aggregates do, per minute)
    rows = ctx.rows(st)
    idx = g.index(rows.ts_ns)
    lo, hi = int(idx.min()) + 1, int(idx.max()) - 1  # first and last buckets are partial
    if hi - lo + 1 < 2 * w + 2:
        return None
    counts = np.bincount(idx, minlength=g.n)[lo : hi + 1].astype(np.float64)
    kernel = np.ones(w)
    rate = np.convolve(counts, kernel, mode="same") / np.convolve(np.ones(counts.size), kernel, mode="same") / width_s
    peak = float(rate.max(initial=0))
    if peak < MIN_PEAK_RATE:
        return None
    low = (rate < (1 - DROP) * peak) & (rate >= 1.0)
    # buckets where the process was idle by its own choice (no calls, or its GPU thread asleep far more
    # than usual: an evaluation pause, waiting for input) are not drops
    vol = ctx.series.vol[lo : hi + 1] / g.width_ns
    idle = (counts == 0) | (vol > float(np.median(vol)) + IDLE_SLEEP)
    idle = np.convolve(idle.astype(np.float64), np.ones(w), mode="same") > 0
    low &= ~idle
    if low.all() or not low.any():
        return None
    base_mask = np.zeros(g.n, dtype=bool)
    base_mask[lo : hi + 1] = ~low
    base_rate = float(counts[~low].sum() / (int((~low).sum()) * width_s))
    base = ctx.series.over_mask(base_mask)
    best: _Drop | None = None
    n_eps = 0
    for a, b in runs(low, max_gap=0):
        if b - a + 1 < 2:
            continue
        ep_rate = float(counts[a : b + 1].sum() / ((b - a + 1) * width_s))
        fall = 1 - ep_rate / base_rate if base_rate > 0 else 0.0
        if fall < DROP:
            continue
        ep = ctx.series.over_range(lo + a, lo + b)
        found = cz.assess(ep, base, st.p99_ns)
        if not found:
            ctx.notes.append(
                f"{ctx.node}: {st.name} ops/s fell {100 * fall:.0f}% at {fmt_ts(g.start_of(lo + a))} "
                f"({base_rate:.0f} → {ep_rate:.0f}/s for {_short((b - a + 1) * g.width_ns)}), no host cause recorded"
            )
            continue
        n_eps += 1
        ep.excess_ns = round(fall * (b - a + 1) * g.width_ns)  # the window's share of work not done
        sev = cz.severity_of_loss(ep.excess_ns, max(1, ctx.gpu.last_ns - ctx.gpu.first_ns), found[0].family)
        cand = _Drop(st, lo + a, lo + b, found, ep, base, sev, fall, base_rate, ep_rate, 0)
        if best is None or (SEVERITY_RANK[sev], -fall) < (SEVERITY_RANK[best.sev], -best.fall):
            best = cand
    if best is not None:
        best.episodes = n_eps
    return best


def _drop_chain(ctx: Context, d: _Drop, others: list[_Drop]) -> Chain:
    g = ctx.grid
    st, found, ep = d.st, d.found, d.ep
    start, end = g.start_of(d.b0), min(g.end_of(d.b1), ctx.frame.last_ns + 1)
    culprits: list[Culprit] = []
    if found[0].family == "cpu":  # who ran in the GPU threads' place in the window, measured
        tids = np.unique(ctx.rows(st).tid)
        culprits = ctx.preemptors(
            tids, np.full(tids.size, start, dtype=np.int64), np.full(tids.size, end, dtype=np.int64)
        ) or ctx.culprits(start, end)
    words = " + ".join(cz.phrase(c, ep) for c in found[:3])
    change = f"{d.base_rate:.0f} → {d.rate:.0f} ops/s"
    tl = cz.timeline(found, ep, culprits)
    tl.append(TimelineEntry(layer_of(st.source), st.name, f"throughput dropped {100 * d.fall:.0f}% ({change})"))
    also = ", ".join(f"{o.st.name} -{100 * o.fall:.0f}%" for o in others[:4])
    return ctx.chain(
        cid=ctx.chain_id("drop", found[0].family, st.name),
        detected_at=end,
        severity=d.sev,
        summary=f"{st.name} throughput dropped {100 * d.fall:.0f}% ({change}) — {words}",
        root_cause=cz.root_cause(found[0], ep, ctx.subject(ctx.rows(st).pid), culprits),
        explanation=(
            f"{st.name} ran at {d.base_rate:.0f} calls/s, then at {d.rate:.0f} calls/s from {fmt_ts(start)} to "
            f"{fmt_ts(end)} ({_fmt(end - start)}) with its per-call latency unchanged (p50 {_fmt(st.p50_ns)}): the "
            f"process issued less work; it did not wait longer per call. "
            + (f"Its other GPU calls fell with it ({also}). " if also else "")
            + f"In that window the host shows {words}. "
            + _mechanism(found[0].family, st.name)
        ),
        recommendations=cz.recommendations(found, ep),
        family=f"drop/{found[0].family}",
        evidence={
            "rule": "drop",
            "op": st.name,
            "baseline_per_s": round(d.base_rate, 1),
            "rate_per_s": round(d.rate, 1),
            "drop_pct": round(100 * d.fall, 1),
            "also_dropped": {o.st.name: round(100 * o.fall, 1) for o in others},
            "window_start_ns": start,
            "window_end_ns": end,
            "episodes": d.episodes,
            "causes": [c.family for c in found],
            "score": round(d.fall, 4),
            **_evidence_dict(ep, d.base),
        },
        timeline=tl,
        st=st,
    )
