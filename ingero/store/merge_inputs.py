"""What ``ingero merge`` learns about each input before copying anything: layout, nodes, counts,
time ranges, the next free id sequence per node, and the clock-skew heuristic over those ranges.

Inputs are only ever opened read-only (:func:`ingero.store.db.open_readonly`). The per-node scan is
kept cheap: a database that holds one node (the usual case: one file per node) is checked with one
``WHERE node != ?`` probe and indexed ``min``/``max`` look-ups; only multi-node inputs (an earlier
merge) pay for a ``GROUP BY node``.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from ingero.errors import UsageError
from ingero.identity import validate_node_name
from ingero.store.db import open_readonly, translate
from ingero.store.instance import stored_instance_id
from ingero.store.schema import inspect_layout
from ingero.timeutil import fmt_duration


@dataclass
class NodeStats:
    """One node's events inside one input."""

    node: str  # final name (after --force-node)
    source_node: str  # value of events.node in the input ('' for none / no column)
    events: int
    first_ns: int | None
    last_ns: int | None
    max_seq: int  # highest {seq} among its ids (0 when none)
    min_seq: int = 0  # lowest {seq} (0 when unknown): with max_seq, whether two inputs' ids collide


@dataclass
class InputInfo:
    path: Path
    layout: str  # ingero-py | ingero-0.9 | ingero-0.8 | empty
    has_node: bool
    text_ids: bool
    live: bool
    force_node: str | None
    columns: dict[str, set[str]] = field(default_factory=dict)  # table -> columns
    nodes: list[NodeStats] = field(default_factory=list)
    instance: str | None = None  # the database's stored instance id (ingero.store.instance), if any
    origin: Path | None = None  # the user's file, when ``path`` is a renamed copy of it (twins)

    @property
    def shown(self) -> Path:
        """The input as the user named it."""
        return self.origin or self.path

    @property
    def events(self) -> int:
        return sum(n.events for n in self.nodes)

    @property
    def node_names(self) -> list[str]:
        return [n.node for n in self.nodes]

    @property
    def single_node(self) -> str | None:
        """The node every row of this input belongs to, when there is exactly one."""
        names = {n.node for n in self.nodes if n.node}
        if len(names) == 1:
            return names.pop()
        if not names and self.force_node:
            return self.force_node
        return None

    def has(self, table: str, column: str | None = None) -> bool:
        cols = self.columns.get(table)
        if cols is None:
            return False
        return column is None or column in cols


def parse_force_node(values: list[str] | None, inputs: list[Path]) -> tuple[str | None, dict[Path, str]]:
    """``--force-node NAME`` (every input lacking node names) and ``--force-node FILE=NAME`` (one input)."""
    default: str | None = None
    per_file: dict[Path, str] = {}
    resolved = {p.resolve(): p for p in inputs}
    for raw in values or []:
        if "=" in raw:
            file_part, name = raw.rsplit("=", 1)
            target = Path(file_part).expanduser().resolve()
            if target not in resolved:
                raise UsageError(f"--force-node {raw}: {file_part} is not one of the inputs")
            validate_node_name(name)
            per_file[target] = name
        else:
            if default is not None and default != raw:
                raise UsageError(
                    "--force-node NAME given twice", hint="use --force-node FILE=NAME to name several inputs"
                )
            validate_node_name(raw)
            default = raw
    return default, per_file


def inspect_input(path: Path, force_node: str | None) -> InputInfo:
    """Layout, per-node counts, ranges and max id sequence of one input (read-only)."""
    conn = open_readonly(path)
    try:
        layout = inspect_layout(conn)
        live = Path(str(path) + "-wal").exists()
        columns: dict[str, set[str]] = {}
        for (table,) in conn.execute("SELECT name FROM main.sqlite_master WHERE type = 'table'").fetchall():
            columns[table] = {r[1] for r in conn.execute(f'PRAGMA main.table_info("{table}")')}
        # (layout.has_node sees open_readonly's TEMP views; the copy reads the real tables)
        has_node = "node" in columns.get("events", set())
        info = InputInfo(path, layout.kind, has_node, layout.text_ids, live, force_node, columns)
        if not has_node and not force_node:
            raise UsageError(
                f"{path} is an Ingero 0.8-layout database (no node column): name its node",
                hint=f"pass --force-node NAME (or --force-node {path}=NAME); its ids become NAME:<old id>",
            )
        info.nodes = _node_stats(conn, info)
        info.instance = stored_instance_id(conn)
    except sqlite3.Error as e:
        raise translate(e, path) from None
    finally:
        conn.close()
    return info


