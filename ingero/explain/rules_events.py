"""Rules on events and on how processes use the GPU: OOM kills, TCP retransmit bursts, multi-process
GPU contention, and transfer-bound processes (cold starts: :mod:`ingero.explain.rules_cold`).

OOM, TCP and contention are node-wide (run once per node); transfers are per process (folded to one
chain per node unless ``per_process``).
"""

from __future__ import annotations

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, fmt_ns, layer_of, short_ns, us
from ingero.explain.frame import I64, member
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.stats import OpStats
from ingero.store.catalog import TCP, op_ids
from ingero.timeutil import NS_PER_S, fmt_ts

MIN_CALLS = 10
TCP_CHAIN = 10  # retransmits in the window before they make a chain of their own
TCP_HIGH = 100
BURST_NS = 10 * NS_PER_S
CONTENTION = 1.5  # an op this much slower in the TCP-burst windows than outside is affected by them
MIN_SLOWDOWN = 0.03  # the shared median at least this much above the alone median ...
MIN_SIGMAS = 4.0  # ... and this many standard errors above it
TRANSFER_SHARE = 0.30
PAGEABLE_MIN_BYTES = 1 << 20  # copies this large show their bandwidth
PAGEABLE_CV = 0.15  # per-call bandwidth this constant: one path, the staging buffer
PAGEABLE_GBPS = 8.0  # below this, host↔device copies are not using pinned memory
OOM_KILLS = op_ids("oom_kill", "pod_oom_kill")
MEMCPY_OPS = op_ids("cudaMemcpy", "cuMemcpy")  # synchronous copies (async ones only time the enqueue)
DIRECTIONS = {0: "host→host", 1: "host→device", 2: "device→host", 3: "device→device", 4: "default"}


# --- OOM ---------------------------------------------------------------------------------------


def oom_chains(ctx: Context) -> list[Chain]:
    a = ctx.frame.args
    m = a.is_any(OOM_KILLS)
    if not m.any():
        return []
    ts, pids = a.ts_ns[m], a.pid[m]
    first, last = int(ts.min()), int(ts.max())
    g = ctx.grid
    ep = ctx.series.over_range(int(g.index(np.array([first - BURST_NS]))[0]), int(g.index(np.array([last]))[0]))
    victims = list(dict.fromkeys(int(p) for p in pids))
    gpu_pids = set(ctx.gpu.pids.tolist())
    hit = [p for p in victims if p in gpu_pids]
    tl = cz.timeline([cz.Cause("memory", 1.0, True)], ep, [])
    tl.append(
        TimelineEntry("HOST", "oom_kill", f"{int(m.sum())} OOM kill(s): {', '.join(ctx.proc(p) for p in victims[:4])}")
    )
    if hit:
        for p in hit[:2]:
            last_call = int(ctx.gpu.ts_ns[ctx.gpu.pid == p].max())
            tl.append(TimelineEntry("CUDA", "all", f"GPU work of {ctx.proc(p)} stopped at {fmt_ts(last_call)}"))
    else:
        tl.append(TimelineEntry("CUDA", "all", "GPU processes share the exhausted host memory"))
    who = f"killed {', '.join(ctx.proc(p) for p in hit)}, a GPU process" if hit else "killed a process on this node"
    return [
        ctx.chain(
            cid=ctx.chain_id("oom"),
            detected_at=last,
            severity="HIGH",
            summary=f"OOM killer triggered {int(m.sum())} time(s) — {who}",
            root_cause="host memory exhaustion triggered the OOM killer"
            + (f" ({ep.page_bytes / cz.GIB:.1f} GB of page allocations in the 10 s before)" if ep.page_bytes else ""),
            explanation=(
                f"The kernel's OOM killer ran {int(m.sum())} time(s) between {fmt_ts(first)} and {fmt_ts(last)} and "
                f"{who}. A killed trainer loses its GPU context and all in-flight work; in a distributed job every "
                "other rank then hangs in its next collective until the job times out."
            ),
            recommendations=[
                "Reduce host memory use: DataLoader workers x prefetch_factor, pinned-memory pools, in-memory datasets",
                "Cap co-located jobs with cgroup memory limits (memory.max) so the trainer is not the victim; "
                "set oom_score_adj=-500 on the trainer",
                "Add swap as a buffer or more RAM; check dmesg for the OOM report",
            ],
            family="oom",
            evidence={
                "rule": "oom",
                "oom_kills": int(m.sum()),
                "victims": victims,
                "gpu_victims": hit,
                "page_alloc_gb": round(ep.page_bytes / cz.GIB, 2),
                "mem_max_pct": ep.mem_max,
                "swap_max_mb": ep.swap_max,
                "score": 1.0,
            },
            timeline=tl,
        )
    ]


