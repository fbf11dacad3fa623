"""The fleet tools: one fan-out each through the fleet client (:mod:`ingero.fleet`).

``query_fleet`` (Ingero's name; actions chains, sql, ops, overview, status), ``fleet_status`` (ours:
reachability, versions, clock skew), ``find_outlier_nodes`` (the straggler verdict — from aligned NCCL
collectives where the nodes recorded them — with outlier ranks by median absolute deviation),
``get_cost`` (what the waiting cost) and ``event_history`` (local, or every node's with fleet=true).
They run on the caller's trio loop. Every answer starts with the clock-skew warnings and the nodes
that did not answer (with their reasons), then the merged data with a ``node`` column first.
Unreachable nodes are listed, never raised: partial answers are answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import Field

from ingero.config import GpuRates, NodeSpec
from ingero.errors import UsageError
from ingero.fleet.outcome import NodeOutcome
from ingero.fleet.settings import ClientSettings
from ingero.store.catalog import lookup_op
from ingero.tools.local import MAX_SQL_ROWS, Since, chain_dict, check_limit, check_since
from ingero.tools.registry import ToolEnv, iso_us, tool

Action = Literal["chains", "sql", "ops", "overview", "status"]
ACTIONS: tuple[str, ...] = get_args(Action)
OPS_COLUMNS = ["node", "source", "op", "count", "p50_us", "p95_us", "p99_us", "max_us", "tail_ratio", "total_ms"]
OVERVIEW_COLUMNS = ["node", "events", "first", "last", "live", "high", "medium", "low", "top_op", "top_op_p99_us"]


def _ledger(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agents' ledger rows, each with its line as ``ingero explain`` words it (like get_causal_chains)."""
    from ingero.explain.ledger import LedgerRow, describe

    return [{**r, "summary": describe(LedgerRow.from_dict(r))} for r in rows]


def _header(outcomes: Sequence[NodeOutcome], settings: ClientSettings) -> dict[str, Any]:
    from ingero.fleet.render import skew_warnings, twin_warning, unanswered_lines

    answered = [o for o in outcomes if o.answered]
    twins = twin_warning(outcomes)
    return {
        "identity_warnings": [twins] if twins else [],
        "clock_skew_warnings": skew_warnings(outcomes, settings.skew_threshold_ms),
        "unreachable": unanswered_lines(outcomes),
        "answered": len(answered),
        "asked": len(outcomes),
        "nodes": [o.as_dict() for o in outcomes],
    }


def _nodes(env: ToolEnv) -> Sequence[NodeSpec]:
    if not env.nodes:
        raise UsageError(
            "no fleet nodes configured",
            hint="list them under fleet.nodes in the config given to 'ingero mcp --config', or pass --nodes",
        )
    return env.nodes


@tool("Ask the whole fleet", scope="fleet")
async def query_fleet(
    env: ToolEnv,
    action: Action,
    since: Since = None,
    sql: Annotated[str | None, Field(description="the SELECT for action=sql")] = None,
    limit: Annotated[int, Field(ge=1, le=MAX_SQL_ROWS, description=f"rows/chains per node (1..{MAX_SQL_ROWS})")] = 200,
) -> dict[str, Any]:
    """Ask every agent of the fleet at once (nodes from the config) and merge the answers under a 'node'
    column. action: chains (causal chains + straggler verdict), sql (needs sql), ops (per-op latency
    p50/p95/p99), overview, status (reachability, versions, clock skew). The answer starts with
    clock-skew warnings and the nodes that did not answer."""
    return await fleet_action(_nodes(env), env.fleet, action, since=since, sql=sql, limit=limit)


@tool("Fleet status", scope="fleet")
async def fleet_status(env: ToolEnv) -> dict[str, Any]:
    """Every node: reachable or why not, version, rank, TLS mode, events, clock offset ± uncertainty."""
    return await fleet_action(_nodes(env), env.fleet, "status")


if TYPE_CHECKING:
    Metric = str
else:  # the enum published in the schema is the metric table of ingero.fleet.outliers itself
    from ingero.fleet.outliers import METRICS

    Metric = Literal[tuple(METRICS)]
Comm = Annotated[str | None, Field(description="one communicator (its 16-hex-digit id)")]


async def _stragglers(env: ToolEnv, since: str | None, comm: str | None, *, with_chain: bool, rates: GpuRates) -> Any:
    from ingero.fleet.collective_ops import fleet_stragglers

    return await fleet_stragglers(
        _nodes(env), env.fleet, since=check_since(since), comm=comm or None, rates=rates, with_chain=with_chain
    )


