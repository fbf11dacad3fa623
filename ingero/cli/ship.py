"""``ingero ship``: copy a recording's rows not yet shipped into the fleet's history (ClickHouse)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ingero.cli import common
from ingero.cli.output import add_output_args, emit_json, emit_rows, note

if TYPE_CHECKING:
    from ingero.clickhouse.shipper import Shipper

EXAMPLES = """\
examples:
  ingero ship --db trace.db --clickhouse http://ch-1:8123             ship what is new, then exit
  ingero ship --db trace.db --clickhouse http://ch-1:8123 --follow    keep shipping while a tracer records
  ingero ship --db trace.db --status                                  how far behind shipping is

Progress is kept per table in the recording (table clickhouse_progress): a re-run, or a run after a
crash, ships nothing twice and skips nothing. Create the tables first: ingero clickhouse-schema --apply.
While the cluster is down, --follow stalls and retries (backing off up to 30 s); recording is never slowed.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ship",
        parents=parents,
        help="ship a recording's new rows to ClickHouse (resumable; --follow keeps shipping)",
        description="Ship the rows of a trace database not yet shipped to the fleet's history in ClickHouse, in "
        "batches through one server's HTTP interface; per-table progress is kept in the database.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p)
    p.add_argument(
        "--clickhouse", metavar="URL", help="a server of the cluster (HTTP interface, e.g. http://ch-1:8123)"
    )
    p.add_argument("--ch-database", default="default", metavar="DB", help="ClickHouse database (default: default)")
    p.add_argument(
        "--ch-target", default="default", metavar="NAME", help="progress label of this store (default: default)"
    )
    p.add_argument("--follow", action="store_true", help="keep shipping new rows until Ctrl-C")
    p.add_argument("--interval", default="1s", metavar="DUR", help="--follow: time between rounds (default 1s)")
    p.add_argument("--batch-rows", type=int, metavar="N", help="rows per insert (default 100000)")
    p.add_argument("--status", action="store_true", help="print how far behind shipping is, per table, and exit")
    add_output_args(p, csv_ok=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ingero.errors import UsageError

    db = common.db_path_from(args)
    if args.status:
        return _status(args, db)
    if not args.clickhouse:
        raise UsageError("ship needs --clickhouse URL", hint="e.g. --clickhouse http://127.0.0.1:8123")
    if args.batch_rows is not None and args.batch_rows < 1:
        raise UsageError(f"--batch-rows {args.batch_rows}: must be at least 1")
    from ingero.cli.clickhouse import open_shipper, ship_summary

    shipper = open_shipper(args, db)
    try:
        if not args.follow:
            result = shipper.ship_once()
            if args.format == "json":
                emit_json(
                    {
                        "rows": result.rows,
                        "elapsed_s": round(result.elapsed_s, 3),
                        "tables": {k: v.__dict__ for k, v in result.tables.items()},
                    }
                )
            else:
                note(ship_summary(result))
            return 0
        return _follow(args, shipper)
    finally:
        shipper.ch.close()
        shipper.close()


def _follow(args: argparse.Namespace, shipper: Shipper) -> int:
    import threading

    from ingero.cli.clickhouse import RoundNotes
    from ingero.timeutil import parse_duration

    interval = parse_duration(args.interval) / 1e9
    stop = threading.Event()
    try:
        shipper.follow(stop, interval_s=interval, on_round=RoundNotes())
    except KeyboardInterrupt:
        stop.set()
        return 130
    return 0


def _status(args: argparse.Namespace, db: Path) -> int:
    from ingero.clickhouse.progress import lag
    from ingero.timeutil import fmt_ts

    rows = lag(db, args.ch_target)
    if args.format == "json":
        emit_json({"target": args.ch_target, "tables": [r.__dict__ for r in rows]})
        return 0
    emit_rows(
        ["table", "shipped", "unshipped", "oldest_unshipped"],
        [
            [r.table, r.shipped_rows, r.unshipped_rows, fmt_ts(r.oldest_unshipped_ns) if r.oldest_unshipped_ns else ""]
            for r in rows
        ],
        args.format,
    )
    return 0