# --- TCP retransmits ---------------------------------------------------------------------------


def tcp_chains(ctx: Context) -> list[Chain]:
    """Retransmit bursts of the traced process tree. Softirq retransmits (pid 0) and other processes'
    have no owner among the GPU processes: they are context (a note), never a chain."""
    mine = member(ctx.frame.pid, ctx.tree if ctx.tree.size else ctx.traced)
    ts = np.sort(ctx.frame.ts_ns[(ctx.frame.source == TCP) & mine])
    n = int(ts.size)
    if n <= TCP_CHAIN:
        return []
    ends = np.searchsorted(ts, ts + BURST_NS, side="right")
    k = int(np.argmax(ends - np.arange(n)))
    burst = int(ends[k] - k)
    b_start, b_end = int(ts[k]), int(ts[ends[k] - 1])
    sev = "HIGH" if n > TCP_HIGH or burst > 50 else "MEDIUM"
    tcp_buckets = np.zeros(ctx.grid.n, dtype=bool)
    tcp_buckets[ctx.grid.index(ts)] = True
    affected = _slowest_during(ctx, tcp_buckets)
    tl = [TimelineEntry("NET", "tcp_retransmit", f"{n} retransmits; {burst} within 10 s from {fmt_ts(b_start)}")]
    extra = ""
    if affected:
        st, ratio, during, outside = affected
        tl.append(
            TimelineEntry(
                layer_of(st.source),
                st.name,
                f"p50 {fmt_ns(during)} during retransmits vs {fmt_ns(outside)} otherwise ({ratio:.1f}x)",
            )
        )
        extra = f" {st.name} was {ratio:.1f}x slower (p50) in the seconds with retransmits."
    else:
        tl.append(TimelineEntry("CUDA", "all", "GPU work may stall waiting for network data (NCCL, gRPC)"))
    return [
        ctx.chain(
            cid=ctx.chain_id("tcp-retransmit"),
            detected_at=b_end,
            severity=sev,
            summary=f"{n} TCP retransmits ({burst} within 10 s)"
            + (f" — {affected[0].name} {affected[1]:.1f}x slower" if affected else ""),
            root_cause="TCP retransmit burst — network congestion or packet loss on this node's links",
            explanation=(
                f"{n} TCP segments were retransmitted, {burst} of them within 10 s starting {fmt_ts(b_start)}. "
                "For distributed training every retransmit delays an all-reduce on all ranks; for serving it adds "
                f"client latency.{extra}"
            ),
            recommendations=[cz.NET_HEALTH, cz.NCCL_NET],
            family="network",
            evidence={
                "rule": "tcp",
                "tcp_retransmits": n,
                "burst_10s": burst,
                "burst_start_ns": b_start,
                **({"affected_op": affected[0].name, "slowdown": round(affected[1], 2)} if affected else {}),
                "score": min(1.0, n / TCP_HIGH),
            },
            timeline=tl,
        )
    ]


def _slowest_during(ctx: Context, buckets: np.ndarray) -> tuple[OpStats, float, float, float] | None:
    best: tuple[OpStats, float, float, float] | None = None
    for st in ctx.ops:
        rows = ctx.rows(st)
        inside = buckets[ctx.grid.index(rows.ts_ns)]
        if inside.sum() < MIN_CALLS or (~inside).sum() < MIN_CALLS:
            continue
        during, outside = float(np.median(rows.dur[inside])), float(np.median(rows.dur[~inside]))
        ratio = during / outside if outside > 0 else 0.0
        if ratio >= CONTENTION and (best is None or ratio > best[1]):
            best = (st, ratio, during, outside)
    return best


# --- multi-process GPU contention --------------------------------------------------------------


