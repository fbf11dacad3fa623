"""``ingero annotate``: labels (step, epoch, task) for a live recording over Ingero's socket protocol, or
a marked moment (a deploy, a config change) in the node's database."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ingero.cli import common

if TYPE_CHECKING:
    from ingero.annotate import AnnotationLine

HELP = "label a live recording (step, epoch, task) or mark a moment (a deploy) in the database"
EXAMPLES = """\
examples:
  echo '{"labels":{"step":"42","epoch":"3"}}' | ingero annotate    to the tracer's socket (trace --annotate)
  ingero annotate --from-file markers.ndjson                      one protocol object a line
  ingero annotate --label step=42 --label epoch=3 --pid 4821      convenience form (see the caveat)
  ingero annotate --db trace.db --label phase=eval                no tracer: straight into the database
  ingero annotate --db trace.db "deploy v2.3"                     a marked moment (message, author)
  ingero annotate --db trace.db --list --json                     every annotation, oldest first

Protocol (Ingero's, agent 0.17): NDJSON, one object a line:
  {"ts": ns?, "labels": {"k": "v"}, "pid"?, "start_time"?, "span_start"?, "span_end"?, "v"?}
labels are required (at most 32; keys [A-Za-z0-9_.-] up to 64 bytes, values up to 256 bytes, no control
characters); a span needs span_start <= span_end; a line is at most 16 KiB. Without --db the lines go to
the socket of 'ingero trace --annotate' (/run/ingero/annotate.sock, else ~/.ingero/run/annotate.sock),
which records who sent them (uid, gid, pid). A pid may be labelled by root, by itself, or by a process
of the same uid as its owner.

CAVEAT: --label and --pid values are visible to every process on the host through /proc/<pid>/cmdline
(and shell history, audit logs). Send sensitive identities (job names, customer ids) on stdin or with
--from-file instead.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "annotate",
        parents=parents,
        help=HELP,
        description="Send labels to a running 'ingero trace --annotate' (Ingero's NDJSON socket protocol), "
        "or write them, or a marked moment, into a trace database.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p, help_extra="; given: write there directly instead of to the tracer's socket")
    common.add_node_arg(p)
    p.add_argument("message", nargs="?", help="a marked moment: what happened (one line)")
    p.add_argument("--from-file", metavar="PATH", help="NDJSON protocol lines from a file ('-': stdin, the default)")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="K=V",
        help="a label (repeatable); leaks through /proc/*/cmdline: prefer stdin or --from-file",
    )
    p.add_argument("--pid", type=int, metavar="PID", help="scope --label to this process (leaks like --label)")
    p.add_argument("--socket", metavar="PATH", help="the tracer's socket, when not in the usual places")
    p.add_argument("--at", metavar="TIME", help="the moment (ISO 8601 or Unix seconds); default: now")
    p.add_argument("--list", action="store_true", help="list the annotations instead of writing one")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ingero.errors import UsageError

    if args.list:
        if args.message or args.label or args.from_file:
            raise UsageError("--list takes no message or labels")
        return _list(args)
    if args.message:
        if args.label or args.from_file or args.pid is not None:
            raise UsageError("a message or labels, not both", hint="a message goes in as the label 'message'")
        return _message(args)
    lines = _collect(args)
    if args.db:
        return _write_direct(args, lines)
    return _send(args, lines)


def _list(args: argparse.Namespace) -> int:
    from ingero.cli.output import emit_json
    from ingero.store.annotations import list_annotations
    from ingero.store.db import open_readonly
    from ingero.timeutil import fmt_ts

    conn = open_readonly(common.db_path_from(args))
    try:
        rows = list_annotations(conn)
    finally:
        conn.close()
    if args.json:
        emit_json([a.as_dict() for a in rows])
    else:
        for a in rows:
            sys.stdout.write(f"{fmt_ts(a.timestamp)}  {a.node}  {a.message}  ({a.author})\n")
    return 0


def _message(args: argparse.Namespace) -> int:
    from ingero.cli.output import emit_json
    from ingero.store.annotations import add_annotation
    from ingero.timeutil import parse_time

    db = common.db_path_from(args)
    at = parse_time(args.at) if args.at else None
    note = add_annotation(db, args.message, node=common.identity_from(args).node, timestamp=at)
    if args.json:
        emit_json(note.as_dict())
    else:
        sys.stdout.write(f"annotated {db} (#{note.id})\n")
    return 0


