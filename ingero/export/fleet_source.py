"""``ingero export --nodes``: node traces fetched from live agents through the fleet client.

One fan-out (:meth:`ingero.fleet.client.FleetClient.fan_out`), one job per agent, with the client's
clock-skew samples taken alongside on the same connections:

1. ``/api/v1/info`` (identity, layout) and ``/api/v1/chains`` (the agent resolves the window — on a
   finished recording ``--since`` counts back from its last event — and returns it with the chains);
2. ``process_names`` through ``/api/v1/query``;
3. the events in the window, paged with keyset SQL on ``(timestamp, rowid)`` (the timestamp index
   serves it; each page is one guarded query, well under the agent's row and byte caps) until the
   window is exhausted or ``--max-events``;
4. the serving engines' series in the window (``trace --inference``), paged by rowid, when the
   recording has them: counter tracks (:mod:`ingero.export.engine_tracks`).

Each node's measured clock offset (agent minus this host) is subtracted from its timestamps, and the
trace metadata records it with its uncertainty. Nodes that fail are reported and left out; with none
answering the export fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ingero.errors import NoNodeAnsweredError
from ingero.explain.model import Chain
from ingero.export.engine_tracks import rows_sql, tracks_of
from ingero.export.perfetto import EXPORT_COLUMNS, NodeTrace, iter_rows
from ingero.fleet.outcome import NodeOutcome
from ingero.store.engine_metrics import TABLE as ENGINE_TABLE

if TYPE_CHECKING:
    from ingero.config import NodeSpec
    from ingero.fleet.settings import ClientSettings

PAGE_ROWS = 5000
DEFAULT_EXPORT_TIMEOUT_S = 120.0


def _window_sql(start: Any, end: Any, column: str = "timestamp") -> list[str]:
    conds = []
    if isinstance(start, int):
        conds.append(f"{column} >= {int(start)}")
    if isinstance(end, int):
        conds.append(f"{column} <= {int(end)}")
    return conds


async def _fetch_node(conn: Any, params: dict[str, str] | None, max_events: int) -> dict[str, Any]:
    """The fan-out job for one agent (``conn`` is a :class:`ingero.fleet.client.NodeClient`)."""
    info = await conn.get("/api/v1/info")
    chains = await conn.get("/api/v1/chains", params)
    window = chains.get("window") if isinstance(chains.get("window"), dict) else {}
    names = await conn.post("/api/v1/query", {"sql": "SELECT pid, name FROM process_names", "limit": 10_000})
    has_node = info.get("layout") != "ingero-0.8"
    node_col = "node" if has_node else "''"
    rows: list[list[Any]] = []
    cursor: tuple[int, int] | None = None
    capped = False
    while True:
        conds = _window_sql(window.get("start_ns"), window.get("end_ns"))
        if cursor is not None:
            conds.append(f"(timestamp > {cursor[0]} OR (timestamp = {cursor[0]} AND rowid > {cursor[1]}))")
        want = min(PAGE_ROWS, max_events - len(rows))
        sql = (
            f"SELECT rowid, {node_col}, {EXPORT_COLUMNS} FROM main.events WHERE {' AND '.join(conds) or '1'} "
            "ORDER BY timestamp, rowid"
        )
        page = await conn.post("/api/v1/query", {"sql": sql, "limit": want})
        got = page.get("rows") or []
        rows.extend(got)
        if not page.get("truncated") or not got:
            break
        if len(rows) >= max_events:
            capped = True
            break
        cursor = (int(got[-1][2]), int(got[-1][0]))
    engine = await _engine_rows(conn, window) if has_node else []
    return {
        "info": info,
        "chains": chains,
        "names": names,
        "rows": rows,
        "engine": engine,
        "window": window,
        "capped": capped,
    }


async def _engine_rows(conn: Any, window: dict[str, Any]) -> list[list[Any]]:
    """The agent's engine_metrics rows in the window (none when its recording has no such table)."""
    has = await conn.post(
        "/api/v1/query",
        {"sql": f"SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '{ENGINE_TABLE}'", "limit": 1},
    )
    if not has.get("rows"):
        return []
    out: list[list[Any]] = []
    last = 0
    while True:
        conds = [*_window_sql(window.get("start_ns"), window.get("end_ns"), "ts"), f"rowid > {last}"]
        sql = rows_sql(" AND ".join(conds), "rowid", with_rowid=True)
        page = await conn.post("/api/v1/query", {"sql": sql, "limit": PAGE_ROWS})
        got = page.get("rows") or []
        out += [r[1:] for r in got]
        if not page.get("truncated") or not got:
            return out
        last = int(got[-1][0])


