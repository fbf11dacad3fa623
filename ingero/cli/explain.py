"""``ingero explain``: per-op latency statistics and causal chains for a trace database (or, with
``--nodes``, for every agent of the fleet)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ingero.cli import common
from ingero.cli.clickhouse import add_clickhouse_arg
from ingero.cli.output import add_output_args, emit_json, note

MAX_READ_THREADS = 4
EXAMPLES = """\
examples:
  ingero explain --db trace.db                          per-op p50/p95/p99 + causal chains, whole recording
  ingero explain --db trace.db --since 5m               the last 5 minutes (of the recording, if it has ended)
  ingero explain --db trace.db --from 2026-04-03T12:18:40Z --to 2026-04-03T12:19:40Z
  ingero explain --db trace.db --pid 4242               one process (its GPU calls, its off-CPU time)
  ingero explain --db trace.db --per-process            chains and op tables per GPU process
  ingero explain --db trace.db --per-cgroup             ... grouped by container / pod / Slurm job
  ingero explain --db investigations/sample-cluster.db --node gpu-node-01
  ingero explain --db investigations/sample-cluster.db --op cuLaunchKernel --json
  ingero explain --db tests/data/ingero-samples/sample-cluster.db --chains   chains stored while tracing
  ingero explain --nodes gpu-node-01:8080,gpu-node-02:8080   fleet: every node + straggler verdict
  ingero explain --db trace.db --by step                one line per step: wall time, lost time, top cause
  ingero explain --db trace.db --annotation step=12     only the span labelled step=12 (ingero annotate)