def _collect(args: argparse.Namespace) -> list[AnnotationLine]:
    """The lines to send, validated here first (with their line numbers): --label, else NDJSON."""
    import json

    from ingero.annotate import parse_line
    from ingero.errors import UsageError
    from ingero.timeutil import parse_time

    at = parse_time(args.at) if args.at else None
    if args.label:
        if args.from_file:
            raise UsageError("--label or --from-file, not both")
        labels = {}
        for kv in args.label:
            key, sep, value = kv.partition("=")
            if not sep:
                raise UsageError(f"--label {kv!r}: expected KEY=VALUE")
            labels[key] = value
        doc: dict[str, object] = {"labels": labels}
        if args.pid is not None:
            doc["pid"] = args.pid
        if at is not None:
            doc["ts"] = at
        return [parse_line(json.dumps(doc), now_ns=at)]
    if args.pid is not None or args.at:
        raise UsageError("--pid and --at go with --label", hint="NDJSON lines carry their own pid and ts")
    text = _read_input(args.from_file)
    lines = []
    for n, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            try:
                lines.append(parse_line(raw))
            except UsageError as e:
                raise UsageError(f"line {n}: {e.one_line()}") from None
    if not lines:
        raise UsageError("no annotations given", hint="NDJSON on stdin, --from-file, or --label K=V")
    return lines


def _read_input(path: str | None) -> str:
    from ingero.errors import UsageError

    if path in (None, "-"):
        if path is None and sys.stdin.isatty():
            raise UsageError("no annotations given", hint="NDJSON on stdin, --from-file, --label K=V or a message")
        return sys.stdin.read()
    try:
        return Path(str(path)).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--from-file {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None


def _write_direct(args: argparse.Namespace, lines: list[AnnotationLine]) -> int:
    """No tracer in the way: the lines go into the database, with the agent's pid rule and this
    process as the writer."""
    import os

    from ingero.agent.trace.annotate_socket import Peer, scope
    from ingero.cli.output import emit_json
    from ingero.store.annotations import write_lines

    me = Peer(os.getpid(), os.getuid(), os.getgid())
    db = common.db_path_from(args)
    ids = write_lines(db, [scope(line, me) for line in lines], node=common.identity_from(args).node)
    if args.json:
        emit_json({"db": str(db), "written": len(ids), "ids": ids})
    else:
        sys.stdout.write(f"wrote {len(ids)} annotation(s) into {db}\n")
    return 0


def _send(args: argparse.Namespace, lines: list[AnnotationLine]) -> int:
    """The lines to the tracer's socket, one reply read per line; exit 1 if any was refused."""
    import json

    from ingero.annotate import connect, socket_candidates
    from ingero.cli.output import emit_json, note
    from ingero.errors import IngeroError

    target = Path(args.socket).expanduser() if args.socket else None
    sock = connect(target, timeout_s=10.0)
    if sock is None:
        tried = ", ".join(str(p) for p in ([target] if target else socket_candidates()))
        raise IngeroError(
            f"no tracer is listening for annotations ({tried})",
            hint="start 'ingero trace --annotate', or pass --db to write into a database directly",
        )
    refused: list[tuple[int, str]] = []
    with sock:
        where = sock.getpeername()
        replies = sock.makefile("rb")
        try:
            for n, line in enumerate(lines, 1):
                sock.sendall(json.dumps(line.as_wire(), separators=(",", ":")).encode() + b"\n")
                reply = json.loads(replies.readline() or b"{}")
                if reply.get("ok") is not True:
                    refused.append((n, str(reply.get("error", "no answer from the tracer"))))
        except (OSError, ValueError) as e:
            raise IngeroError(f"annotation socket {where}: {getattr(e, 'strerror', None) or e}") from None
    if args.json:
        emit_json(
            {
                "socket": where,
                "sent": len(lines) - len(refused),
                "refused": [{"line": n, "error": m} for n, m in refused],
            }
        )
    else:
        sys.stdout.write(f"sent {len(lines) - len(refused)} annotation(s) to {where}\n")
        for n, msg in refused:
            note(f"line {n} refused: {msg}")
    return 1 if refused else 0


def fleet_labels(nodes: Any, settings: Any, columns: list[str], rows: list[list[Any]]) -> list[list[Any]]:
    """``query --annotations --nodes``: the merged rows plus their labels. Every node's annotations and
    process lifecycle events come through the same fan-out (so their ``node`` is the rows') and are
    joined here in memory, exactly as on one database. Nodes that cannot answer add no labels."""
    import sqlite3

    from ingero.fleet.operations import query_sync
    from ingero.store.annotation_join import lifecycle_sql, with_labels
    from ingero.store.annotations import ROW_COLUMNS
    from ingero.store.guard import MAX_LIMIT
    from ingero.store.schema import ANNOTATIONS_TABLE

    mem = sqlite3.connect(":memory:")
    try:
        mem.executescript(ANNOTATIONS_TABLE)
        mem.execute("CREATE TABLE events(timestamp, pid, source, op, arg1, node)")
        for table, sql in (
            ("annotations", f"SELECT {', '.join(ROW_COLUMNS)} FROM annotations ORDER BY id"),
            ("events", lifecycle_sql()),
        ):
            got = query_sync(nodes, settings, sql, limit=MAX_LIMIT)
            if got.columns:
                marks = ", ".join("?" * len(got.columns))
                mem.executemany(f"INSERT INTO {table}({', '.join(got.columns)}) VALUES ({marks})", got.rows)
        return with_labels(mem, columns, rows)
    finally:
        mem.close()
