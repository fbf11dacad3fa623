"""Plain-text tables (tabulate, imported only when a table is printed), shortened to fit a width.

A leaf module: the CLI's output options, explain's text report and the demo all render through it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


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