A causal chain ties a GPU-side symptom (an op's p99 >= 3x its p50, a >= 40% throughput drop, the GPU
idle between calls, slow first launches or recompilation, copies dominating wall time, allocator churn,
another process on the same GPU, an OOM kill) to evidence measured on the same thread at the same time:
the GPU thread's involuntary off-CPU time inside its own slow calls (preempted, or runnable in the run
queue; voluntary sleeps are waiting, not contention), forked workers it waited for, its own block I/O.
Severity is the time lost, with an absolute floor; at most 6 chains per node. Host-wide evidence (other
processes' I/O, softirq retransmits, the agent itself) is context, printed as a note. Nodes of a merged
database are analysed apart; --chains only shows stored chains, never mixed into the diagnosis.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "explain",
        parents=parents,
        help="per-op latency statistics and causal chains (root cause + fix)",
        description="Explain a trace: per-op latency statistics (count, p50/p95/p99, max) and causal chains "
        "from GPU symptoms to host causes, with severity, root cause, timeline and recommendations.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p)
    common.add_window_args(p)
    who = p.add_mutually_exclusive_group()
    who.add_argument("--pid", type=int, metavar="PID", help="only this process's GPU calls and off-CPU time")
    who.add_argument("--per-process", action="store_true", help="op tables and chains for each GPU process")
    who.add_argument(
        "--per-cgroup",
        action="store_true",
        help="op tables and chains grouped by container / Kubernetes pod / Slurm job (cgroup) of each GPU process",
    )
    p.add_argument("--node", metavar="NAME", help="only this node of a merged (cluster) database")
    p.add_argument(
        "--op", metavar="NAME", help="only this op in the table and chains (cudaStreamSync, cuMemAlloc, ...)"
    )
    p.add_argument(
        "--chains",
        action="store_true",
        help="show the chains stored in the database (recorded by the tracer or Ingero) instead of computing them",
    )
    p.add_argument(
        "--annotations",
        action="store_true",
        help="summarise the window's labels (ingero annotate: step, epoch, ...): values, spans, processes",
    )
    by = p.add_mutually_exclusive_group()
    by.add_argument(
        "--by",
        metavar="KEY",
        help="one line per value of label KEY (step, epoch, ...): its wall time, lost time (the wall-time ledger) "
        "and top cause",
    )
    by.add_argument(
        "--annotation",
        metavar="KEY=VALUE",
        help="explain only the span(s) labelled KEY=VALUE (e.g. step=12), for the process they are scoped to",
    )
    common.add_fleet_args(p)
    add_clickhouse_arg(p, "explain one --node's window of the fleet's history in ClickHouse")
    add_output_args(p, csv_ok=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "clickhouse", None):
        from ingero.cli import clickhouse

        return clickhouse.run_explain(args, _computed)
    if common.wants_fleet(args):
        from ingero.cli import fleet_cmds

        if args.by:
            from ingero.cli.explain_fleet import run_by

            return run_by(args)
        return fleet_cmds.run_explain(args)
    return run_local(args)


def run_local(args: argparse.Namespace) -> int:
    import sqlite3

    from ingero.errors import UsageError
    from ingero.store.catalog import lookup_op
    from ingero.store.db import node_names, open_readonly, translate
    from ingero.store.window import resolve_window

    path = common.db_path_from(args)
    op_name = lookup_op(args.op).name if args.op else None
    if args.pid is not None and args.pid < 0:
        raise UsageError(f"--pid {args.pid}: must be a process id (>= 0)")
    conn = open_readonly(path)
    try:
        window = resolve_window(conn, args.since, args.from_, args.to)
        if args.node is not None:
            known = node_names(conn)
            if (
                args.node not in known
                and not conn.execute("SELECT 1 FROM events WHERE node = ? LIMIT 1", (args.node,)).fetchone()
            ):
                raise UsageError(f"no node {args.node!r} in {path}", hint="nodes: " + ", ".join(known))
        if args.by:
            return _by_label(conn, args, path, window)
        label = None
        if args.annotation:
            window, label = _annotation_window(conn, args, window)
        if args.chains:
            return _stored(conn, args, path, window, op_name)
        if args.per_cgroup:
            return _per_cgroup(conn, args, path, window)
        return _computed(conn, args, path, window, op_name, label=label)
    except sqlite3.Error as e:
        raise translate(e, path) from None
    finally:
        conn.close()


def _stored(conn: Any, args: argparse.Namespace, path: Any, window: Any, op_name: str | None) -> int:
    from ingero.explain.model import sort_chains, stored_chains
    from ingero.explain.render import render_chains

    chains = stored_chains(conn, window)
    if args.node:
        chains = [c for c in chains if c.node == args.node]
    if op_name:
        chains = [c for c in chains if c.cuda_op == op_name]
    chains = sort_chains(chains)
    if args.format == "json":
        emit_json({"db": str(path), "window": window.as_dict(), "chains": [c.as_dict() for c in chains]})
        return 0
    if window.note:
        note(window.note)
    if chains:
        print(f"{path}: {len(chains)} stored causal chain(s)\n")
        print(render_chains(chains), end="")
    else:
        print(f"{path}: no stored causal chains" + (" in the window" if not window.unbounded else ""))
        note("compute chains from the events instead: drop --chains")
    return 0


def _computed(
    conn: Any, args: argparse.Namespace, path: Any, window: Any, op_name: str | None, *, label: Any = None
) -> int:
    from ingero.explain.engine import explain
    from ingero.explain.model import stored_chains
    from ingero.explain.render import render_report

    report = explain(conn, window, pid=args.pid, per_process=args.per_process, node=args.node, threads=read_threads())
    if op_name:
        report.ops = [o for o in report.ops if o.name == op_name]
        report.chains = [c for c in report.chains if c.cuda_op == op_name]
        if not report.ops:
            report.notes.append(f"no {op_name} events in the window")
    stored = stored_chains(conn, window)
    if args.node:
        stored = [c for c in stored if c.node == args.node]
    marks = _annotations(conn, window, args.node)
    if args.format == "json":
        doc = {"db": str(path), **report.as_dict(), "stored_chains": len(stored)}
        doc["annotations"] = [a.as_dict() for a in marks]
        if args.annotations:
            doc["labels"] = _label_summary(conn, window, args.node)
        if label is not None:
            doc["label"] = label[1].as_dict()
        emit_json(doc)
        return 0
    if label is not None:
        from ingero.explain.by_label import render_value

        print(render_value(*label))
    print(render_report(report, source=str(path), stored=len(stored) if not report.chains else 0), end="")
    if marks:
        from ingero.timeutil import fmt_ts

        print("\nannotations (ingero annotate):")
        for a in marks:
            print(f"  {fmt_ts(a.timestamp)}  {a.node}  {a.message}  ({a.author})")
    if args.annotations:
        from ingero.store.annotation_join import render_label_summary

        print(render_label_summary(_label_summary(conn, window, args.node)), end="")
    for msg in report.notes:
        note(msg)
    return 0


def read_threads() -> int:
    """Connections a local explain reads a large database with: the CPUs this process may use, at
    most :data:`MAX_READ_THREADS` (the agent's API keeps one: its connection carries the query budget)."""
    return max(1, min(MAX_READ_THREADS, len(os.sched_getaffinity(0))))


def _annotations(conn: Any, window: Any, node: str | None) -> list[Any]:
    """The window's annotations (``ingero annotate``), of ``node`` only when given."""
    from ingero.store.annotations import list_annotations

    marks = list_annotations(conn, window.start_ns, window.end_ns)
    return [a for a in marks if node is None or a.node == node]


def _label_summary(conn: Any, window: Any, node: str | None) -> dict[str, Any]:
    from ingero.store.annotation_join import label_summary

    return label_summary(conn, window.start_ns, window.end_ns, node)


def _by_label(conn: Any, args: argparse.Namespace, path: Any, window: Any) -> int:
    from ingero.explain.by_label import by_label, render

    result = by_label(conn, args.by, window, node=args.node, threads=read_threads())
    if args.format == "json":
        emit_json({"db": str(path), "window": window.as_dict(), "by": result.as_dict()})
        return 0
    print(render(result), end="")
    for msg in result.notes:
        note(msg)
    return 0


def _annotation_window(conn: Any, args: argparse.Namespace, window: Any) -> tuple[Any, tuple[str, Any]]:
    """``--annotation step=12``: the window of that value's span(s) (their process when they have one),
    and the value's ledger among its key's values (the span's own start, before its first GPU call, too)."""
    from ingero.explain.by_label import explain_value
    from ingero.timeutil import fmt_ts

    span, pid, key, value = explain_value(conn, args.annotation, window, node=args.node, threads=read_threads())
    if args.pid is None and pid is not None:
        args.pid = pid
    scope = f", pid {args.pid}" if args.pid is not None else ""
    note(f"{key}={value.value}: {fmt_ts(span.start_ns)} to {fmt_ts(span.end_ns)}{scope}")
    return span, (key, value)


def _per_cgroup(conn: Any, args: argparse.Namespace, path: Any, window: Any) -> int:
    from ingero.explain.cgroups import pid_cgroups
    from ingero.explain.engine import explain
    from ingero.explain.per_cgroup import group_by_cgroup, render_groups

    report = explain(conn, window, per_process=True, node=args.node, threads=read_threads())
    groups = group_by_cgroup(report, pid_cgroups(conn, window))
    if args.format == "json":
        emit_json({"db": str(path), "window": window.as_dict(), "groups": [g.as_dict() for g in groups]})
        return 0
    print(render_groups(groups, source=str(path)), end="")
    for msg in report.notes:
        note(msg)
    return 0
