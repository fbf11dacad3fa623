"""Cause families: when host evidence corroborates a GPU-side symptom, and how to say so.

A *cause family* (``cpu``, ``io-write``, ``io-read``, ``io``, ``memory``, ``network``) is what chains
are de-duplicated on: one chain per (op, family). Each family has a test (is the evidence there, and
more intense in the episode than in the op's baseline?), a score (the share of the episode lost to it,
above baseline) used to pick the primary cause, a strength test (raises severity to HIGH) and the
words: a summary phrase, a root-cause sentence, timeline entries and recommendations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ingero.explain.context import Culprit
from ingero.explain.evidence import Evidence
from ingero.explain.model import TimelineEntry
from ingero.timeutil import NS_PER_MS, NS_PER_S, fmt_duration

GIB = 1 << 30
MIB = 1 << 20

# Thresholds (per episode).
MIN_SCHED = 5  # sched_switch events before preemption counts as evidence
MIN_IO = 10
MIN_TCP = 5  # retransmits corroborating a stall
MIN_NET_OPS, MIN_NET_BYTES = 100, MIB
PAGE_BYTES = GIB  # page allocations corroborating a stall
LIFT = 1.5  # evidence must be this much denser in the episode than in the baseline
STRONG_SHARE = 0.10  # a tenth of the episode lost to the cause → HIGH
WEAK_SHARE = 0.02
MIN_OVERLAP = 0.10  # the GPU thread off-CPU (involuntarily) this share of its slow-call time → CPU contention
STRONG_OVERLAP = 0.30
# Severity from time lost (excess over the steady level) as a share of wall time; below LOW_SHARE a
# loss makes no chain (a note at most).
HIGH_SHARE, MEDIUM_SHARE, LOW_SHARE = 0.20, 0.05, 0.01
STARTUP_SHARE = 0.20  # one-off start-up costs (first launches, module loading) are LOW below this
DOMINANT = 0.5  # a cause is a chain's root only with this share of its lost time, measured

PIN = "Pin the training process to dedicated cores with taskset (e.g. taskset -c 4-15 python train.py) and keep other work off those cores"
NICE = "Run background jobs at low priority: nice -n 19 / ionice -c3 (logrotate, cron, backups, preprocessing)"
CHECKPOINT = (
    "Write-heavy I/O during GPU work: checkpoint saves — use async checkpointing "
    "(torch.distributed.checkpoint.async_save) or write checkpoints to a separate fast volume"
)
DATALOADER = (
    "Read-heavy I/O during GPU work: DataLoader bottleneck — more DataLoader workers with pin_memory=True, "
    "pre-load data to /dev/shm or local NVMe, add RAM for page cache"
)
MIXED_IO = "Check for checkpoint writes, model loads or DataLoader disk reads during GPU work"
NET_HEALTH = "Check network health: switch errors, NIC counters (ethtool -S), MTU mismatches"
NCCL_NET = (
    "For NCCL over TCP: pin the interface with NCCL_SOCKET_IFNAME; prefer InfiniBand/RoCE (NCCL_IB_HCA) for collectives"
)
SOCKET = "Profile network calls — the GPU idles while the process waits on HTTP/gRPC responses or remote data"
MEM_ALLOC = "Find the process allocating host memory during GPU work; allocate pinned buffers once instead of per step"
MEM_REDUCE = "Reduce host memory use (DataLoader workers x prefetch_factor, dataset caching) or add RAM"


@dataclass(frozen=True)
class Cause:
    family: str
    score: float
    strong: bool


def _lift_ok(
    ep_count: int, ep: Evidence, base: Evidence | None, base_count: int, ep_ns: int = 0, base_ns: int = 0
) -> bool:
    """Is the evidence denser (by count, or by time/bytes) in the episode than in the baseline?"""
    if base is None or base.buckets < 3:
        return True
    if ep.per_s(ep_count) >= LIFT * base.per_s(base_count):
        return True
    return ep_ns > 0 and ep.per_s(ep_ns) >= LIFT * base.per_s(base_ns)


def io_family(ev: Evidence) -> str:
    if ev.io_writes > ev.io_reads:
        return "io-write"
    if ev.io_reads > ev.io_writes:
        return "io-read"
    return "io"


def assess(ep: Evidence, base: Evidence | None, op_p99_ns: float) -> list[Cause]:
    """Corroborated causes in an episode, strongest first.

    CPU contention needs measured overlap: on a tail episode, the GPU thread's involuntary off-CPU time
    inside its own slow calls (``slow_inv_ns``) as a share of their time; on a throughput drop, its
    involuntary off-CPU share of the window above the baseline. Voluntary sleeps never count; off-CPU
    time of unknown kind (recordings without prev_state) makes the ``offcpu`` family, said as unknown.
    """
    out: list[Cause] = []
    if ep.slow_ns > 0:
        inv = ep.slow_inv_ns / ep.slow_ns
        unk = ep.slow_unk_ns / ep.slow_ns
        if inv >= MIN_OVERLAP:
            out.append(Cause("cpu", inv, inv >= STRONG_OVERLAP))
        elif unk >= MIN_OVERLAP:
            out.append(Cause("offcpu", unk, False))
    else:
        b_off = base.offcpu_frac if base else 0.0
        score = ep.offcpu_frac - b_off
        if score >= MIN_OVERLAP and ep.offcpu_frac >= LIFT * b_off:
            out.append(Cause("cpu", score, score >= STRONG_OVERLAP))
        else:
            b_unk = base.frac(base.unknown_ns) if base else 0.0
            u = ep.frac(ep.unknown_ns) - b_unk
            if u >= MIN_OVERLAP and ep.frac(ep.unknown_ns) >= LIFT * b_unk:
                out.append(Cause("offcpu", u, False))
    b_io = base.io_frac if base else 0.0
    if (
        ep.io_n >= MIN_IO
        and (ep.io_frac >= 0.02 or ep.io_max_ns >= op_p99_ns / 10)
        and _lift_ok(ep.io_n, ep, base, base.io_n if base else 0, ep.io_ns, base.io_ns if base else 0)
    ):
        score = ep.io_frac - b_io
        if score > 0 or base is None:
            strong = ep.io_max_ns > 50 * NS_PER_MS or ep.io_ns > 2 * NS_PER_S or score >= STRONG_SHARE
            out.append(Cause(io_family(ep), max(score, 0.01), strong))
    if ep.page_bytes >= PAGE_BYTES and _lift_ok(
        ep.page_n, ep, base, base.page_n if base else 0, ep.page_bytes, base.page_bytes if base else 0
    ):
        rate = ep.page_bytes / GIB / max(ep.span_ns / NS_PER_S, 1e-9)
        out.append(Cause("memory", min(1.0, rate / 4), ep.page_bytes >= 4 * GIB))
    elif (ep.swap_max or 0) > 0 and (base is None or not (base.swap_max or 0)):
        out.append(Cause("memory", 0.03, False))
    if ep.tcp_n > MIN_TCP and _lift_ok(ep.tcp_n, ep, base, base.tcp_n if base else 0):
        out.append(Cause("network", min(1.0, ep.tcp_n / 50), ep.tcp_n > 50))
    elif (
        ep.net_n > MIN_NET_OPS
        and ep.net_bytes > MIN_NET_BYTES
        and _lift_ok(ep.net_n, ep, base, base.net_n if base else 0, ep.net_bytes, base.net_bytes if base else 0)
    ):
        out.append(Cause("network", min(1.0, ep.net_n / 2000), False))
    out.sort(key=lambda c: c.score, reverse=True)
    return out


def severity_of_loss(lost_ns: float, wall_ns: float, *, may_be_sleep: bool = False) -> str:
    """Severity from time lost as a share of wall time: HIGH ≥ 20 %, MEDIUM ≥ 5 %, else LOW (see
    :func:`worth_a_chain` for the floor). ``may_be_sleep``: the loss is off-CPU time of unknown kind
    on threads whose wakeups are not recorded — without prev_state and without wakeups nobody can say
    whether the thread was preempted or asleep by itself (a healthy job's ranks that sleep in their
    collectives look the same), so it is never more than LOW. Where the wakeups are recorded the sleeps
    are taken out of it (:class:`~ingero.explain.offcpu.OffCpu`) and what is left is graded by its loss."""
    share = lost_ns / wall_ns if wall_ns > 0 else 0.0
    if may_be_sleep:
        return "LOW"
    if share >= HIGH_SHARE:
        return "HIGH"
    if share >= MEDIUM_SHARE:
        return "MEDIUM"
    return "LOW"


def may_be_sleep(family: str, tids: npt.NDArray[np.int64], woken: frozenset[int]) -> bool:
    """Off-CPU time of unknown kind (``family`` ``offcpu``) on threads some of which have no recorded
    wakeup may be their own sleeps: :func:`severity_of_loss`'s ``may_be_sleep``."""
    return family == "offcpu" and not set(np.unique(tids).tolist()) <= woken