def contention_chains(ctx: Context) -> list[Chain]:
    gpu = ctx.gpu
    if gpu.pids.size < 2:
        return []
    pids, counts = np.unique(gpu.pid, return_counts=True)
    busy = [int(p) for p, c in zip(pids, counts, strict=True) if c >= MIN_CALLS]
    if len(busy) < 2:
        return []
    by_gpu: dict[int, list[int]] = {}
    for p in busy:
        for gid in sorted(ctx.frame.gpu_ids.get(p, {0})):
            by_gpu.setdefault(gid, []).append(p)
    chains: list[Chain] = []
    g = ctx.grid
    for gid, members in sorted(by_gpu.items()):
        if len(members) < 2:
            continue
        active = {p: np.bincount(g.index(gpu.ts_ns[gpu.pid == p]), minlength=g.n) > 0 for p in members}
        best: tuple[float, int, OpStats, np.ndarray, np.ndarray, I64] | None = None
        best_lost = 0.0
        always_shared = True
        for p in members:
            others = np.logical_or.reduce([active[q] for q in members if q != p])
            for st in _pid_ops(ctx, p):
                m = (gpu.pid == p) & (gpu.source == st.source) & (gpu.op == st.op)
                ts, dur = gpu.ts_ns[m], gpu.dur[m]
                shared = others[g.index(ts)]
                if (~shared).sum() >= MIN_CALLS:
                    always_shared = False
                if shared.sum() < MIN_CALLS or (~shared).sum() < MIN_CALLS:
                    continue
                ratio = float(np.median(dur[shared]) / max(1.0, float(np.median(dur[~shared]))))
                lost = shared_loss(dur[shared], dur[~shared])
                if lost > 0 and (best is None or lost > best_lost):
                    best, best_lost = (ratio, p, st, dur[shared], dur[~shared], ts), lost
        procs = ", ".join(ctx.proc(p) for p in members[:4])
        if best is not None:
            wall = max(1, ctx.gpu.last_ns - ctx.gpu.first_ns)
            lost = min(best_lost, float(wall))
            if cz.worth_a_chain(lost, wall):
                chains.append(_contention_chain(ctx, gid, members, best, lost, wall))
        elif best is None and always_shared:
            chains.append(
                ctx.chain(
                    cid=ctx.chain_id("gpu-contention", f"gpu{gid}"),
                    detected_at=ctx.grid.end_of(ctx.grid.n - 1),
                    severity="LOW",
                    summary=f"GPU {gid} shared by {len(members)} processes for the whole window ({procs})",
                    root_cause=f"multi-process GPU contention — {procs} submit work to GPU {gid} at the same time",
                    explanation=(
                        f"{len(members)} processes used GPU {gid} throughout the window, so there is no period to "
                        "compare their latency alone; the GPU time-slices between their contexts."
                    ),
                    recommendations=_contention_recs(),
                    family="gpu-contention",
                    evidence={"rule": "gpu-contention", "gpu": gid, "pids": members, "score": 0.0},
                    timeline=[TimelineEntry("CUDA", "context", f"{len(members)} processes on GPU {gid}: {procs}")],
                )
            )
    return chains


def shared_loss(shared: np.ndarray, alone: np.ndarray) -> float:
    """Time a process's calls lost while another process used its GPU: the shared calls' total beyond
    the alone median (their mean excess, so call-to-call noise adds nothing), never more than their own
    time; 0 unless the shared median is above the alone median by MIN_SLOWDOWN of it and by
    MIN_SIGMAS standard errors (robust: from the median absolute deviations). No ratio gate: a 10 %
    slowdown on half the calls of a run is seconds lost."""
    if shared.size < MIN_CALLS or alone.size < MIN_CALLS:
        return 0.0
    m_s, m_a = float(np.median(shared)), float(np.median(alone))
    sd_s = 1.4826 * float(np.median(np.abs(shared - m_s)))
    sd_a = 1.4826 * float(np.median(np.abs(alone - m_a)))
    se = 1.2533 * float(np.sqrt(sd_s**2 / shared.size + sd_a**2 / alone.size))
    if m_s - m_a < max(MIN_SLOWDOWN * m_a, MIN_SIGMAS * se):
        return 0.0
    return float(min(max(0.0, float(shared.sum()) - m_a * shared.size), float(shared.sum())))


def _pid_ops(ctx: Context, pid: int) -> list[OpStats]:
    from ingero.explain.stats import stats_from_columns

    gpu = ctx.gpu
    m = gpu.pid == pid
    return [s for s in stats_from_columns(gpu.source[m], gpu.op[m], gpu.dur[m]) if s.count >= 2 * MIN_CALLS]