def _report_fields(report: Any) -> dict[str, Any]:
    """The straggler report without what the header already says (outcomes, counts, timing)."""
    doc: dict[str, Any] = report.as_dict()
    for key in ("nodes", "answered", "failed", "elapsed_ms"):
        doc.pop(key, None)
    if isinstance(doc.get("chain"), dict) and isinstance(doc["chain"].get("detected_at"), int):
        doc["chain"] = {**doc["chain"], "detected_at": iso_us(doc["chain"]["detected_at"])}
    return doc


@tool("Outlier nodes", scope="fleet")
async def find_outlier_nodes(
    env: ToolEnv,
    since: Since = None,
    metric: Annotated[Metric, Field(description="lag (median ms late), last (share arriving last), wait")] = "lag",
    threshold: Annotated[float, Field(gt=0, le=100, description="robust z-score a slow rank must reach")] = 3.5,
    comm: Comm = None,
) -> dict[str, Any]:
    """Which rank/node is dragging the job: NCCL collectives aligned across ranks (the k-th call of each
    communicator, clock-skew corrected), each rank's lag and waiting, slow ranks by median absolute
    deviation on the metric; without collectives, the host/latency verdict. With the straggler's top
    causal chain."""
    from ingero.fleet.outliers import outlier_ranks

    report = await _stragglers(env, since, comm, with_chain=True, rates=env.rates)
    ranks = report.collectives.ranks if report.collectives is not None else []
    outliers = outlier_ranks(ranks, metric, threshold)
    return {
        **_header(report.outcomes, env.fleet),
        **_report_fields(report),
        "outliers": {"metric": metric, "threshold": threshold, "ranks": [o.as_dict() for o in outliers]},
    }


@tool("Cost of waiting", scope="fleet")
async def get_cost(
    env: ToolEnv,
    since: Since = None,
    usd_per_gpu_hour: Annotated[
        float | None, Field(ge=0, description="one rate for every GPU (default: fleet.gpu_hourly_usd)")
    ] = None,
    comm: Comm = None,
) -> dict[str, Any]:
    """Dollars of GPU time the ranks burned waiting for peers inside NCCL collectives in the window, per
    rank, at each GPU's hourly rate (fleet.gpu_hourly_usd in the config, or usd_per_gpu_hour)."""
    rates = env.rates if usd_per_gpu_hour is None else GpuRates(default=usd_per_gpu_hour)
    report = await _stragglers(env, since, comm, with_chain=False, rates=rates)
    return {**_header(report.outcomes, env.fleet), "headline": report.headline(), "cost": report.cost.as_dict()}


@tool("Event history", scope="local")
async def event_history(
    env: ToolEnv,
    since: Since = None,
    node: Annotated[str | None, Field(description="only this node's events")] = None,
    op: Annotated[str | None, Field(description="only this op (e.g. cuLaunchKernel, sched_switch)")] = None,
    limit: Annotated[int, Field(ge=1, le=MAX_SQL_ROWS, description=f"latest events (1..{MAX_SQL_ROWS})")] = 200,
    fleet: Annotated[bool, Field(description="ask every node of the fleet instead of the local database")] = False,
) -> dict[str, Any]:
    """The latest events in the window, newest first: time (ISO-8601 µs), node, pid, tid, source, op,
    duration (µs) — a timeline of ops and host events per node; fleet=true merges every node's."""
    import anyio

    from ingero.tools.local import EVENT_COLUMNS, event_history_local, event_row

    since = check_since(since)
    if op:
        lookup_op(op)  # an unknown op is this call's error, not every node's
    if not fleet:
        db = env.need_db()
        return await anyio.to_thread.run_sync(lambda: event_history_local(db, since, node, op, limit))
    from ingero.fleet import operations as ops

    nodes = _nodes(env)
    named = [n for n in nodes if node and n.name == node]
    sql = f"SELECT timestamp, pid, tid, source, op, duration FROM events ORDER BY timestamp DESC, id LIMIT {limit + 1}"
    result = await ops.fleet_query(named or nodes, env.fleet, sql, limit=limit + 1, since=since, op=op)
    col = {c: i for i, c in enumerate(result.columns)}
    picked = [r for r in result.rows if not node or r[col["node"]] == node]
    picked.sort(key=lambda r: r[col["timestamp"]], reverse=True)
    keys = ("timestamp", "node", "pid", "tid", "source", "op", "duration")
    return {
        **_header(result.outcomes, env.fleet),
        "limit": limit,
        "truncated": len(picked) > limit or bool(result.truncated),
        "columns": EVENT_COLUMNS,
        "rows": [event_row(*(r[col[k]] for k in keys)) for r in picked[:limit]],
    }