def startup_severity(lost_ns: float, wall_ns: float) -> str:
    """One-off start-up costs (first launches, module loading, first allocations): LOW unless they
    exceed :data:`STARTUP_SHARE` of the run."""
    return "HIGH" if wall_ns > 0 and lost_ns / wall_ns > STARTUP_SHARE else "LOW"


def worth_a_chain(lost_ns: float, wall_ns: float) -> bool:
    """A loss of at least :data:`LOW_SHARE` of wall time makes a chain."""
    return wall_ns > 0 and lost_ns / wall_ns >= LOW_SHARE


@dataclass(frozen=True)
class Shares:
    """Where the time lost in a set of slow calls went, measured per call on the calling thread:
    each part is ``Σ min(excess, overlap)`` of the call's excess over steady and its overlap with the
    thread's involuntary, voluntary, unknown off-CPU time, or the traced tree's block I/O in flight."""

    lost_ns: int
    inv_ns: int = 0
    vol_ns: int = 0
    unk_ns: int = 0
    io_ns: int = 0

    def share(self, ns: int) -> float:
        return min(1.0, ns / self.lost_ns) if self.lost_ns > 0 else 0.0

    def of(self, family: str) -> float | None:
        """The measured share of a cause family; None for families with no time measure."""
        if family == "cpu":
            return self.share(self.inv_ns)
        if family == "offcpu":
            return self.share(self.unk_ns)
        if family.startswith("io"):
            return self.share(self.io_ns)
        return None

    def words(self) -> str:
        parts = [
            (self.inv_ns, "preempted or in the run queue"),
            (self.vol_ns, "asleep by itself (waiting)"),
            (self.unk_ns, "off-CPU of unknown kind"),
            (self.io_ns, "with block I/O in flight"),
        ]
        said = [f"{100 * self.share(ns):.0f}% {w}" for ns, w in parts if self.share(ns) >= 0.005]
        rest = 1.0 - min(1.0, sum(self.share(ns) for ns, _ in parts[:3]))
        if rest >= 0.005:
            said.append(f"{100 * rest:.0f}% with the thread on-CPU or waiting on the GPU")
        return ", ".join(said)