def _contention_recs() -> list[str]:
    return [
        "Give each job its own GPU (CUDA_VISIBLE_DEVICES) or schedule them at different times",
        "If sharing is intended, use MPS (nvidia-cuda-mps-control -d) or MIG partitions instead of time-slicing",
        "Find the other process: nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv",
    ]


def _contention_chain(
    ctx: Context,
    gid: int,
    members: list[int],
    best: tuple[float, int, OpStats, np.ndarray, np.ndarray, I64],
    lost: float,
    wall: int,
) -> Chain:
    ratio, victim, st, shared, alone, _ts = best
    others = [p for p in members if p != victim]
    gpu = ctx.gpu
    starts = {p: int(gpu.ts_ns[gpu.pid == p].min()) for p in members}
    intruder = max(others, key=lambda p: starts[p])
    sev = cz.severity_of_loss(lost, wall)
    p_sh, p_al = float(np.median(shared)), float(np.median(alone))
    tl = [
        TimelineEntry("CUDA", "context", f"{ctx.proc(intruder)} starts using GPU {gid} at {fmt_ts(starts[intruder])}"),
        TimelineEntry(
            layer_of(st.source),
            st.name,
            f"{ctx.proc(victim)}: p50 {fmt_ns(p_sh)} while sharing vs {fmt_ns(p_al)} alone ({ratio:.1f}x)",
            round(p_sh / 1000),
        ),
    ]
    return ctx.chain(
        cid=ctx.chain_id("gpu-contention", f"gpu{gid}"),
        detected_at=ctx.grid.end_of(ctx.grid.n - 1),
        severity=sev,
        summary=f"GPU {gid} time-sliced between {len(members)} processes — {st.name} {ratio:.1f}x slower "
        f"while {ctx.proc(intruder)} runs",
        root_cause=(
            f"multi-process GPU contention — {', '.join(ctx.proc(p) for p in members[:4])} submit work to GPU {gid}; "
            "the GPU time-slices between their contexts, so each waits for the other's kernels"
        ),
        explanation=(
            f"{ctx.proc(victim)} calls {st.name}: p50 {fmt_ns(p_al)} when it has GPU {gid} to itself, {fmt_ns(p_sh)} in the "
            f"seconds when {', '.join(ctx.proc(p) for p in others[:3])} also submit work ({len(shared)} vs {len(alone)} "
            f"calls). No host evidence is needed: the slowdown follows the other process's activity on the same GPU. "
            f"Time lost: {short_ns(lost)} ({100 * lost / wall:.1f}% of wall time)."
        ),
        recommendations=_contention_recs(),
        family="gpu-contention",
        evidence={
            "rule": "gpu-contention",
            "gpu": gid,
            "pids": members,
            "victim": victim,
            "intruder": intruder,
            "op": st.name,
            "p50_shared_us": us(p_sh),
            "p50_alone_us": us(p_al),
            "slowdown": round(ratio, 2),
            "lost_ms": round(lost / 1e6, 1),
            "lost_share": round(lost / wall, 4),
            "score": round(ratio, 3),
        },
        timeline=tl,
        st=st,
    )


# --- transfer-bound ----------------------------------------------------------------------------