def _node_stats(conn: sqlite3.Connection, info: InputInfo) -> list[NodeStats]:
    ev = "main.events"
    total = int(conn.execute(f"SELECT count(*) FROM {ev}").fetchone()[0])
    if not total:
        return []
    if not info.has_node:  # Ingero 0.8: integer ids, one node (the forced name)
        first, last = _range(conn)
        max_id = conn.execute(f"SELECT max(CAST(id AS INTEGER)) FROM {ev}").fetchone()[0]
        return [NodeStats(info.force_node or "", "", total, first, last, int(max_id or 0))]
    first_node = conn.execute(f"SELECT node FROM {ev} LIMIT 1").fetchone()[0]
    others = conn.execute(f"SELECT 1 FROM {ev} WHERE node != ? LIMIT 1", (first_node,)).fetchone()
    if others is None:
        first, last = _range(conn)
        # the first row written holds the lowest sequence number (ids are {node}:{seq}, seq counting up)
        first_id = conn.execute(f"SELECT id FROM {ev} ORDER BY rowid LIMIT 1").fetchone()[0]
        rows = [(first_node, total, first, last, _max_seq(conn, info, first_node), _seq_of(first_id))]
    else:
        rows = conn.execute(
            f"SELECT node, count(*), min(timestamp), max(timestamp), "
            f"max(CAST(substr(id, length(node) + 2) AS INTEGER)), "
            f"min(CAST(substr(id, length(node) + 2) AS INTEGER)) FROM {ev} GROUP BY node"
        ).fetchall()
    out = []
    for node, count, first, last, max_seq, min_seq in rows:
        final = node or info.force_node or ""
        if not node and info.force_node:
            # ids of rows without a node are re-namespaced as {forced}:{old id without ':'}
            max_seq = conn.execute(f"SELECT max(CAST(ltrim(id, ':') AS INTEGER)) FROM {ev} WHERE node = ''").fetchone()[
                0
            ]
        out.append(NodeStats(final, node, int(count), first, last, int(max_seq or 0), int(min_seq or 0)))
    return out


def _seq_of(event_id: object) -> int:
    """The ``{seq}`` of an id ``{node}:{seq}`` (0 when it has none)."""
    tail = str(event_id).rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _range(conn: sqlite3.Connection) -> tuple[int | None, int | None]:
    # Two statements: each is one index look-up, where one min()+max() statement would scan.
    first = conn.execute("SELECT min(timestamp) FROM main.events").fetchone()[0]
    last = conn.execute("SELECT max(timestamp) FROM main.events").fetchone()[0]
    return first, last


def _max_seq(conn: sqlite3.Connection, info: InputInfo, node: str) -> int:
    if not node:
        return 0
    if info.has("node_seq", "next_seq"):
        row = conn.execute("SELECT next_seq FROM main.node_seq WHERE node = ?", (node,)).fetchone()
        if row is not None:
            return int(row[0]) - 1
    found = conn.execute("SELECT max(CAST(substr(id, ?) AS INTEGER)) FROM main.events", (len(node) + 2,)).fetchone()[0]
    return int(found or 0)


# --- clock skew heuristic ----------------------------------------------------------------------


def skew_warnings(inputs: list[InputInfo], threshold_ns: int) -> list[str]:
    """Warnings when the nodes' recorded time ranges suggest their clocks disagree.

    Nodes that recorded the same job start and stop at about the same moments; a node whose whole
    range sits shifted against the others (both ends offset by about the same amount) looks like
    a clock offset. Ranges that do not overlap at all are called out separately: either different
    recording windows, or clocks skewed by at least the gap. The merge never shifts timestamps.
    """
    ranges: dict[str, tuple[int, int]] = {}
    for inp in inputs:
        for n in inp.nodes:
            if n.first_ns is None or n.last_ns is None or not n.node:
                continue
            lo, hi = ranges.get(n.node, (n.first_ns, n.last_ns))
            ranges[n.node] = (min(lo, n.first_ns), max(hi, n.last_ns))
    if len(ranges) < 2:
        return []
    names = sorted(ranges)
    starts = sorted(ranges[n][0] for n in names)
    ends = sorted(ranges[n][1] for n in names)
    mid_start = starts[len(starts) // 2]
    mid_end = ends[len(ends) // 2]
    warnings: list[str] = []
    latest_start = max(names, key=lambda n: ranges[n][0])
    earliest_end = min(names, key=lambda n: ranges[n][1])
    if ranges[latest_start][0] > ranges[earliest_end][1]:
        gap = ranges[latest_start][0] - ranges[earliest_end][1]
        warnings.append(
            f"recordings do not overlap in time: {earliest_end} ends {fmt_duration(gap)} before {latest_start} "
            "starts (different recording windows, or clocks skewed by at least that much); "
            "timestamps are merged as recorded"
        )
        return warnings
    for name in names:
        d_start = ranges[name][0] - mid_start
        d_end = ranges[name][1] - mid_end
        if abs(d_start) <= threshold_ns or abs(d_end) <= threshold_ns or (d_start > 0) != (d_end > 0):
            continue  # one end lines up, or the ends moved in opposite directions: not a clock offset
        shift = d_start if abs(d_start) < abs(d_end) else d_end
        direction = "ahead of" if shift > 0 else "behind"
        warnings.append(
            f"possible clock skew: {name}'s recording is shifted about {fmt_duration(abs(shift))} {direction} "
            f"the other nodes (start {fmt_duration(abs(d_start))}, end {fmt_duration(abs(d_end))} off the median), "
            f"over the {fmt_duration(threshold_ns)} threshold; timestamps are merged as recorded "
            "(ingero export --nodes corrects live fleets by measured offsets)"
        )
    return warnings