def dominant(found: list[Cause], shares: Shares) -> list[Cause]:
    """``found`` with its root first, or [] when no cause holds the dominant share of the lost time.

    A cause with a time measure (CPU contention: involuntary off-CPU; off-CPU of unknown kind; block
    I/O) is the root only with ≥ :data:`DOMINANT` of the lost time; the others stay as context. A cause
    with no time measure (memory pressure, the network) is the root only when no measured share says
    the time went elsewhere (preempted or off-CPU for most of it)."""
    measured = [c for c in found if (shares.of(c.family) or 0.0) >= DOMINANT]
    if measured:
        root = max(measured, key=lambda c: shares.of(c.family) or 0.0)
    else:
        rest = [c for c in found if shares.of(c.family) is None]
        if not rest or max(shares.share(shares.inv_ns), shares.share(shares.unk_ns)) >= DOMINANT:
            return []
        root = rest[0]
    return [root, *(c for c in found if c is not root)]


def phrase(c: Cause, ep: Evidence) -> str:
    """Short form for summaries: '847 sched_switch events (12.1s off-CPU)'."""
    if c.family == "cpu":
        if ep.slow_ns:
            return (
                f"CPU preemption: GPU thread preempted for {100 * ep.slow_inv_ns / ep.slow_ns:.0f}% of the time its "
                f"slow calls lost ({fmt_duration(round_ms(ep.slow_inv_ns))} involuntary)"
            )
        return f"CPU preemption: GPU thread involuntarily off-CPU {100 * ep.offcpu_frac:.0f}% of the window"
    if c.family == "offcpu":
        share = ep.slow_unk_ns / ep.slow_ns if ep.slow_ns else ep.frac(ep.unknown_ns)
        return f"GPU thread off-CPU {100 * share:.0f}% of the time lost (preempted or waiting: unknown)"
    if c.family.startswith("io"):
        kind = {"io-write": "write-heavy", "io-read": "read-heavy"}.get(c.family, "heavy")
        return f"{kind} block I/O ({ep.io_n} ops, {ep.io_writes} writes, {ep.io_reads} reads)"
    if c.family == "memory":
        if ep.page_bytes >= PAGE_BYTES:
            return f"{ep.page_bytes / GIB:.1f} GB of page allocations"
        return "memory pressure"
    if ep.tcp_n > MIN_TCP:
        return f"{ep.tcp_n} TCP retransmits"
    return f"{ep.net_n} socket ops ({ep.net_bytes / MIB:.1f} MB)"