def transfer_chains(ctx: Context) -> list[Chain]:
    gpu = ctx.gpu
    best: tuple[float, int, OpStats, float, float] | None = None
    for pid in gpu.pids:
        m = gpu.pid == pid
        wall = float(gpu.ts_ns[m].max() - gpu.ts_ns[m].min())
        api = float(gpu.dur[m].sum())
        if wall <= 0 or api <= 0:
            continue
        for s, o in MEMCPY_OPS:
            k = m & (gpu.source == s) & (gpu.op == o)
            if k.sum() < MIN_CALLS:
                continue
            copy = float(gpu.dur[k].sum())
            share = copy / wall
            if share >= TRANSFER_SHARE and copy / api >= 0.5 and (best is None or share > best[0]):
                st = next(x for x in ctx.ops if (x.source, x.op) == (s, o))
                best = (share, int(pid), st, copy, copy / api)
    if best is None:
        return []
    share, pid, st, copy, api_share = best
    a = ctx.frame.args
    k = (a.source == st.source) & (a.op == st.op) & (a.pid == pid)
    nbytes = float(a.arg0[k].sum())
    bw = nbytes / (copy / NS_PER_S) / 1e9 if copy > 0 else 0.0
    dirs = {DIRECTIONS.get(int(d), str(d)): float(a.arg0[k & (a.arg1 == d)].sum()) for d in np.unique(a.arg1[k])}
    main_dir = max(dirs, key=lambda x: dirs[x]) if dirs else "host→device"
    n_calls = int(k.sum()) or st.count
    avg = nbytes / n_calls if n_calls else 0.0
    # pageable host memory: long runs of large synchronous copies at one, low bandwidth (the driver stages
    # them through a pinned bounce buffer); judged per call in bytes/s, so mixed sizes do not hide it
    big = k & (a.arg0 >= PAGEABLE_MIN_BYTES) & (a.dur > 0)
    per_call = a.arg0[big] / a.dur[big] if big.any() else np.zeros(0)  # bytes per ns = GB/s
    cv = float(per_call.std() / per_call.mean()) if per_call.size >= MIN_CALLS and per_call.mean() > 0 else 1.0
    pageable = cv < PAGEABLE_CV and 0 < float(np.median(per_call)) < PAGEABLE_GBPS if per_call.size else False
    slow_bw = 0 < bw < PAGEABLE_GBPS
    recs = []
    if slow_bw:
        recs.append(
            "Use pinned host memory (DataLoader(pin_memory=True) / cudaHostAlloc): pageable copies run at a fraction "
            "of PCIe bandwidth"
        )
    recs.append(
        "Overlap copies with compute: cudaMemcpyAsync / tensor.to(device, non_blocking=True) on a separate stream"
    )
    if 0 < avg < (1 << 20):
        recs.append(f"Batch small transfers (average {avg / 1024:.0f} KB) into fewer large ones")
    recs.append("Keep data resident on the GPU between steps; avoid .cpu()/.item() round-trips in the loop")
    if not slow_bw:
        recs.append("Move less data: preprocess on the GPU, use lower-precision inputs (fp16/uint8)")
    gb = nbytes / 1e9
    return [
        ctx.chain(
            cid=ctx.chain_id("transfer", "", st.name),
            detected_at=int(gpu.ts_ns[gpu.pid == pid].max()),
            severity="HIGH" if share >= 0.6 else "MEDIUM",
            summary=f"{st.name} takes {100 * share:.0f}% of wall time ({st.count} calls, {gb:.1f} GB at {bw:.1f} GB/s) — transfer-bound",
            root_cause=(
                f"synchronous host↔device copies dominate {ctx.proc(pid)}: {100 * share:.0f}% of its wall time and "
                f"{100 * api_share:.0f}% of its GPU API time is {st.name}, mostly {main_dir}"
                + (
                    f", at a constant {float(np.median(per_call)):.1f} GB/s over {per_call.size} large copies — "
                    "pageable host memory (staged through a bounce buffer), far below PCIe"
                    if pageable
                    else (f", at {bw:.1f} GB/s — pageable-memory speed, far below PCIe" if slow_bw else "")
                )
            ),
            explanation=(
                f"{ctx.proc(pid)} spent {short_ns(copy)} in {st.name} ({st.count} calls moving {gb:.2f} GB, "
                f"{avg / (1 << 20):.1f} MB per call on average). While a synchronous copy runs the CPU waits and the "
                "GPU has no kernels queued, so copies and compute never overlap."
            ),
            recommendations=recs,
            family="transfer",
            evidence={
                "rule": "transfer",
                "pid": pid,
                "op": st.name,
                "wall_share": round(share, 3),
                "api_share": round(api_share, 3),
                "bytes": int(nbytes),
                "gb_per_s": round(bw, 2),
                "bandwidth_cv": round(cv, 3),
                "pageable": bool(pageable),
                "directions_gb": {k2: round(v / 1e9, 3) for k2, v in dirs.items()},
                "score": round(share, 4),
            },
            timeline=[
                TimelineEntry(
                    layer_of(st.source),
                    st.name,
                    f"{st.count} copies, {gb:.2f} GB {main_dir} at {bw:.1f} GB/s; {100 * share:.0f}% of wall time",
                    round(copy / 1000),
                )
            ],
            st=st,
        )
    ]
