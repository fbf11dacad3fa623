"""The explain engine: one call that turns a trace database into per-op statistics and causal chains.

``explain(conn, window, pid=, per_process=, node=)`` loads the window once (:mod:`ingero.explain.frame`),
then per node: per-op statistics, host evidence on a time grid, and the rules
(:mod:`ingero.explain.rules_latency`, :mod:`ingero.explain.rules_events`). Nodes are never mixed.
Chains are de-duplicated: one per (node, process, op, cause family), keeping the strongest evidence.

Used by ``ingero explain``, the agent API (``/api/v1/chains``, ``/api/v1/ops``), fleet explain, the
MCP server and ``ingero demo``.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingero.errors import StoreError
from ingero.explain import (
    rules_cold,
    rules_copies,
    rules_drift,
    rules_drop,
    rules_events,
    rules_graphs,
    rules_hang,
    rules_latency,
    rules_launch,
    rules_leak,
    rules_ledger,
    rules_memory,
    rules_periodic,
    rules_ranks,
    rules_ranks_fleet,
    rules_serving,
    serving_host,
)
from ingero.explain.cgroups import pid_cgroups, with_cgroups
from ingero.explain.context import Context
from ingero.explain.evidence import Grid, HostSeries, SnapRows, Snapshots, load_snapshots, snapshot_array
from ingero.explain.frame import GPU_SOURCES, Frame
from ingero.explain.frame_load import load_frames
from ingero.explain.ledger import LedgerRow, aggregate, build_ledger
from ingero.explain.model import Chain, sort_chains
from ingero.explain.offcpu import OffCpu
from ingero.explain.stats import HostSummary, OpStats, host_summary_from_columns, stats_from_columns
from ingero.explain.storage import Storage, aggregate_scopes, load_storage, with_true_counts
from ingero.explain.unstored import Unstored, load_unstored
from ingero.store.catalog import NCCL, op_id
from ingero.store.window import Window

PROCESS_FORK = op_id("process_fork")  # pid = parent, arg1 = child
EMPTY_HOST = HostSummary(0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0)


@dataclass
class ExplainReport:
    chains: list[Chain]
    ops: list[OpStats]
    host: HostSummary
    window: Window
    nodes: list[str]
    notes: list[str] = field(default_factory=list)
    hosts: dict[str, HostSummary] = field(default_factory=dict)  # per node
    events: int = 0
    first_ns: int | None = None
    last_ns: int | None = None
    elapsed_ms: float = 0.0
    ledger: list[LedgerRow] = field(default_factory=list)  # per GPU thread (ingero.explain.ledger)
    steps: list[rules_ranks_fleet.NodeSteps] = field(default_factory=list)  # per node, when asked

    def as_dict(self) -> dict[str, Any]:
        return {
            "window": self.window.as_dict(),
            "nodes": list(self.nodes),
            "events": self.events,
            "first_ns": self.first_ns,
            "last_ns": self.last_ns,
            "chains": [c.as_dict() for c in self.chains],
            "ops": [o.as_dict() for o in self.ops],
            "host": self.host.as_dict(),
            "hosts": {k: v.as_dict() for k, v in self.hosts.items()},
            "notes": list(self.notes),
            "ledger": [r.as_dict() for r in self.ledger],
            "ledger_processes": [r.as_dict() for r in aggregate(self.ledger, by_process=True)],
            "ledger_nodes": [r.as_dict() for r in aggregate(self.ledger, by_process=False)],
            "elapsed_ms": round(self.elapsed_ms, 1),
        }


def explain(
    conn: sqlite3.Connection,
    window: Window | None = None,
    *,
    pid: int | None = None,
    per_process: bool = False,
    node: str | None = None,
    threads: int = 1,
    steps: bool = False,
) -> ExplainReport:
    """Statistics and causal chains for ``window`` (every node, or ``node``; one process with ``pid``).

    ``threads`` > 1 reads a large database's events over that many connections at once (see
    :func:`~ingero.explain.frame.load_frames`: not for a connection with per-connection limits).
    ``steps``: the report carries each node's step-gap summary (what an agent sends a fleet explain to
    tell a late rank across nodes: :mod:`~ingero.explain.rules_ranks_fleet`)."""
    t_start = time.perf_counter()
    window = window or Window()
    try:
        frames = load_frames(conn, window, node=node, pid=pid, threads=threads)
        names = with_cgroups(_process_names(conn), pid_cgroups(conn, window, named_only=True))
        cores = _cpu_cores(conn)
        snap_rows = _snapshot_rows(conn, frames)
        # each node's own event_aggregates (none where they cannot be told apart: an older merge)
        scopes = aggregate_scopes(conn, list(frames))
        storage = {n: load_storage(conn, window, pid, by) for n, by in scopes.items()}
        unstored = {n: load_unstored(conn, window, pid, by) for n, by in scopes.items()}
    except sqlite3.Error as e:
        raise StoreError(f"cannot read the trace database: {e}") from None
    notes: list[str] = [window.note] if window.note else []
    chains: list[Chain] = []
    ops: list[OpStats] = []
    hosts: dict[str, HostSummary] = {}
    ledger: list[LedgerRow] = []
    summaries: list[rules_ranks_fleet.NodeSteps] | None = [] if steps or len(frames) > 1 else None
    for name, fr in frames.items():
        rows, snap_note = snap_rows.get(name, ([], None))
        if snap_note:
            notes.append(snap_note)
        c, o, h, n, led = _explain_node(
            fr,
            names,
            rows,
            pid=pid,
            per_process=per_process,
            cores=_cores_of(cores, name),
            storage=storage.get(name),
            unstored=unstored.get(name),
            summaries=summaries,
        )
        ledger += led
        chains += c
        ops += o
        hosts[name] = h
        notes += n
    chains = rules_ranks_fleet.late_ranks(summaries or [], chains)
    try:
        rules_leak.add_stacks(conn, chains, window)
        chains += rules_serving.serving_chains(conn, window, list(frames), node)
        chains, serving_notes = serving_host.serving_host_chains(conn, window, frames, ledger, chains, names)
        notes += serving_notes
        chains += rules_hang.hang_chains(conn, window, frames)
    except sqlite3.Error as e:
        raise StoreError(f"cannot read the trace database: {e}") from None
    if not frames:
        notes.append("no events in the window" + (f" for node {node}" if node else ""))
    report = ExplainReport(
        chains=cap_per_node(sort_chains(dedup(chains)), notes),
        ops=ops,
        host=hosts[next(iter(hosts))] if len(hosts) == 1 else _sum_hosts(list(hosts.values())),
        window=window,
        nodes=list(frames),
        notes=notes,
        hosts=hosts,
        events=sum(f.size for f in frames.values()),
        first_ns=min((f.first_ns for f in frames.values()), default=None),
        last_ns=max((f.last_ns for f in frames.values()), default=None),
        ledger=ledger,
        steps=summaries if steps and summaries else [],
    )
    report.elapsed_ms = (time.perf_counter() - t_start) * 1000
    return report


def _explain_node(
    fr: Frame,
    names: dict[int, str],
    snap_rows: SnapRows,
    *,
    pid: int | None,
    per_process: bool,
    cores: int | None = None,
    storage: Storage | None = None,
    unstored: Unstored | None = None,
    summaries: list[rules_ranks_fleet.NodeSteps] | None = None,
) -> tuple[list[Chain], list[OpStats], HostSummary, list[str], list[LedgerRow]]:
    """One node's chains, ops, host summary, notes and ledger rows (its step-gap summary appended to
    ``summaries``, where given)."""
    storage = storage or Storage()
    grid = Grid.for_span(fr.first_ns, fr.last_ns)
    snaps = Snapshots.from_rows(grid, snap_rows)
    gpu = fr.select(fr.gpu_mask())
    gpu_pids = gpu.pids
    notes: list[str] = []
    if pid is not None:
        own = fr.select(fr.pid == pid)
        host = host_summary_from_columns(own.source, own.op, own.dur)
        all_ops = _ops(own, node=fr.node, pid=pid)
    else:
        host = host_summary_from_columns(fr.source, fr.op, fr.dur)
        all_ops = _ops(fr, node=fr.node)
    all_ops = with_true_counts(all_ops, storage)
    ops = all_ops if not per_process or pid is not None else []
    if gpu.size == 0:
        notes.append(f"{fr.node}: no CUDA/driver/NCCL events in the window — nothing to explain on the GPU side")
    traced = np.asarray([pid], dtype=np.int64) if pid is not None else gpu_pids
    off = OffCpu(fr.args)
    if summaries is not None:
        summaries.append(rules_ranks_fleet.node_steps(fr, names, gpu=gpu, off=off))
    tree = process_tree(fr, traced)
    ledger = build_ledger(fr, gpu, off, holes=storage.holes, unstored=unstored, names=names)
    node_ctx = Context(
        node=fr.node,
        frame=fr,
        gpu=gpu,
        grid=grid,
        series=HostSeries(fr, grid, traced, snaps, off, tree=tree),
        traced=traced,
        names=names,
        ops=[o for o in all_ops if o.source in GPU_SOURCES],
        offcpu=off,
        tree=tree,
        cpu_cores=cores,
    )
    chains = rules_events.oom_chains(node_ctx) + rules_events.tcp_chains(node_ctx)
    chains += rules_events.contention_chains(node_ctx)
    if per_process and pid is None:
        contexts = []
        for p in gpu_pids:
            p = int(p)
            own = fr.select(fr.pid == p)
            ops += _ops(own, node=fr.node, pid=p)
            pgpu = gpu.select(gpu.pid == p)
            one = np.asarray([p], dtype=np.int64)
            ptree = process_tree(fr, one)
            contexts.append(
                Context(
                    node=fr.node,
                    frame=fr,
                    gpu=pgpu,
                    grid=grid,
                    series=HostSeries(fr, grid, one, snaps, off, tree=ptree),
                    traced=one,
                    names=names,
                    ops=_ops(pgpu, node=fr.node, pid=p),
                    pid=p,
                    offcpu=off,
                    tree=ptree,
                    cpu_cores=cores,
                )
            )
    else:
        contexts = [node_ctx]
    for ctx in contexts:
        tail, unexplained = rules_latency.tail_chains(ctx)
        explained = {c.cuda_op for c in tail}
        periodic = rules_periodic.periodic_chains(ctx, [o for o in ctx.ops if o.name not in explained])
        chains += tail + periodic + rules_drop.drop_chains(ctx) + rules_memory.churn_chains(ctx, periodic)
        cold = rules_cold.cold_start_chains(ctx)
        chains += cold + rules_events.transfer_chains(ctx)
        chains += rules_drift.drift_chains(ctx) + rules_copies.pageable_chains(ctx, chains)
        chains += rules_ranks.late_rank_chains(ctx)
        chains += rules_launch.first_launch_chains(ctx, ctx.notes)
        chains += rules_leak.leak_chains(ctx) + rules_graphs.graph_chains(ctx)
        chains += rules_ledger.ledger_chains(ctx, ledger, chains)
        explained |= {c.cuda_op for c in periodic} | {op for c in cold for op in c.evidence.get("ops", {})}
        for st in unexplained:
            if st.name not in explained:
                who = f" (pid {ctx.pid})" if ctx.pid is not None else ""
                if st.source == NCCL:
                    notes.append(
                        f"{fr.node}{who}: {st.name} p99 is {st.tail_ratio:.1f}x p50: time inside a collective is mostly "
                        "waiting for the other ranks (a rank that waits is not slow) — compare the ranks with "
                        "ingero explain --nodes"
                    )
                    continue
                notes.append(
                    f"{fr.node}{who}: {st.name} p99 is {st.tail_ratio:.1f}x p50 but nothing on the host corroborates "
                    "it in the same windows (a GPU-side or in-process cause)"
                )
        notes += ctx.notes
    notes += context_notes(node_ctx) + storage.notes(fr.node) + ledger.notes
    return chains, ops, host, notes, ledger.rows


def process_tree(fr: Frame, roots: np.ndarray) -> np.ndarray:
    """The traced processes and every process they forked (process_fork: pid = parent, arg1 = child),
    transitively: the only processes whose I/O and network activity can be a cause."""
    a = fr.args
    m = a.is_op(PROCESS_FORK)
    parent, child = a.pid[m], a.arg1[m]
    tree = set(int(p) for p in roots.tolist())
    grew = True
    while grew and parent.size:
        new = {int(c) for p, c in zip(parent.tolist(), child.tolist(), strict=True) if p in tree and c not in tree}
        tree |= new
        grew = bool(new)
    return np.asarray(sorted(tree), dtype=np.int64)


def context_notes(ctx: Context) -> list[str]:
    """Host-wide evidence outside the traced process tree: said, never blamed."""
    s = ctx.series
    out = []
    io_other, tcp_other = int(s.io_other_n.sum()), int(s.tcp_other_n.sum())
    if io_other:
        out.append(
            f"{ctx.node}: context: {io_other} block I/O ops by processes outside the traced GPU processes "
            "(not counted as a cause)"
        )
    if tcp_other:
        out.append(
            f"{ctx.node}: context: {tcp_other} TCP retransmits with no owner in the traced processes "
            "(softirq or other processes; not counted as a cause)"
        )
    if ctx.off.has_rows and not ctx.off.has_state:
        out.append(
            f"{ctx.node}: sched_switch rows carry no prev_state (an Ingero recording): off-CPU time is of unknown "
            "kind — preempted or waiting cannot be told apart"
        )
    return out


def _ops(fr: Frame, *, node: str, pid: int | None = None) -> list[OpStats]:
    errors: dict[tuple[int, int], int] = {}
    if fr.failed.any():
        for s, o in zip(fr.source[fr.failed].tolist(), fr.op[fr.failed].tolist(), strict=True):
            errors[(s, o)] = errors.get((s, o), 0) + 1
    return stats_from_columns(fr.source, fr.op, fr.dur, errors=errors, node=node, pid=pid)


RULE_RANK = {"tail": 0, "drop": 1}
MAX_CHAINS = 6  # per node: a real trace reads as a few chains, most important first


def cap_per_node(chains: list[Chain], notes: list[str]) -> list[Chain]:
    """At most MAX_CHAINS per node (chains are sorted, most important first); the rest are counted."""
    seen: dict[str, int] = {}
    out: list[Chain] = []
    for c in chains:
        seen[c.node] = seen.get(c.node, 0) + 1
        if seen[c.node] <= MAX_CHAINS:
            out.append(c)
    for node, n in seen.items():
        if n > MAX_CHAINS:
            notes.append(f"{node}: {n - MAX_CHAINS} lesser chain(s) left out (at most {MAX_CHAINS} per node)")
    return out


def dedup(chains: list[Chain]) -> list[Chain]:
    """One chain per (node, process, op, cause family): the strongest evidence wins.

    Then a throughput drop is folded into a tail chain of the same process and cause whose window
    overlaps it (one diagnosis, two symptoms), and the standalone TCP-retransmit chain is dropped when
    another chain of that node already blames the network.
    """
    best: dict[tuple[str, Any, str, str], Chain] = {}
    for c in chains:
        key = (c.node, c.evidence.get("pid"), c.cuda_op, _cause(c) if c.cuda_op else c.family)
        cur = best.get(key)
        if cur is None or _strength(c) < _strength(cur):
            if cur is not None:
                c.evidence.setdefault("also", []).append(cur.family)
            best[key] = c
        else:
            cur.evidence.setdefault("also", []).append(c.family)
    out = list(best.values())
    tails = [c for c in out if c.family.startswith("tail/")]
    kept: list[Chain] = []
    for c in out:
        if c.family.startswith("drop/"):
            host = next((t for t in tails if _same_story(t, c)), None)
            if host is not None:
                host.evidence["throughput_drop"] = {
                    "op": c.cuda_op,
                    "drop_pct": c.evidence.get("drop_pct"),
                    "baseline_per_s": c.evidence.get("baseline_per_s"),
                    "rate_per_s": c.evidence.get("rate_per_s"),
                }
                host.explanation += (
                    f" Throughput fell with it: {c.cuda_op} dropped {c.evidence.get('drop_pct')}% "
                    f"({c.evidence.get('baseline_per_s')} → {c.evidence.get('rate_per_s')} calls/s)."
                )
                continue
        kept.append(c)
    blamed = {c.node for c in kept if c.family.endswith("/network")}
    return [c for c in kept if not (c.family == "network" and c.node in blamed)]


def _cause(c: Chain) -> str:
    return c.family.rsplit("/", 1)[-1]


def _same_story(tail: Chain, drop: Chain) -> bool:
    if (tail.node, tail.evidence.get("pid"), _cause(tail)) != (drop.node, drop.evidence.get("pid"), _cause(drop)):
        return False
    a0, a1 = tail.evidence.get("window_start_ns", 0), tail.evidence.get("window_end_ns", 0)
    b0, b1 = drop.evidence.get("window_start_ns", 0), drop.evidence.get("window_end_ns", 0)
    return bool(a0 <= b1 and b0 <= a1)


def _strength(c: Chain) -> tuple[int, int, float]:
    rule = str(c.evidence.get("rule", ""))
    return (c.severity_rank, RULE_RANK.get(rule, 2), -float(c.evidence.get("score", 0.0)))


def _sum_hosts(hs: list[HostSummary]) -> HostSummary:
    if not hs:
        return EMPTY_HOST
    host_n = sum(h.host_events for h in hs)
    gpu_n = sum(h.gpu_api_calls for h in hs)
    return HostSummary(
        host_events=host_n,
        host_avg_ns=sum(h.host_avg_ns * h.host_events for h in hs) / host_n if host_n else 0.0,
        sched_switch=sum(h.sched_switch for h in hs),
        offcpu_ns=sum(h.offcpu_ns for h in hs),
        block_io=sum(h.block_io for h in hs),
        block_io_ns=sum(h.block_io_ns for h in hs),
        block_reads=sum(h.block_reads for h in hs),
        block_writes=sum(h.block_writes for h in hs),
        tcp_retransmits=sum(h.tcp_retransmits for h in hs),
        gpu_api_calls=gpu_n,
        gpu_api_avg_ns=sum(h.gpu_api_avg_ns * h.gpu_api_calls for h in hs) / gpu_n if gpu_n else 0.0,
    )


def _cpu_cores(conn: sqlite3.Connection) -> dict[str, int]:
    """CPU cores per node from the sessions rows ('' = a database whose sessions carry no node)."""
    try:
        rows = conn.execute("SELECT node, max(cpu_cores) FROM sessions GROUP BY node").fetchall()
    except sqlite3.OperationalError:
        try:
            rows = [("", conn.execute("SELECT max(cpu_cores) FROM sessions").fetchone()[0])]
        except sqlite3.OperationalError:
            return {}
    return {str(n or ""): int(c) for n, c in rows if c}


def _cores_of(cores: dict[str, int], node: str) -> int | None:
    if node in cores:
        return cores[node]
    return next(iter(cores.values())) if len(cores) == 1 else None


def _process_names(conn: sqlite3.Connection) -> dict[int, str]:
    try:
        return {int(p): str(n) for p, n in conn.execute("SELECT pid, name FROM process_names")}
    except sqlite3.OperationalError:
        return {}


def _snapshot_rows(conn: sqlite3.Connection, frames: dict[str, Frame]) -> dict[str, tuple[SnapRows, str | None]]:
    """System snapshots per node.

    ``system_snapshots`` has no ``node`` column (Ingero's layout). With one node every snapshot is its
    own; in a merged database a snapshot is attributed to a node when it falls in that node's recording
    span and in no other node's. Snapshots in overlapping spans are ambiguous and left out (noted).
    """
    if not frames:
        return {}
    lo = min(f.first_ns for f in frames.values())
    hi = max(f.last_ns for f in frames.values())
    cols = {r[1] for r in conn.execute("PRAGMA table_info(system_snapshots)")}
    if "node" in cols:
        out: dict[str, tuple[SnapRows, str | None]] = {}
        # two queries: SQLite answers a lone min() or max() from the timestamp index, not both at once
        first = conn.execute("SELECT min(timestamp) FROM system_snapshots").fetchone()[0]
        last = conn.execute("SELECT max(timestamp) FROM system_snapshots").fetchone()[0]
        for name, fr in frames.items():
            # a window holding every snapshot reads the table in order (``+timestamp``: not through the
            # index, a lookup per row); a narrower one through the index
            column = "+timestamp" if first is None or (fr.first_ns <= first and last <= fr.last_ns) else "timestamp"
            cur = conn.execute(
                "SELECT timestamp, cpu_pct, mem_pct, mem_avail, swap_mb, load_avg FROM system_snapshots "
                f"WHERE node = ? AND {column} >= ? AND {column} <= ?",
                (name, fr.first_ns, fr.last_ns),
            )
            out[name] = (snapshot_array(cur.fetchall()), None)
        return out
    rows = load_snapshots(conn, lo, hi)
    if len(frames) == 1:
        return {next(iter(frames)): (rows, None)}
    spans = {name: (f.first_ns, f.last_ns) for name, f in frames.items()}
    mine: dict[str, list[tuple[int, float, float, int, int, float]]] = {name: [] for name in frames}
    ambiguous = 0
    for r in rows:
        owners = [n for n, (a, b) in spans.items() if a <= r[0] <= b]
        if len(owners) == 1:
            mine[owners[0]].append(r)
        elif owners:
            ambiguous += 1
    out = {name: (r, None) for name, r in mine.items()}
    if ambiguous:
        first = next(iter(out))
        out[first] = (
            out[first][0],
            f"{ambiguous} system snapshot(s) left out: nodes recorded at the same time and snapshots carry no node",
        )
    return out
