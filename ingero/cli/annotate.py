"""``ingero annotate``: mark a moment (a deploy, a config change) in the node's database."""

from __future__ import annotations

import argparse
import sys

from ingero.cli import common

HELP = "mark a moment (a deploy, a config change) that explain and the timeline show"
EXAMPLES = """\
examples:
  ingero annotate --db trace.db "deploy v2.3"            now, while 'ingero trace' records into trace.db
  ingero annotate --db trace.db --at 2026-11-24T18:00:00Z "lr 3e-4 -> 1e-4"
  ingero annotate --db trace.db --list --json            every annotation, oldest first

An annotation is one row of the table 'annotations' (timestamp, node, message, author). It is written
in a short transaction next to a running tracer (which keeps writing); 'ingero explain' lists the
annotations of its window and 'ingero export' shows them on the timeline.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "annotate",
        parents=parents,
        help=HELP,
        description="Write an annotation (a message at a moment) into this node's trace database.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p)
    common.add_node_arg(p)
    p.add_argument("message", nargs="?", help="what happened (one line)")
    p.add_argument("--at", metavar="TIME", help="the moment (ISO 8601 or Unix seconds); default: now")
    p.add_argument("--list", action="store_true", help="list the annotations instead of writing one")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from ingero.cli.output import emit_json
    from ingero.errors import UsageError
    from ingero.store.annotations import add_annotation, list_annotations
    from ingero.store.db import open_readonly
    from ingero.timeutil import parse_time

    db = common.db_path_from(args)
    if args.list:
        if args.message:
            raise UsageError("--list takes no message")
        conn = open_readonly(db)
        try:
            rows = list_annotations(conn)
        finally:
            conn.close()
        if args.json:
            emit_json([a.as_dict() for a in rows])
        else:
            from ingero.timeutil import fmt_ts

            for a in rows:
                sys.stdout.write(f"{fmt_ts(a.timestamp)}  {a.node}  {a.message}  ({a.author})\n")
        return 0
    if not args.message:
        raise UsageError("no message given", hint='e.g. ingero annotate --db trace.db "deploy v2.3"')
    at = parse_time(args.at) if args.at else None
    note = add_annotation(db, args.message, node=common.identity_from(args).node, timestamp=at)
    if args.json:
        emit_json(note.as_dict())
    else:
        sys.stdout.write(f"annotated {db} (#{note.id})\n")
    return 0