def _chains(body: Any, default_node: str) -> list[Chain]:
    found: dict[str, Chain] = {}
    for key in ("stored", "chains"):  # computed chains replace stored rows with the same id
        for d in body.get(key) or [] if isinstance(body, dict) else []:
            if isinstance(d, dict):
                c = Chain.from_dict(d)
                c.node = c.node or default_node
                found[c.id] = c
    return list(found.values())


def node_traces(outcome: NodeOutcome) -> list[NodeTrace]:
    """The traces of one answered agent (several when it serves a merged database)."""
    data = outcome.data
    info = data["info"]
    ident = str(info.get("node") or outcome.label)
    offset = round(outcome.skew.offset_ns) if outcome.skew else 0
    uncertainty = round(outcome.skew.uncertainty_ns) if outcome.skew else None
    names_body = data["names"]
    names = {int(r[0]): str(r[1]) for r in names_body.get("rows") or [] if len(r) == 2}
    # a twin (another agent of the fleet answered with the same name) is labelled name@host:port
    own_label = outcome.label if outcome.twin else ident
    by_node: dict[str, list[list[Any]]] = {}
    for r in data["rows"]:
        node = str(r[1] or ident)
        by_node.setdefault(own_label if node == ident else node, []).append(r[2:])
    chains = _chains(data["chains"], ident)
    for c in chains:
        if c.node == ident:
            c.node = own_label
        by_node.setdefault(c.node, [])
    engine = tracks_of(
        [[*r[:1], own_label if str(r[1] or ident) == ident else r[1], *r[2:]] for r in data.get("engine", [])]
    )
    for node in engine:
        by_node.setdefault(node, [])
    traces = []
    for node, rows in by_node.items():
        own = node == own_label
        traces.append(
            NodeTrace(
                node=node,
                rank=info.get("rank") if own else None,
                world_size=info.get("world_size") if own else None,
                first_ns=int(rows[0][0]) if rows else None,
                events=iter_rows(rows),
                process_names=names,
                chains=[c for c in chains if c.node == node],
                offset_ns=offset,
                offset_uncertainty_ns=uncertainty,
                engine_tracks=engine.get(node, []),
            )
        )
    return traces


@dataclass
class FleetExport:
    """What :func:`export_fleet` fetched: the traces, the export's metadata, and lines for the user."""

    traces: list[NodeTrace]
    meta: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def export_fleet(
    nodes: Sequence[NodeSpec],
    settings: ClientSettings,
    *,
    since: str | None = None,
    from_: str | None = None,
    to: str | None = None,
    max_events: int,
    strict: bool = False,
) -> FleetExport:
    """Fetch every node's trace; the unanswered nodes and skew corrections come back as warning lines."""
    import trio

    from ingero.fleet.client import FleetClient
    from ingero.fleet.operations import window_params
    from ingero.fleet.render import skew_warnings, unanswered_lines

    params = window_params(since, from_, to)

    async def main() -> list[NodeOutcome]:
        async def job(conn: Any) -> dict[str, Any]:
            return await _fetch_node(conn, params, max_events)

        async with FleetClient(nodes, settings) as fc:
            return await fc.fan_out(job)

    outcomes: list[NodeOutcome] = trio.run(main)
    answered = [o for o in outcomes if o.answered]
    warnings = unanswered_lines(outcomes)
    if not answered:
        raise NoNodeAnsweredError("no node answered: " + "; ".join(unanswered_lines(outcomes)))
    if strict and len(answered) < len(outcomes):
        raise NoNodeAnsweredError(f"{len(outcomes) - len(answered)} node(s) did not answer (--strict)")
    warnings += [line + " — corrected in the export" for line in skew_warnings(outcomes, settings.skew_threshold_ms)]
    traces: list[NodeTrace] = []
    for o in sorted(answered, key=lambda o: o.label):
        if o.data.get("capped"):
            warnings.append(
                f"{o.label}: stopped at --max-events {max_events}; narrow the window with --since/--from/--to"
            )
        traces.extend(node_traces(o))
    traces.sort(key=lambda t: (t.rank if t.rank is not None else 1 << 30, t.node))
    meta = {
        "source": "fleet",
        "clock_correction": "each node's timestamps are shifted by its measured clock offset (agent clock minus "
        "this host's, NTP four-timestamp method, lowest-delay sample); see nodes[].clock_offset_ns",
        "unreachable": [o.as_dict() for o in outcomes if not o.answered],
        "windows": {o.label: o.data.get("window") for o in answered},
    }
    return FleetExport(traces, meta, warnings)
