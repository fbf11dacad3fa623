"""Shared output options and rendering: table (tabulate), ``--json``, ``--csv``; notes on stderr."""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from typing import IO, Any


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


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return round(v, 3)
    if v is None:
        return ""
    return v


MIN_CELL = 8  # a shortened text cell keeps at least this many characters


def _fit(cells: list[list[Any]], columns: Sequence[str], width: int) -> None:
    """Shorten the widest text cells (in place, with '…') until a row fits ``width`` characters."""
    n = len(columns)
    # tabulate pads each header by 2 (MIN_PADDING), so a column is at least its name plus 2
    widths = [max([len(str(c)) + 2] + [len(str(r[i])) for r in cells]) for i, c in enumerate(columns)]
    excess = sum(widths) + 2 * (n - 1) - width
    while excess > 0:
        i = max(range(n), key=lambda k: widths[k] if any(isinstance(r[k], str) for r in cells) else -1)
        if widths[i] <= MIN_CELL or not any(isinstance(r[i], str) for r in cells):
            return  # nothing left to shorten: let it wrap
        new = max(MIN_CELL, widths[i] - excess, len(str(columns[i])) + 2)
        if new >= widths[i]:
            return
        for r in cells:
            if isinstance(r[i], str) and len(r[i]) > new:
                r[i] = r[i][: new - 1] + "…"
        excess -= widths[i] - new
        widths[i] = new


def terminal_width(stream: IO[str]) -> int | None:
    """The terminal's width ($COLUMNS first) when ``stream`` is a terminal; None for pipes and files."""
    import shutil

    if not getattr(stream, "isatty", lambda: False)():
        return None
    return shutil.get_terminal_size().columns


def render_table(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], *, headers: bool = True, width: int | None = None
) -> str:
    """A text table; with ``width``, long text cells are shortened (…) so that rows fit it."""
    if not columns:
        return ""
    from tabulate import tabulate  # ~20 ms of imports: only when a table is printed

    cells = [[_cell(v) for v in r] for r in rows]
    if width:
        _fit(cells, columns, width)
    align = [
        "right" if cells and all(isinstance(r[i], int | float) or r[i] == "" for r in cells) else "left"
        for i in range(len(columns))
    ]
    return tabulate(
        cells,
        headers=list(columns) if headers else (),
        tablefmt="simple" if headers else "plain",
        disable_numparse=True,
        missingval="",
        colalign=align,
    )


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
