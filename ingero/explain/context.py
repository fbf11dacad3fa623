"""What every rule sees about one node (or one process of a node): rows, grid, host evidence, names."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingero.explain.evidence import Grid, HostSeries
from ingero.explain.frame import I64, Frame, distinct, member
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, SCHED_SWITCH, OffCpu
from ingero.explain.stats import OpStats
from ingero.store.catalog import DRIVER, op_ids
from ingero.timeutil import NS_PER_S, fmt_duration

CULPRIT_LEAD_NS = 5 * NS_PER_S  # a process started this long before an episode may have caused it
PROCESS_STARTS = op_ids("process_exec", "process_fork")
MIN_PREEMPTIONS = 3  # a preemptor is named when it ran in the GPU process's place this often
PREEMPTOR_SHARE = 0.1  # ... and accounts for at least this share of the window's preemptions
# Kernel threads that run briefly between the real preemptor and the thread's return (sched_switch arg1
# names whoever ran just before): softirq, migration, RCU, workqueues. Never named as the culprit.
KERNEL_THREAD = re.compile(r"^(ksoftirqd|migration|rcu_|rcuc|kworker|cpuhp|watchdog|idle_inject|irq/|kthreadd|swapper)")


@dataclass(frozen=True)
class Culprit:
    """A process blamed for CPU contention: it preempted the GPU process, or started just before."""

    name: str  # "pid 5150 (stress-ng --cpu 16)"
    preemptions: int = 0  # 0: named because it started just before the trouble
    ns: int = 0  # measured: time it ran in the GPU thread's place inside the slow calls

    def clause(self) -> str:
        if self.ns:
            return f"{self.name}, which ran in its place for {self.ns / 1e6:.0f} ms"
        if self.preemptions:
            return f"{self.name} ran in its place {self.preemptions} times"
        return f"{self.name} started just before"


@dataclass
class OpRows:
    """The calls of one GPU op in a context."""

    stats: OpStats
    ts_ns: I64
    dur: I64
    pid: I64
    tid: I64


@dataclass
class Context:
    node: str
    frame: Frame  # all rows of the node loaded for this explain (host rows node-wide)
    gpu: Frame  # the GPU API rows this context explains (one process with per_process)
    grid: Grid
    series: HostSeries
    traced: I64  # pids whose sched_switch rows count as the GPU callers' off-CPU time
    names: dict[int, str]
    ops: list[OpStats]  # GPU API ops of this context
    pid: int | None = None  # set in per-process mode
    notes: list[str] = field(default_factory=list)
    offcpu: OffCpu | None = None  # per-thread off-CPU intervals of the node
    tree: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # GPU processes + forked children
    cpu_cores: int | None = None  # from the recording's sessions row
    _rows: dict[tuple[int, int], tuple[I64, I64, I64, I64]] = field(default_factory=dict, repr=False)

    @property
    def off(self) -> OffCpu:
        if self.offcpu is None:
            self.offcpu = OffCpu(self.frame.args)
        return self.offcpu

    def rows(self, st: OpStats) -> OpRows:
        return OpRows(st, *self.op_calls(st.source, st.op))

    def op_calls(self, source: int, op: int) -> tuple[I64, I64, I64, I64]:
        """ts, dur, pid and tid of the context's calls of one op, in the frame's order."""
        if not self._rows:
            self._group_rows()
        cached = self._rows.get((source, op))
        if cached is None:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z, z
        return cached

    def _group_rows(self) -> None:
        """Every op's calls at once (in the frame's order within an op): one stable counting sort by op
        instead of a pass over every GPU call per op."""
        g = self.gpu
        key = ((g.source & 0xF) << 8 | (g.op & 0xFF)).astype(np.uint16)  # frames hold masked ids
        order = np.argsort(key, kind="stable")  # a radix sort for 16-bit keys
        k = key[order]
        cut = np.flatnonzero(k[1:] != k[:-1]) + 1
        ts, dur, pid, tid = g.ts_ns[order], g.dur[order], g.pid[order], g.tid[order]
        for lo, hi in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [k.size])).tolist(), strict=True):
            if hi > lo:
                kk = int(k[lo])
                self._rows[(kk >> 8, kk & 0xFF)] = (ts[lo:hi], dur[lo:hi], pid[lo:hi], tid[lo:hi])

    def arg0_of(self, rows: OpRows) -> I64 | None:
        """``arg0`` of each call in ``rows`` (bytes of a copy, the kernel function of a launch), aligned
        with them; None when the recording has no such argument rows for the op."""
        a = self.frame.args
        st = rows.stats
        pids = distinct(rows.pid)
        k = (a.source == st.source) & (a.op == st.op) & member(a.pid, pids)
        if int(k.sum()) != rows.ts_ns.size or rows.ts_ns.size == 0:
            return None
        out = np.zeros(rows.ts_ns.size, dtype=np.int64)
        for p in pids.tolist():
            mine = np.flatnonzero(rows.pid == p)
            theirs = np.flatnonzero(k & (a.pid == p))
            if mine.size != theirs.size:
                return None
            out[mine[np.argsort(rows.ts_ns[mine], kind="stable")]] = a.arg0[
                theirs[np.argsort(a.ts_ns[theirs], kind="stable")]
            ]
        return out

    def preemptors(self, tids: I64, a: I64, b: I64, limit: int = 3) -> list[Culprit]:
        """Who ran in the GPU threads' place during the calls [a, b): measured involuntary off-CPU time
        per preemptor (ingero's sched_switch arg1), largest first; the traced threads themselves and
        the idle task are left out."""
        own = set(np.unique(tids).tolist())
        by = {
            w: ns
            for w, ns in self.off.by_who(INVOL, tids, a, b).items()
            if w not in own and w != 0 and not KERNEL_THREAD.match(self.names.get(w, ""))
        }
        total = sum(by.values())
        out: list[Culprit] = []
        for who, ns in sorted(by.items(), key=lambda x: -x[1]):
            if ns < PREEMPTOR_SHARE * total:
                continue
            out.append(Culprit(self.proc(who), 1, ns))
            if len(out) == limit:
                break
        return out

    def proc(self, pid: int) -> str:
        name = self.names.get(pid)
        return f"pid {pid} ({name})" if name else f"pid {pid}"

    def subject(self, pids: I64 | None = None) -> str:
        """Words for the process(es) calling the GPU: 'the GPU process (pid 4242, python3)'."""
        pids = np.unique(self.traced if pids is None else pids)
        if pids.size == 1:
            p = int(pids[0])
            name = self.names.get(p)
            return f"the GPU process (pid {p}{', ' + name if name else ''})"
        shown = ", ".join(str(int(p)) for p in pids[:4])
        return f"the GPU processes (pids {shown}{', ...' if pids.size > 4 else ''})"

    def chain_id(self, kind: str, *parts: str) -> str:
        desc = "-".join([kind, *[p for p in parts if p]])
        if self.pid is not None:
            desc += f"-pid{self.pid}"
        return f"{self.node}:{desc}"

    def culprits(self, start_ns: int, end_ns: int, limit: int = 3) -> list[Culprit]:
        """Who took the CPU from the GPU process in [start, end].

        Best evidence first: the tasks that ran in the traced threads' place (sched_switch ``arg1``,
        recorded by ingero's tracer), when some account for a real share of the preemptions; else
        processes (not the traced ones) that started shortly before or during the window.
        """
        a = self.frame.args
        m = a.is_op(SCHED_SWITCH) & (a.ts_ns >= start_ns) & (a.ts_ns <= end_ns) & np.isin(a.pid, self.traced)
        out: list[Culprit] = []
        if m.any():
            tids, counts = np.unique(a.arg1[m], return_counts=True)
            floor = max(MIN_PREEMPTIONS, PREEMPTOR_SHARE * int(counts.sum()))
            for i in np.argsort(-counts, kind="stable"):
                tid, n = int(tids[i]), int(counts[i])
                if n < floor:
                    break
                if tid in self.traced:
                    continue
                out.append(Culprit(self.proc(tid), n))
                if len(out) == limit:
                    return out
        if out:
            return out
        m = (
            a.is_any(PROCESS_STARTS)
            & (a.ts_ns >= start_ns - CULPRIT_LEAD_NS)
            & (a.ts_ns <= end_ns)
            & ~np.isin(a.pid, self.traced)
        )
        for p in dict.fromkeys(int(x) for x in a.pid[m]):
            out.append(Culprit(self.proc(p)))
            if len(out) == limit:
                break
        return out

    def chain(
        self,
        *,
        cid: str,
        detected_at: int,
        severity: str,
        summary: str,
        root_cause: str,
        explanation: str,
        recommendations: list[str],
        family: str,
        evidence: dict[str, Any],
        timeline: list[TimelineEntry],
        st: OpStats | None = None,
    ) -> Chain:
        ev = {"node": self.node, **({"pid": self.pid} if self.pid is not None else {}), **evidence}
        return Chain(
            id=cid,
            node=self.node,
            detected_at=int(detected_at),
            severity=severity,
            summary=summary,
            root_cause=root_cause,
            explanation=explanation,
            recommendations=recommendations,
            cuda_op=st.name if st else "",
            cuda_p99_us=round(st.p99_ns / 1000) if st else 0,
            cuda_p50_us=round(st.p50_ns / 1000) if st else 0,
            tail_ratio=round(st.tail_ratio, 1) if st else 0.0,
            timeline=timeline,
            origin="computed",
            family=family,
            evidence=ev,
        )


def layer_of(source: int) -> str:
    return "DRIVER" if source == DRIVER else "CUDA"


def us(ns: float) -> float:
    return round(float(ns) / 1000, 1)


def fmt_ns(ns: float) -> str:
    """A duration rounded to the microsecond: 58.475ms, 14µs."""
    return fmt_duration(round(ns / 1000) * 1000 if ns >= 1000 else ns)


def short_ns(ns: float) -> str:
    """Three significant digits: 2.54s, 41.2ms, 734µs."""
    if ns <= 0:
        return "0s"
    step = 10 ** max(0, int(np.floor(np.log10(ns))) - 2)
    return fmt_duration(round(ns / step) * step)