def round_ms(ns: float) -> float:
    return round(ns / NS_PER_MS) * NS_PER_MS if ns >= NS_PER_S else round(ns / 1000) * 1000


def root_cause(c: Cause, ep: Evidence, subject: str, culprits: list[Culprit]) -> str:
    """One sentence naming the cause, with its numbers. ``subject`` names the affected process(es)."""
    pct = f"{100 * ep.offcpu_frac:.0f}%"
    if c.family == "cpu":
        started = [c.name for c in culprits if not c.preemptions and not c.ns]
        named = [c for c in culprits if c.preemptions or c.ns]
        who = "; preempted by " + "; ".join(x.clause() for x in named) if named else ""
        if started:
            who += f"; {', '.join(started)} started just before"
        if ep.slow_ns:
            return (
                f"CPU contention — the GPU thread of {subject} was off-CPU, preempted, for {100 * ep.slow_inv_ns / ep.slow_ns:.0f}% "
                f"of the time its slow calls lost ({fmt_duration(round_ms(ep.slow_inv_ns))} preempted or runnable in "
                f"the run queue, measured on its own sched_switch rows){who}"
            )
        return (
            f"CPU contention — the GPU thread of {subject} was involuntarily off-CPU {pct} of the window "
            f"({fmt_duration(round_ms(ep.offcpu_ns))}, measured on its own sched_switch rows){who}"
        )
    if c.family == "offcpu":
        share = ep.slow_unk_ns / ep.slow_ns if ep.slow_ns else ep.frac(ep.unknown_ns)
        return (
            f"off-CPU time of unknown kind — the GPU thread of {subject} was off-CPU {100 * share:.0f}% of the time lost; "
            "this recording has no prev_state, so whether it was preempted (CPU contention) or waiting "
            "(sleep, I/O, a lock) is unknown"
        )
    if c.family == "io-write":
        return (
            f"write-heavy block I/O (checkpoint saves) — {ep.io_writes} writes ({ep.io_bytes / MIB:.1f} MB, "
            f"peak {fmt_duration(ep.io_max_ns)}) competed with {subject}"
        )
    if c.family == "io-read":
        return (
            f"read-heavy block I/O (DataLoader reading from disk) — {ep.io_reads} reads ({ep.io_bytes / MIB:.1f} MB, "
            f"peak {fmt_duration(ep.io_max_ns)}) stalled {subject}"
        )
    if c.family == "io":
        return f"heavy block I/O — {ep.io_n} ops ({fmt_duration(ep.io_ns)} of device time) stalled {subject}"
    if c.family == "memory":
        if ep.page_bytes >= PAGE_BYTES:
            return f"host memory pressure — {ep.page_bytes / GIB:.1f} GB of page allocations ({ep.page_n} events)"
        return "host memory pressure — " + ", ".join(_pressure_words(ep))
    if ep.tcp_n > MIN_TCP:
        return f"network packet loss — {ep.tcp_n} TCP retransmits while {subject} waited on the network"
    return f"network I/O — {ep.net_n} socket ops ({ep.net_bytes / MIB:.1f} MB) while {subject} waited"


def _pressure_words(ep: Evidence) -> list[str]:
    words = []
    if ep.mem_max is not None and ep.mem_max > 95:
        words.append(f"memory {ep.mem_max:.0f}% used")
    if ep.swap_max:
        words.append(f"{ep.swap_max:.0f} MB swap in use")
    return words or ["memory pressure"]


def recommendations(causes: list[Cause], ep: Evidence) -> list[str]:
    recs: list[str] = []
    for c in causes:
        if c.family == "cpu":
            recs += [PIN, NICE]
        elif c.family == "offcpu":
            recs.append(
                "Record with ingero trace (it stores prev_state and the preempting task) to tell preemption from waiting"
            )
        elif c.family.startswith("io"):
            recs.append({"io-write": CHECKPOINT, "io-read": DATALOADER}.get(c.family, MIXED_IO))
            if ep.io_max_ns > 20 * NS_PER_MS:
                recs.append(
                    f"Block I/O peak latency {fmt_duration(round_ms(ep.io_max_ns))} suggests a spinning disk or "
                    "network storage — local NVMe brings it under 1 ms"
                )
        elif c.family == "memory":
            recs.append(MEM_ALLOC if ep.page_bytes >= PAGE_BYTES else MEM_REDUCE)
        elif c.family == "network":
            recs += [NET_HEALTH, NCCL_NET] if ep.tcp_n > MIN_TCP else [SOCKET]
    if (ep.swap_max or 0) > 0:
        recs.append(
            f"Swap in use ({ep.swap_max:.0f} MB): CUDA calls stall on page faults — add RAM or reduce host memory use"
        )
    elif ep.mem_max is not None and ep.mem_max > 95 and MEM_REDUCE not in recs:
        recs.append(MEM_REDUCE)
    seen: set[str] = set()
    return [r for r in recs if not (r in seen or seen.add(r))]  # type: ignore[func-returns-value]


