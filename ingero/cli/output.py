"""Shared output options and rendering: table (tabulate), ``--json``, ``--csv``; notes on stderr."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from typing import IO, Any

from ingero.texttable import render_table


def add_output_args(parser: argparse.ArgumentParser, *, csv_ok: bool = True, rows_ok: bool = False) -> None:
    """``--json`` (and ``--csv``); with ``rows_ok`` (commands that print one result set) also ``--tsv``,
    ``--nl`` (one JSON object per row) and ``--no-headers``."""
    g = parser.add_argument_group("output")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json", dest="format", action="store_const", const="json", help="JSON for machines")
    if csv_ok:
        fmt.add_argument("--csv", dest="format", action="store_const", const="csv", help="CSV with a header row")
    if rows_ok:
        fmt.add_argument("--tsv", dest="format", action="store_const", const="tsv", help="tab-separated values")
        fmt.add_argument("--nl", dest="format", action="store_const", const="nl", help="JSON lines: one object per row")
        g.add_argument("--no-headers", dest="headers", action="store_false", help="no header row (table, CSV, TSV)")
    parser.set_defaults(format="table", headers=True)


def warn(message: str) -> None:
    print(f"ingero: warning: {message}", file=sys.stderr)


def note(message: str) -> None:
    print(f"ingero: {message}", file=sys.stderr)


def terminal_width(stream: IO[str]) -> int | None:
    """The terminal's width ($COLUMNS first) when ``stream`` is a terminal; None for pipes and files."""
    import shutil

    if not getattr(stream, "isatty", lambda: False)():
        return None
    return shutil.get_terminal_size().columns


def emit_rows(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    fmt: str,
    *,
    meta: dict[str, Any] | None = None,
    stream: IO[str] | None = None,
    headers: bool = True,
) -> None:
    """Print a result set. ``meta`` (truncated, elapsed, nodes, ...) goes into the JSON object only."""
    out = stream or sys.stdout
    if fmt == "json":
        doc: dict[str, Any] = {"columns": list(columns), "rows": [list(r) for r in rows]}
        doc.update(meta or {})
        json.dump(doc, out, ensure_ascii=False, default=str)
        out.write("\n")
    elif fmt == "nl":
        names = list(columns)
        for r in rows:
            json.dump(dict(zip(names, r, strict=True)), out, ensure_ascii=False, default=str)
            out.write("\n")
    elif fmt in ("csv", "tsv"):
        w = csv.writer(out, lineterminator="\n", delimiter="\t" if fmt == "tsv" else ",")
        if headers:
            w.writerow(columns)
        w.writerows(rows)
    else:
        text = render_table(columns, rows, headers=headers, width=terminal_width(out))
        if text:
            out.write(text + "\n")


def emit_json(doc: Any, stream: IO[str] | None = None) -> None:
    out = stream or sys.stdout
    json.dump(doc, out, ensure_ascii=False, indent=2, default=str)
    out.write("\n")
