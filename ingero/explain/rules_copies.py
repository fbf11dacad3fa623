"""Slow host↔device copies: pageable host memory, or a slow PCIe link.

A synchronous ``cudaMemcpy`` from *pageable* host memory is staged by the driver through a pinned
bounce buffer: it runs at a fraction of the pinned bandwidth (3 GB/s where pinned memory gets 11), and
the thread waits for all of it. A PCIe problem (a link trained at lower width or speed) makes *every*
copy slow. Both show in the one figure a copy row holds besides its time, its bytes: bandwidth =
``arg0 / duration``.

Per process, over its synchronous copies of at least :data:`MIN_BYTES` (smaller ones are
latency-bound):

* the reference bandwidth is what the process's own fast copies reach — the :data:`REF_QUANTILE` of the
  per-call bandwidths — but never less than :data:`NOMINAL_GBPS` (a PCIe Gen3 x16 link's pinned
  copies): when every copy is slow, the link or the memory is, and the nominal figure is the reference;
* a copy is slow below half the reference;
* time lost: each slow copy's time beyond its bytes at the reference bandwidth,
  ``Σ (dur − bytes / ref)`` — never more than its own time, nor the wall time.

When some copies of the process run near the reference and others at a fraction, the slow ones come
from pageable memory; when none reaches half the nominal bandwidth, it is the link or the memory of
all copies (the chain says which, and how to tell them apart).
"""

from __future__ import annotations

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context, short_ns
from ingero.explain.model import Chain, TimelineEntry
from ingero.store.catalog import op_ids, op_name

MEMCPY_OPS = op_ids("cudaMemcpy", "cuMemcpy")  # synchronous copies (async ones only time the enqueue)
MIN_BYTES = 512 << 10  # copies this large are bandwidth-bound
MIN_COPIES = 10
REF_QUANTILE = 0.9
NOMINAL_GBPS = 11.0  # bytes per ns: PCIe Gen3 x16 pinned copies
SLOW = 0.5  # a copy below this share of the reference bandwidth is slow


def pageable_chains(ctx: Context, chains: list[Chain]) -> list[Chain]:
    """A chain per process whose slow copies lose ≥ 1 % of wall time; where the transfer-bound rule
    already blamed that process's copies (``chains``), the measured loss goes into its chain instead
    (one diagnosis)."""
    g, a = ctx.gpu, ctx.frame.args
    wall = max(1, g.last_ns - g.first_ns)
    is_copy = np.zeros(a.source.size, dtype=bool)
    for s, o in MEMCPY_OPS:
        is_copy |= (a.source == s) & (a.op == o)
    big = is_copy & (a.arg0 >= MIN_BYTES) & (a.dur > 0) & np.isin(a.pid, g.pids)
    out: list[Chain] = []
    for pid in np.unique(a.pid[big]).tolist():
        k = big & (a.pid == pid)
        if int(k.sum()) < MIN_COPIES:
            continue
        nbytes, dur = a.arg0[k].astype(np.float64), a.dur[k].astype(np.float64)
        bw = nbytes / dur  # bytes per ns = GB/s
        ref = max(float(np.quantile(bw, REF_QUANTILE)), NOMINAL_GBPS)
        slow = bw < SLOW * ref
        lost = min(float(np.clip(dur - nbytes / ref, 0, None)[slow].sum()), float(dur[slow].sum()), float(wall))
        if not slow.any() or not cz.worth_a_chain(lost, wall):
            continue
        name = op_name(int(a.source[k][0]), int(a.op[k][0]))
        bound = next((c for c in chains if c.family == "transfer" and c.evidence.get("pid") == pid), None)
        if bound is not None:
            bound.evidence.update(lost_ms=round(lost / 1e6, 1), lost_share=round(lost / wall, 4))
            bound.explanation += f" Against {ref:.1f} GB/s the slow copies lost {short_ns(lost)} ({100 * lost / wall:.1f}% of wall time)."
            continue
        out.append(_chain(ctx, int(pid), name, bw, slow, nbytes, ref, lost, wall, int(a.ts_ns[k].max())))
    return out


def _chain(
    ctx: Context,
    pid: int,
    name: str,
    bw: np.ndarray,
    slow: np.ndarray,
    nbytes: np.ndarray,
    ref: float,
    lost: float,
    wall: int,
    last: int,
) -> Chain:
    n_slow, n = int(slow.sum()), int(slow.size)
    slow_gbps, fast = float(np.median(bw[slow])), bw[~slow]
    all_slow = fast.size == 0
    share = lost / wall
    gb = float(nbytes[slow].sum()) / 1e9
    words = f"{n_slow} of {n} large {name} copies ({gb:.2f} GB) at {slow_gbps:.1f} GB/s" + (
        f", the rest at {float(np.median(fast)):.1f} GB/s" if not all_slow else f", none near {ref:.0f} GB/s"
    )
    cause = (
        "every copy is slow: the PCIe link (trained at a lower width or generation) or host memory bandwidth, or "
        "all copies come from pageable memory"
        if all_slow
        else "copies from pageable host memory: the driver stages them through a pinned bounce buffer, so they run "
        "at a fraction of the bandwidth the same process's pinned copies reach, and the thread waits for all of it"
    )
    recs = [
        "Copy from pinned host memory: DataLoader(pin_memory=True), tensor.pin_memory(), or cudaHostAlloc / "
        "cudaHostRegister for buffers you fill yourself",
        "Overlap copies with compute: cudaMemcpyAsync / tensor.to(device, non_blocking=True) from pinned memory",
    ]
    if all_slow:
        recs.append(
            "Check the link: nvidia-smi -q | grep -A3 'Link Width\\|PCIe Generation' (current vs max), "
            "lspci -vv LnkSta; run cuda-samples bandwidthTest --memory=pinned"
        )
    return ctx.chain(
        cid=ctx.chain_id("transfer/slow-copy", f"pid{pid}" if ctx.pid is None else ""),
        detected_at=last,
        severity=cz.severity_of_loss(lost, wall),
        summary=f"slow host↔device copies in {ctx.proc(pid)}: {words}; {short_ns(lost)} lost ({100 * share:.1f}% of "
        "wall time)",
        root_cause=cause,
        explanation=(
            f"Bandwidth per copy is its bytes over its time. {words}. Against {ref:.1f} GB/s (the process's fast "
            f"copies, at least a PCIe Gen3 x16 link's pinned rate), the slow copies took {short_ns(lost)} more: "
            f"{100 * share:.1f}% of the wall time, during which the thread waited and the GPU had no new work."
        ),
        recommendations=recs,
        family="transfer/pageable" if not all_slow else "transfer/slow-link",
        evidence={
            "rule": "slow-copy",
            "pid": pid,
            "op": name,
            "copies": n,
            "slow_copies": n_slow,
            "slow_gb_per_s": round(slow_gbps, 2),
            "reference_gb_per_s": round(ref, 2),
            "lost_ms": round(lost / 1e6, 1),
            "lost_share": round(share, 4),
            "score": round(share, 4),
        },
        timeline=[TimelineEntry("CUDA", name, words)],
    )
