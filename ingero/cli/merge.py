"""``ingero merge``: combine node databases into one queryable cluster database (offline path)."""

from __future__ import annotations

import argparse

from ingero.cli import common
from ingero.cli.output import add_output_args, emit_json, emit_rows, note, warn

EXAMPLES = """\
examples:
  ingero merge gpu-node-01.db gpu-node-02.db gpu-node-03.db -o cluster.db
  ingero merge nodes/*.db -o cluster.db --force          replace an existing cluster.db
  ingero merge old.db --force-node gpu-node-07 -o new.db  Ingero 0.8 database (no node column)
  ingero merge a.db legacy.db --force-node legacy.db=gpu-node-09 -o cluster.db
  ingero merge a.db a-rotated.db --dedupe -o node-a.db    same node twice: keep one copy of each event id
  ingero merge *.db -o cluster.db --json                 machine-readable report

then:
  ingero query --db cluster.db "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"
  ingero explain --db cluster.db

Inputs are opened read-only and never modified. Event and chain ids stay node-namespaced
({node}:{seq}); stack traces are deduplicated by hash; sessions are renumbered; the output is a
normal ingero database (a writer can append to it later). A warning is printed when the nodes'
time ranges suggest clock skew over --skew-threshold (timestamps are never shifted).
Per-node tables without a node column: process_names keeps one row per pid (first input wins) and
node_process_names keeps every node's; system_snapshots.node says which node sampled each snapshot.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "merge",
        parents=parents,
        help="merge node databases into one cluster database (offline analysis)",
        description="Merge trace databases from several nodes (ingero or Ingero 0.8/0.9 layouts) into one "
        "database that ingero query/explain/export read like any other.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.add_argument("inputs", nargs="+", metavar="DB", help="input databases (opened read-only)")
    p.add_argument(
        "-o", "--out", "--output", dest="output", required=True, metavar="PATH", help="merged database to create"
    )
    p.add_argument("--force", action="store_true", help="replace the output if it exists")
    p.add_argument(
        "--force-node",
        action="append",
        metavar="NAME|DB=NAME",
        help="node name for databases without one (Ingero 0.8 layout, or rows with an empty node); "
        "DB=NAME names one input; repeatable",
    )
    p.add_argument(
        "--dedupe",
        action="store_true",
        help="when one node is in several inputs with the same event ids, keep one copy (default: refuse)",
    )
    p.add_argument(
        "--skew-threshold",
        metavar="DUR",
        default="1s",
        help="warn when nodes' time ranges look shifted by more than DUR (default 1s)",
    )
    add_output_args(p, csv_ok=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ingero.errors import UsageError
    from ingero.store.merge import merge_databases
    from ingero.timeutil import fmt_duration, fmt_ts, parse_duration

    threshold = parse_duration(args.skew_threshold)
    if threshold <= 0:
        raise UsageError(f"--skew-threshold {args.skew_threshold}: must be positive")
    report = merge_databases(
        args.inputs,
        args.output,
        force_node=args.force_node,
        force=args.force,
        dedupe=args.dedupe,
        skew_threshold_ns=threshold,
        progress=None if args.format == "json" else note,
    )
    if args.format == "json":
        emit_json(report.as_dict())
    else:
        rows = [
            (
                n.node or "(none)",
                n.events,
                n.chains,
                n.sessions,
                fmt_ts(n.first_ns) if n.first_ns else "",
                fmt_duration(n.last_ns - n.first_ns) if n.first_ns is not None and n.last_ns is not None else "",
            )
            for n in sorted(report.nodes.values(), key=lambda n: n.node)
        ]
        emit_rows(["node", "events", "chains", "sessions", "first_event", "span"], rows, "table")
        extra = []
        if report.duplicates_skipped:
            extra.append(f"{report.duplicates_skipped} duplicate event(s) skipped")
        if report.snapshots_moved:
            extra.append(f"{report.snapshots_moved} snapshot timestamp(s) moved 1 ns to stay unique")
        if report.process_name_conflicts:
            extra.append(f"{report.process_name_conflicts} pid(s) named differently on different nodes")
        note(
            f"merged {len(report.inputs)} database(s) → {report.output}: {report.events} events, "
            f"{report.stacks} unique stacks (of {report.stacks_seen}), {report.chains} chains, "
            f"{report.sessions} sessions, {report.snapshots} snapshots, {len(report.nodes)} node(s) "
            f"in {report.elapsed_s:.2f}s" + (f" ({'; '.join(extra)})" if extra else "")
        )
    for message in report.warnings:
        warn(message)
    return 0
