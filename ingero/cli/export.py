"""``ingero export``: a trace database (or the live fleet) as a Perfetto / Chrome JSON timeline."""

from __future__ import annotations

import argparse

from ingero.cli import common
from ingero.cli.output import add_output_args, emit_json, note, warn

EXAMPLES = """\
examples:
  ingero export --db cluster.db -o trace.json                one track per node; open in ui.perfetto.dev
  ingero export --db trace.db --since 30s -o last30s.json    the recording's last 30 seconds
  ingero export --db trace.db --from 2026-04-03T12:27:05Z --to 2026-04-03T12:27:09Z -o slice.json
  ingero export --nodes gpu-node-01:8080,gpu-node-02:8080 -o fleet.json   live agents, clocks aligned
  ingero export --config configs/ingero.yaml --since 5m -o fleet.json      fleet.nodes from the config
  ingero export --db trace.db -o - | gzip > trace.json.gz

What is in the trace: a process per node ("gpu-node-01 (rank 0)"), a thread per traced thread with its
CUDA runtime/driver/NCCL/socket calls and off-CPU periods as slices and other host events as
instants, block I/O on per-node lanes, and causal chains as markers on "causal chains: HIGH/MEDIUM/LOW"
lanes. Timestamps are microseconds since a base second written in the trace metadata. With --nodes,
each node's clock offset (measured by the fleet client) is subtracted from its timestamps and recorded
in the metadata.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        parents=parents,
        help="export a timeline for Perfetto (Chrome Trace Event JSON)",
        description="Export trace events, host activity and causal chains as a Chrome Trace Event JSON file "
        "that Perfetto (ui.perfetto.dev, trace_processor) and chrome://tracing open.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.add_argument(
        "--format",
        dest="trace_format",
        choices=["perfetto", "chrome"],
        default="perfetto",
        help="perfetto (default) or chrome: the same Chrome Trace Event JSON, which both open",
    )
    p.add_argument(
        "-o", "--out", "--output", dest="output", required=True, metavar="PATH", help="file to write ('-' for stdout)"
    )
    common.add_db_arg(p)
    common.add_window_args(p)
    common.add_fleet_args(p)
    p.add_argument(
        "--max-events",
        type=int,
        metavar="N",
        default=2_000_000,
        help="with --nodes: most events fetched per node (default 2000000)",
    )
    add_output_args(p, csv_ok=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    import sys
    from pathlib import Path

    from ingero.errors import StoreError, UsageError
    from ingero.export.perfetto import ExportStats, write_trace

    if args.max_events is not None and args.max_events <= 0:
        raise UsageError("--max-events must be positive")
    fleet = common.wants_fleet(args)
    if fleet:
        from ingero.cli import fleet_cmds
        from ingero.export.fleet_source import DEFAULT_EXPORT_TIMEOUT_S, export_fleet

        settings = fleet_cmds.settings_from_args(args)
        if getattr(args, "timeout", None) is None:  # a whole trace takes longer than one query
            settings = settings.with_(timeout_s=max(settings.timeout_s, DEFAULT_EXPORT_TIMEOUT_S))
        fetched = export_fleet(
            fleet_cmds.nodes_from(args),
            settings,
            since=args.since,
            from_=args.from_,
            to=args.to,
            max_events=int(args.max_events),
            strict=bool(getattr(args, "strict", False)),
        )
        for line in fetched.warnings:
            warn(line)
        nodes, meta, closer = fetched.traces, fetched.meta, _nothing
    else:
        from ingero.export.sources import traces_from_db

        path = common.db_path_from(args)
        window = common.window_from_args(args, path)
        local = traces_from_db(path, window)
        nodes, closer = local.nodes, local.close
        meta = {"source": "database", "database": str(path), "window": window.as_dict() if window else None}
    try:
        stats: ExportStats
        if args.output == "-":
            stats = write_trace(sys.stdout, nodes, meta)
        else:
            out = Path(args.output).expanduser()
            tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
            try:
                with tmp.open("w", encoding="utf-8") as fh:
                    stats = write_trace(fh, nodes, meta)
                tmp.replace(out)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise StoreError(f"cannot write {out}: {e.strerror or e}") from None
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
    finally:
        closer()
    if not stats.nodes:
        warn("nothing to export: no events or chains in the window")
    summary = (
        f"{stats.nodes} node track(s), {stats.threads} thread(s), {stats.slices} slices, {stats.instants} instants, "
        f"{stats.chains} chain marker(s)"
    )
    if stats.overlaps:
        summary += f"; {stats.overlaps} call(s) overlapping their enclosing slice written as instants"
    if args.format == "json":
        emit_json({"output": args.output, **stats.as_dict()}, stream=sys.stderr if args.output == "-" else None)
    elif args.output != "-":
        note(f"wrote {args.output}: {summary} (open it in https://ui.perfetto.dev)")
    return 0


def _nothing() -> None:
    """Fleet traces hold no open database."""