async def fleet_action(
    nodes: Sequence[NodeSpec],
    settings: ClientSettings,
    action: str,
    since: str | None = None,
    sql: str | None = None,
    limit: int = 200,
) -> dict[str, Any]:
    """Fan ``action`` out to every node; raises UsageError on bad input, FleetError-free otherwise:
    unreachable nodes are listed, never raised (partial answers are answers)."""
    from ingero.fleet import operations as ops

    if action not in ACTIONS:
        raise UsageError(f"action={action!r} is not one of {', '.join(ACTIONS)}")
    if not nodes:
        raise UsageError(
            "no fleet nodes configured",
            hint="list them under fleet.nodes in the config given to 'ingero mcp --config', or pass --nodes",
        )
    since = check_since(since)
    check_limit(limit, "limit", MAX_SQL_ROWS)
    if action == "sql":
        if not isinstance(sql, str) or not sql.strip():
            raise UsageError(
                "action=sql needs sql", hint="e.g. SELECT source, count(*) AS n FROM events GROUP BY source"
            )
        result = await ops.fleet_query(nodes, settings, sql, limit=limit, since=since)
        return {
            **_header(result.outcomes, settings),
            "limit": limit,
            "columns": result.columns,
            "rows": result.rows,
            "rows_by_node": result.rows_by_node,
            "truncated_nodes": [o.label for o in result.truncated],
        }
    if sql:
        raise UsageError(f"sql is only used with action=sql (not {action})")
    if action == "chains":
        fleet = await ops.fleet_explain(nodes, settings, since=since)
        return {
            **_header(fleet.outcomes, settings),
            "straggler": fleet.verdict.as_dict(),
            "limit": limit,
            "chains": [chain_dict(c) for c in fleet.chains[:limit]],
            "ledger": _ledger(fleet.ledger),  # every node's GPU threads: where their wall time went
            "windows": fleet.windows,
        }
    if action == "ops":
        outcomes = await ops.fleet_ops(nodes, settings, since=since)
        rows = []
        for o in outcomes:
            body = o.data if o.answered and isinstance(o.data, dict) else {}
            for d in body.get("ops") or []:
                if isinstance(d, dict):
                    rows.append([o.label, *(d.get(c) for c in OPS_COLUMNS[1:])])
        return {**_header(outcomes, settings), "columns": OPS_COLUMNS, "rows": rows[: limit * max(1, len(nodes))]}
    if action == "overview":
        return await _overview(nodes, settings, since)
    status = await ops.fleet_status(nodes, settings)
    return {**_header(status.outcomes, settings), "columns": status.columns, "rows": status.rows()}


async def _overview(nodes: Sequence[NodeSpec], settings: ClientSettings, since: str | None) -> dict[str, Any]:
    from ingero.fleet.client import FleetClient
    from ingero.fleet.operations import window_params

    async with FleetClient(nodes, settings) as fc:
        outcomes = await fc.request_all("GET", "/api/v1/overview", params=window_params(since))
    rows = []
    for o in sorted(outcomes, key=lambda o: o.label):
        body = o.data if o.answered and isinstance(o.data, dict) else None
        if body is None:
            continue
        raw_counts, raw_ops = body.get("chain_counts"), body.get("top_ops")
        counts: dict[str, Any] = raw_counts if isinstance(raw_counts, dict) else {}
        top_ops: list[Any] = raw_ops if isinstance(raw_ops, list) else []
        top: dict[str, Any] = top_ops[0] if top_ops and isinstance(top_ops[0], dict) else {}
        rows.append(
            [
                o.label,
                body.get("events"),
                iso_us(_int(body.get("first_ns"))),
                iso_us(_int(body.get("last_ns"))),
                body.get("live"),
                counts.get("HIGH", 0),
                counts.get("MEDIUM", 0),
                counts.get("LOW", 0),
                top.get("op"),
                top.get("p99_us"),
            ]
        )
    return {**_header(outcomes, settings), "columns": OVERVIEW_COLUMNS, "rows": rows}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
