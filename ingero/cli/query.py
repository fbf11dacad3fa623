"""``ingero query``: read-only SQL on a local database, or fanned out to every agent with ``--nodes``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ingero.cli import common
from ingero.cli.clickhouse import add_clickhouse_arg
from ingero.cli.output import add_output_args, emit_rows, note

if TYPE_CHECKING:
    from ingero.store.guard import QueryResult

DEFAULT_SQL = (
    "SELECT e.id, e.timestamp, s.name AS source, o.name AS op, e.duration/1000.0 AS dur_us, e.pid, e.tid, "
    "e.arg0, e.ret_code FROM events e JOIN sources s ON e.source = s.id "
    "JOIN ops o ON e.source = o.source_id AND e.op = o.op_id ORDER BY e.timestamp DESC"
)

EXAMPLES = """\
examples:
  ingero query --db trace.db "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"
  ingero query --db trace.db --op cudaMalloc --limit 20          latest cudaMalloc events
  ingero query --db trace.db --since 5m --pid 4242 --csv "SELECT op, duration FROM events"
  ingero query --nodes gpu-node-01:8080,gpu-node-02:8080 "SELECT count(*) AS n FROM events"
  ingero query --config configs/ingero.yaml --json "SELECT * FROM causal_chains"
  ingero query --db trace.db -f slow_calls.sql --tsv --no-headers | sort -t$'\t' -k2 -n
  echo "SELECT count(*) FROM events" | ingero query --db trace.db --nl -

--since/--from/--to/--op/--pid restrict what the table 'events' shows to your SQL (joins included).
Without SQL, the most recent events are listed. Queries are read-only: writes, ATTACH, PRAGMA writes and
several statements are refused; a query is stopped at its time limit (--timeout-ms, default 2000).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "query",
        parents=parents,
        help="run read-only SQL on a trace database or on every node",
        description="Run one read-only SQL statement on a local trace database, or on every agent "
        "of the fleet with rows merged under a 'node' column.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.add_argument("sql", nargs="?", help="one SELECT statement; '-' reads it from stdin (default: the latest events)")
    p.add_argument("-f", "--file", metavar="PATH", help="read the statement from a file")
    common.add_db_arg(p)
    common.add_window_args(p)
    p.add_argument("--op", metavar="NAME", help="only events of this op (cudaMalloc, sched_switch, ...)")
    p.add_argument("--pid", type=int, metavar="PID", help="only events of this process")
    p.add_argument("--limit", type=int, metavar="N", help="row cap (per node with --nodes); default 1000, max 10000")
    p.add_argument("--timeout-ms", type=int, metavar="MS", help="query time limit (default 2000)")
    p.add_argument(
        "--annotations",
        action="store_true",
        help="add each event's labels in force (ingero annotate: its process incarnation and time) as a "
        "'labels' column; the result needs timestamp and pid columns",
    )
    common.add_fleet_args(p)
    add_clickhouse_arg(p, "run the statement on the fleet's history in ClickHouse")
    add_output_args(p, rows_ok=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "clickhouse", None):
        from ingero.cli import clickhouse

        sql = sql_from(args)
        return emit_result(args, clickhouse.query_result(args, clickhouse.DEFAULT_SQL if sql is DEFAULT_SQL else sql))
    if common.wants_fleet(args):
        from ingero.cli import fleet_cmds

        return fleet_cmds.run_query(args, sql_from(args))
    return run_local(args)


def sql_from(args: argparse.Namespace) -> str:
    """The statement to run: the argument, ``-`` (stdin) or ``-f FILE``; else the latest events."""
    import sys

    from ingero.errors import UsageError

    if args.file and args.sql:
        raise UsageError("both a statement and --file given", hint="pass one of them")
    text = args.sql
    if args.file:
        try:
            text = Path(args.file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--file {args.file}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    elif text == "-":
        text = sys.stdin.read()
    return text if text and text.strip() else DEFAULT_SQL


def run_local(args: argparse.Namespace) -> int:
    from ingero.store import guard
    from ingero.store.catalog import lookup_op
    from ingero.store.db import event_filter_sql

    path = common.db_path_from(args)
    source_op = None
    if args.op:
        ref = lookup_op(args.op)
        source_op = (ref.source, ref.op)
    window = common.window_from_args(args, path)
    flt = event_filter_sql(window.start_ns if window else None, window.end_ns if window else None, args.pid, source_op)
    sql = sql_from(args)
    result = guard.run_query(
        path,
        sql,
        limit=args.limit,
        timeout_ms=args.timeout_ms or guard.DEFAULT_TIMEOUT_MS,
        event_filter=flt,
        max_limit=guard.MAX_LIMIT,
    )
    if args.annotations:
        from ingero.store.annotation_join import with_labels
        from ingero.store.db import open_readonly

        conn = open_readonly(path)
        try:
            result.rows = with_labels(conn, result.columns, result.rows)
        finally:
            conn.close()
        result.columns = [*result.columns, "labels"]
    return emit_result(args, result)


def emit_result(args: argparse.Namespace, result: QueryResult) -> int:
    """Print a result set in the chosen format, with the row count (and truncation) on stderr."""
    emit_rows(
        result.columns,
        result.rows,
        args.format,
        headers=args.headers,
        meta={
            "truncated": result.truncated,
            "truncated_reason": result.truncated_reason,
            "elapsed_ms": round(result.elapsed_ms, 3),
        },
    )
    if args.format == "table":
        footer = f"{len(result.rows)} row(s)"
        if result.truncated:
            footer += f" — truncated ({result.truncated_reason}); raise --limit or narrow the query"
        note(footer)
    elif result.truncated:
        note(f"output truncated ({result.truncated_reason}) at {len(result.rows)} rows")
    return 0