def timeline(causes: list[Cause], ep: Evidence, culprits: list[Culprit]) -> list[TimelineEntry]:
    """SYSTEM / HOST / IO / NET entries for the evidence (the GPU op's own entry is added by the rule)."""
    out: list[TimelineEntry] = []
    if ep.cpu_max is not None and ep.cpu_max > 90:
        load = f", load {ep.load_max:.1f}" if ep.load_max else ""
        out.append(TimelineEntry("SYSTEM", "cpu", f"CPU {ep.cpu_max:.0f}%{load}"))
    if ep.mem_max is not None and ep.mem_max > 95:
        avail = f" ({ep.avail_min:.0f} MB available)" if ep.avail_min is not None else ""
        out.append(TimelineEntry("SYSTEM", "memory", f"memory {ep.mem_max:.0f}%{avail}"))
    if (ep.swap_max or 0) > 0:
        out.append(TimelineEntry("SYSTEM", "swap", f"swap {ep.swap_max:.0f} MB in use"))
    families = {c.family for c in causes}
    for c in culprits:
        if c.ns:
            out.append(TimelineEntry("HOST", "preemption", f"{c.name} ran in its place for {c.ns / 1e6:.0f} ms"))
        elif c.preemptions:
            out.append(TimelineEntry("HOST", "preemption", f"{c.name} ran in its place {c.preemptions} times"))
        else:
            out.append(TimelineEntry("HOST", "process_exec", f"{c.name} started"))
    if "cpu" in families:
        inv = ep.slow_inv_ns if ep.slow_ns else ep.offcpu_ns
        out.append(
            TimelineEntry(
                "HOST",
                "sched_switch",
                f"GPU thread involuntarily off-CPU {fmt_duration(round_ms(inv))}"
                + (f" of {fmt_duration(round_ms(ep.slow_ns))} lost in slow calls" if ep.slow_ns else "")
                + (f" (+{fmt_duration(round_ms(ep.slow_vol_ns))} asleep by itself)" if ep.slow_vol_ns else ""),
                int(inv // 1000),
            )
        )
    if "offcpu" in families:
        out.append(TimelineEntry("HOST", "sched_switch", "off-CPU, kind unknown (no prev_state recorded)"))
    if "memory" in families and ep.page_bytes:
        out.append(TimelineEntry("HOST", "mm_page_alloc", f"{ep.page_n} allocations ({ep.page_bytes / GIB:.1f} GB)"))
    if families & {"io", "io-read", "io-write"}:
        detail = (
            f"{ep.io_n} I/O ops ({ep.io_reads} reads, {ep.io_writes} writes), {fmt_duration(round_ms(ep.io_ns))} total"
        )
        if ep.io_bytes:
            detail += f", {ep.io_bytes / MIB:.1f} MB"
        detail += f", peak {fmt_duration(round(ep.io_max_ns / 1000) * 1000)}"
        out.append(TimelineEntry("IO", "block_io", detail, int(ep.io_ns // 1000)))
    if "network" in families:
        if ep.tcp_n:
            out.append(TimelineEntry("NET", "tcp_retransmit", f"{ep.tcp_n} retransmits"))
        if ep.net_n:
            out.append(TimelineEntry("NET", "socket_io", f"{ep.net_n} socket ops ({ep.net_bytes / MIB:.1f} MB)"))
    return out


def evidence_figures(ep: Evidence, base: Evidence | None) -> dict[str, object]:
    """A window's host evidence as a chain's figures (and its baseline's, with one)."""
    d: dict[str, object] = {
        "sched_switch": ep.sched_n,
        "offcpu_ms": round(ep.offcpu_ns / 1e6, 1),
        "offcpu_share": round(ep.offcpu_frac, 3),
        "block_io": ep.io_n,
        "block_reads": ep.io_reads,
        "block_writes": ep.io_writes,
        "block_io_ms": round(ep.io_ns / 1e6, 1),
        "block_io_peak_ms": round(ep.io_max_ns / 1e6, 2),
        "block_io_mb": round(ep.io_bytes / MIB, 1),
        "page_alloc_gb": round(ep.page_bytes / GIB, 2),
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


def mechanism(family: str, op: str) -> str:
    """How a cause family slows the calls of ``op``: a chain's closing sentence."""
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
