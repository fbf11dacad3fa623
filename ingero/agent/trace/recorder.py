"""From decoded BPF events to database rows: timestamps, selective storage, aggregates, stacks, names.

Selective storage (``--store selective``, the default) keeps the database useful at GPU event rates:

* stored individually, always: every event of the ops that explain causes — allocations, frees,
  synchronous copies, synchronizations, NCCL collectives, ``sched_switch``, process lifecycle, OOM,
  block I/O, TCP retransmissions — and every call that returned an error;
* high-rate ops (:data:`BULK_OPS`: kernel launches, async copies, ``sched_wakeup``): the first
  ``budget`` per second per (pid, op), then an evenly spaced sample (every k-th call, k set from the
  previous second's rate and doubling with every further ``budget`` calls within the second), so
  stored rows keep the latency distribution at roughly two budgets' worth of rows per second;
* everything — stored or not — is counted in ``event_aggregates`` (per minute, source, op and pid:
  count, stored, sum/min/max duration, sum of byte counts), so totals stay exact.

``--store all`` stores every event. Page allocations never reach the ring buffer: the kernel counts
them per process, and :meth:`Recorder.page_alloc_rows` turns each second's increase into one summary
row (``mm_page_alloc``: duration = the interval, arg0 = bytes, arg1 = allocations) plus aggregates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ingero.agent.trace import discovery
from ingero.agent.trace.nccl_calls import NcclCalls
from ingero.agent.trace.stacks import Symbolizer, stack_hash, stack_row
from ingero.store import catalog
from ingero.store.schema import AGGREGATE_BUCKET_NS
from ingero.timeutil import now_ns

NS_PER_S = 1_000_000_000
NS_PER_MIN = AGGREGATE_BUCKET_NS  # event_aggregates' buckets
OP_NCCL_COMM_INIT = catalog.NCCL_COMM_INIT_OP  # control records (op >= this) are never events
INT64_MAX = (1 << 63) - 1


def _op(name: str) -> tuple[int, int]:
    ref = catalog.lookup_op(name)
    return ref.source, ref.op


PAGE_ALLOC = _op("mm_page_alloc")
PROCESS_EXEC = _op("process_exec")
BULK_OPS = frozenset(
    _op(n) for n in ("cudaLaunchKernel", "cudaMemcpyAsync", "cuLaunchKernel", "cuMemcpyAsync", "sched_wakeup")
) | frozenset(  # tracer breadth: async copies/memsets, event polling, graph launches, socket I/O
    _op(n)
    for n in (
        "cudaMemcpy2DAsync",
        "cudaMemcpyPeerAsync",
        "cudaMemsetAsync",
        "cudaEventQuery",
        "cudaGraphLaunch",
        "net_send",
        "net_recv",
    )
)
# Ops whose arg0 is a byte count (summed into event_aggregates.sum_arg0).
BYTES_OPS = frozenset(
    _op(n)
    for n in (
        "cudaMalloc",
        "cudaMemcpy",
        "cudaMemcpyAsync",
        "cudaMallocManaged",
        "cuMemcpy",
        "cuMemcpyAsync",
        "cuMemAlloc",
        "cuMemAllocManaged",
        "mm_page_alloc",
        "block_read",
        "block_write",
        "block_discard",
        "ncclAllReduce",
        "ncclBroadcast",
        "ncclReduce",
        "ncclAllGather",
        "ncclReduceScatter",
        "ncclSend",
        "ncclRecv",
        "cudaMemcpy2D",
        "cudaMemcpy2DAsync",
        "cudaMemcpyPeer",
        "cudaMemcpyPeerAsync",
        "cudaMemset",
        "cudaMemsetAsync",
        "cudaHostAlloc",
        "cudaMallocHost",
        "cudaMallocAsync",
        "net_send",
        "net_recv",
    )
)
# Lookup tables indexed by source << 8 | op: one gather per batch instead of a set test per event.
_BULK = np.zeros(1 << 16, dtype=bool)
_BULK[[s << 8 | o for s, o in BULK_OPS]] = True
_BYTES = np.zeros(1 << 16, dtype=bool)
_BYTES[[s << 8 | o for s, o in BYTES_OPS]] = True


def _group(key: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """(order, group starts) of equal keys; order None when every key is the same (the common case:
    one busy process calling one op through a whole drain)."""
    if key.size == 0 or (key[0] == key[-1] and bool((key == key[0]).all())):
        return None, np.zeros(1 if key.size else 0, dtype=np.int64)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    return order, np.concatenate(([0], np.flatnonzero(sk[1:] != sk[:-1]) + 1))


_NAME_SOURCES = (_op("sched_switch"), _op("sched_wakeup"))  # arg1 = another task's tid worth naming


@dataclass(frozen=True)
class StoragePolicy:
    mode: str = "selective"  # selective | all
    budget_per_s: int = 1000
    stack_samples: int = 0  # --stack-samples: distinct stacks kept per (pid, op); 0 = no limit


@dataclass
class WriteBatch:
    events: list[tuple[int, ...]] = field(default_factory=list)
    stacks: list[tuple[int, str, str]] = field(default_factory=list)
    aggregates: list[tuple[int, ...]] = field(default_factory=list)
    snapshots: list[tuple[int, float, float, int, int, float]] = field(default_factory=list)
    process_names: list[tuple[int, str, int]] = field(default_factory=list)
    nccl_comms: list[tuple[int, ...]] = field(default_factory=list)  # (comm, pid, rank, nranks, seen_at, comm_id)
    nccl_calls: list[tuple[int, ...]] = field(default_factory=list)  # see ingero.agent.trace.nccl_calls
    annotations: list[tuple[int | str, ...]] = field(default_factory=list)  # ingero.store.annotations.ROW_COLUMNS
    cgroups: list[tuple[int | str, ...]] = field(default_factory=list)  # ingero.store.cgroups.COLUMNS
    engine_metrics: list[tuple[int | str | float, ...]] = field(default_factory=list)  # store.engine_metrics

    def merge(self, other: WriteBatch) -> None:
        self.events += other.events
        self.stacks += other.stacks
        self.aggregates += other.aggregates
        self.snapshots += other.snapshots
        self.process_names += other.process_names
        self.nccl_comms += other.nccl_comms
        self.nccl_calls += other.nccl_calls
        self.annotations += other.annotations
        self.cgroups += other.cgroups
        self.engine_metrics += other.engine_metrics


@dataclass
class _Budget:
    second: int = -1
    count: int = 0
    stride: int = 1


def monotonic_offset_ns() -> int:
    """wall clock - CLOCK_MONOTONIC (what bpf_ktime_get_ns reads)."""
    return time.time_ns() - time.monotonic_ns()


class Recorder:
    """Turns event arrays (``ringbuf.EVENT_DTYPE``) into :class:`WriteBatch` rows. One thread at a time."""

    def __init__(
        self,
        policy: StoragePolicy,
        stack_ips: Callable[[int], list[int]],
        *,
        symbolizer: Symbolizer | None = None,
        comm_of: Callable[[int], str] = discovery.read_comm,
    ) -> None:
        self.policy = policy
        self._stack_ips = stack_ips
        self._symbolizer = symbolizer or Symbolizer()
        self._comm_of = comm_of
        self._budgets: dict[int, _Budget] = {}
        self._stack_hashes: dict[int, int] = {}  # kernel stack id -> stack_traces.hash
        self._stacks_per_op: dict[int, int] = {}  # pid << 16 | source << 8 | op -> distinct stacks kept
        self.stacks_over_limit = 0  # stored events left without a stack by --stack-samples
        self._named: set[int] = set()
        self._page_allocs: dict[int, tuple[int, int]] = {}
        self._last_page_ns = now_ns()
        self.seen = 0
        self.stored = 0
        self.control_records = 0
        self.by_op: dict[tuple[int, int], int] = {}
        self.nccl = NcclCalls()

    # --- events ----------------------------------------------------------------------------------

    def exec_names(self, ev: np.ndarray) -> dict[int, str]:
        """pid -> name of the processes that exec'd in ``ev``, read now, while they most likely live (the
        drain's thread: no state is touched). :meth:`process` takes them for its ``process_names`` rows
        when the batch is written later, so a short-lived command is named as when it was written at once."""
        execs = (ev["source"] == PROCESS_EXEC[0]) & (ev["op"] == PROCESS_EXEC[1])
        if not execs.any():
            return {}
        return {pid: self._comm_of(pid) for pid in np.unique(ev["pid"][execs]).tolist() if pid > 0}

    def prime_stacks(self, ev: np.ndarray) -> None:
        """Read the maps of the processes with stacks in ``ev`` that the symbolizer does not know yet, now
        (the drain's or the ring watch's thread): a short run has often exited by the time its batch is written."""
        with_stack = ev["stack_id"] >= 0
        if with_stack.any():
            for pid in np.unique(ev["pid"][with_stack]).tolist():
                self._symbolizer.prime(pid)

    def process(self, ev: np.ndarray, offset_ns: int | None = None, names: dict[int, str] | None = None) -> WriteBatch:
        """Rows for ``ev``; ``names``: names already read (:meth:`exec_names`), used before /proc."""
        out = WriteBatch()
        if ev.size == 0:
            return out
        control = ev["op"] >= OP_NCCL_COMM_INIT
        if control.any():
            self._control(ev[control], out, monotonic_offset_ns() if offset_ns is None else offset_ns)
            ev = ev[~control]
        nccl = ev["source"] == catalog.NCCL
        if nccl.any():
            out.nccl_calls = self.nccl.returned(ev[nccl])
        out.nccl_calls += self.nccl.in_flight()
        if ev.size == 0:
            return out
        offset = monotonic_offset_ns() if offset_ns is None else offset_ns
        ts = ev["ts"].astype(np.int64) + offset
        code = ev["source"].astype(np.int64) << 8 | ev["op"]
        store = self._store_mask(ev, ts, code)
        self.seen += ev.size
        n_stored = int(store.sum())
        self.stored += n_stored
        out.aggregates = self._aggregates(ev, ts, code, store)
        for row in out.aggregates:
            key = (row[1], row[2])
            self.by_op[key] = self.by_op.get(key, 0) + row[4]
        if n_stored:
            kept = ev[store]
            hashes = self._stack_column(kept, out)
            cols = np.empty((kept.size, 12), dtype=np.int64)
            cols[:, 0] = ts[store]
            cols[:, 1] = kept["pid"]
            cols[:, 2] = kept["tid"]
            cols[:, 3] = kept["source"]
            cols[:, 4] = kept["op"]
            cols[:, 5] = kept["duration"].astype(np.int64)
            cols[:, 6] = 0  # gpu_id: not known from the call
            cols[:, 7] = kept["arg0"].astype(np.int64)
            cols[:, 8] = kept["arg1"].astype(np.int64)
            cols[:, 9] = kept["ret"]
            cols[:, 10] = hashes
            cols[:, 11] = kept["cgroup_id"].astype(np.int64)
            out.events = list(map(tuple, cols.tolist()))
            self._names(kept, out, names or {})
        return out

    def _store_mask(self, ev: np.ndarray, ts: np.ndarray, code: np.ndarray) -> np.ndarray:
        n = ev.size
        if self.policy.mode == "all":
            everything: np.ndarray = np.ones(n, dtype=bool)
            return everything
        bulk = _BULK[code] & (ev["ret"] == 0)
        store: np.ndarray = ~bulk
        idx = np.flatnonzero(bulk)
        if idx.size == 0:
            return store
        budget = self.policy.budget_per_s
        sec = ts[idx] // NS_PER_S
        key = ev["pid"][idx].astype(np.int64) << 16 | code[idx]
        # One group per (pid, op, second); within a group, calls keep their drain order.
        order, starts = _group(key << 8 | (sec - sec.min()))  # a drain spans far less than 256 s
        if order is not None:
            idx, sec, key = idx[order], sec[order], key[order]
        ends = np.append(starts[1:], idx.size)
        for a, z in zip(starts.tolist(), ends.tolist(), strict=True):
            k, sc = int(key[a]), int(sec[a])
            b = self._budgets.setdefault(k, _Budget())
            if b.second != sc:
                b.stride = max(1, b.count // budget) if b.second == sc - 1 else 1
                b.second, b.count = sc, 0
            store[idx[a:z]] = self._sample(b, z - a, budget)
            b.count += z - a
        return store

    @staticmethod
    def _sample(b: _Budget, m: int, budget: int) -> np.ndarray:
        """Which of the next ``m`` calls of a (pid, op) in this second to store.

        The first ``budget`` calls of the second, then every k-th: k is the previous second's rate
        divided by the budget, and at least 2, 4, 8, ... as this second's count passes 1, 2, 4, ...
        budgets (a burst in the very first second stays bounded too). O(stored), not O(calls).
        """
        sel = np.zeros(m, dtype=bool)
        base = b.count
        sel[: max(0, min(m, budget - base))] = True
        p = max(base, budget)
        while p < base + m:
            j = (p // budget).bit_length() - 1
            end = min(budget << (j + 1), base + m)
            stride = max(b.stride, 2 << j)
            first = -(-p // stride) * stride
            sel[first - base : end - base : stride] = True
            p = end
        return sel

    def _aggregates(self, ev: np.ndarray, ts: np.ndarray, code: np.ndarray, store: np.ndarray) -> list[tuple[int, ...]]:
        minute = ts // NS_PER_MIN
        pid = ev["pid"].astype(np.int64)
        # minute (< 2^25 until 2033) | op code (16 bits) | pid (22 bits): one sortable key
        order, starts = _group(minute << 38 | code << 22 | pid)
        if order is None:  # one (minute, op, pid): no sorting, no copies
            c = int(code[0])
            d = ev["duration"]
            nb = int(ev["arg0"].sum(dtype=np.uint64)) if _BYTES[c] else 0
            row = (int(minute[0]) * NS_PER_MIN, c >> 8, c & 0xFF, int(pid[0]), int(d.size), int(store.sum()))
            return [(*row, int(d.sum(dtype=np.uint64)), int(d.min()), int(d.max()), min(nb, INT64_MAX))]
        dur = ev["duration"].astype(np.int64)
        nbytes = np.where(_BYTES[code], ev["arg0"], 0).astype(np.uint64)
        st = store.astype(np.int64)
        if order is not None:
            minute, code, pid, dur, nbytes, st = (
                minute[order],
                code[order],
                pid[order],
                dur[order],
                nbytes[order],
                st[order],
            )
        counts = np.diff(np.append(starts, minute.size))
        sums = np.add.reduceat(dur, starts)
        mins = np.minimum.reduceat(dur, starts)
        maxs = np.maximum.reduceat(dur, starts)
        stored = np.add.reduceat(st, starts)
        byte_sums = np.add.reduceat(nbytes, starts)
        rows: list[tuple[int, ...]] = []
        for i, s in enumerate(starts.tolist()):
            c = int(code[s])
            rows.append(
                (
                    int(minute[s]) * NS_PER_MIN,
                    c >> 8,
                    c & 0xFF,
                    int(pid[s]),
                    int(counts[i]),
                    int(stored[i]),
                    int(sums[i]),
                    int(mins[i]),
                    int(maxs[i]),
                    min(int(byte_sums[i]), INT64_MAX),
                )
            )
        return rows

    def _stack_column(self, kept: np.ndarray, out: WriteBatch) -> np.ndarray:
        ids = kept["stack_id"]
        hashes = np.zeros(kept.size, dtype=np.int64)
        with_stack = np.flatnonzero(ids >= 0)
        if with_stack.size == 0:
            return hashes
        for sid in np.unique(ids[with_stack]).tolist():
            h = self._stack_hashes.get(sid)
            if h is None and not self._stack_allowed(kept, ids, sid):
                continue
            if h is None:
                ips = self._stack_ips(sid)
                if ips:
                    first = int(np.flatnonzero(ids == sid)[0])
                    row = stack_row(int(kept["pid"][first]), ips, self._symbolizer, int(kept["tid"][first]))
                    out.stacks.append(row)
                    h = row[0]
                else:
                    h = 0
                self._stack_hashes[sid] = h
            if h:
                hashes[ids == sid] = h
        return hashes

    def _stack_allowed(self, kept: np.ndarray, ids: np.ndarray, sid: int) -> bool:
        """--stack-samples: may a new stack of the (pid, op) of ``sid``'s first event be kept?"""
        limit = self.policy.stack_samples
        if limit <= 0:
            return True
        first = int(np.flatnonzero(ids == sid)[0])
        key = int(kept["pid"][first]) << 16 | int(kept["source"][first]) << 8 | int(kept["op"][first])
        n = self._stacks_per_op.get(key, 0)
        if n >= limit:
            self.stacks_over_limit += int((ids == sid).sum())
            return False
        self._stacks_per_op[key] = n + 1
        return True

    def _names(self, kept: np.ndarray, out: WriteBatch, known: dict[int, str]) -> None:
        pids = set(np.unique(kept["pid"]).tolist())
        for s, o in _NAME_SOURCES:
            sel = (kept["source"] == s) & (kept["op"] == o)
            if sel.any():
                pids.update(np.unique(kept["arg1"][sel]).astype(np.int64).tolist())
        execs = (kept["source"] == PROCESS_EXEC[0]) & (kept["op"] == PROCESS_EXEC[1])
        renamed = set(np.unique(kept["pid"][execs]).tolist()) if execs.any() else set()
        now = now_ns()
        for pid in sorted(pids):
            if pid <= 0 or (pid in self._named and pid not in renamed):
                continue
            name = known.get(pid) or self._comm_of(int(pid))
            self._named.add(pid)
            if name:
                out.process_names.append((int(pid), name, now))

    def _control(self, ev: np.ndarray, out: WriteBatch, offset: int) -> None:
        self.control_records += ev.size
        for e in ev.tolist():
            # (ts, duration, arg0, arg1, cgroup_id, pid, tid, ret, stack_id, source, op, cpu, flags)
            if e[10] == OP_NCCL_COMM_INIT and e[2]:
                info = int(e[3])
                comm_id = catalog.as_sqlite_int(int(e[4]))  # cluster-wide id (0: unknown)
                out.nccl_comms.append(
                    (int(e[2]), int(e[5]), info & 0xFFFFFFFF, info >> 32, int(e[0]) + offset, comm_id)
                )
            elif e[10] == catalog.NCCL_CALL_ENTER_OP:
                self.nccl.enter(e, offset)

    # --- kernel-aggregated page allocations ------------------------------------------------------

    def page_alloc_rows(self, cumulative: dict[int, tuple[int, int]], ts: int | None = None) -> WriteBatch:
        """Summary rows for the allocations since the previous call (cumulative per-tgid counters)."""
        ts = now_ns() if ts is None else ts
        interval = max(0, ts - self._last_page_ns)
        self._last_page_ns = ts
        out = WriteBatch()
        bucket = ts // NS_PER_MIN * NS_PER_MIN
        for tgid, (count, nbytes) in sorted(cumulative.items()):
            last_count, last_bytes = self._page_allocs.get(tgid, (0, 0))
            if count < last_count:  # the kernel's counter restarted (the pid was reused)
                last_count, last_bytes = 0, 0
            self._page_allocs[tgid] = (count, nbytes)
            d_count, d_bytes = count - last_count, nbytes - last_bytes
            if d_count <= 0:
                continue
            self.seen += d_count
            self.by_op[PAGE_ALLOC] = self.by_op.get(PAGE_ALLOC, 0) + d_count
            if tgid:  # traced processes get a summary row; the rest of the host only aggregates
                out.events.append((ts, tgid, tgid, *PAGE_ALLOC, interval, 0, d_bytes, d_count, 0, 0, 0))
                self.stored += 1
            out.aggregates.append((bucket, *PAGE_ALLOC, tgid, d_count, 1 if tgid else 0, 0, 0, 0, d_bytes))
        return out

    def forget_pids(self, pids: list[int]) -> None:
        """Drop what is kept per process once it exited (called by the pipeline on process_exit):
        page-allocation baselines, symbol tables, the sampling budgets and the named-pid memo."""
        gone = set(pids)
        for pid in gone:
            self._page_allocs.pop(pid, None)
            self._symbolizer.forget(pid)
        self._named -= gone
        for key in [k for k in self._budgets if k >> 16 in gone]:
            del self._budgets[key]
        for key in [k for k in self._stacks_per_op if k >> 16 in gone]:
            del self._stacks_per_op[key]


__all__ = ["BULK_OPS", "Recorder", "StoragePolicy", "WriteBatch", "monotonic_offset_ns", "stack_hash"]
