"""The fleet operations: query, explain, ops, status — async, plus ``*_sync`` wrappers (``trio.run``).

Each takes the node list and :class:`~ingero.fleet.settings.ClientSettings` (or an open
:class:`~ingero.fleet.client.FleetClient` through ``client=``), fans out once with clock-skew
sampling alongside, and returns merged data together with every node's outcome.

``fleet_status`` and ``fleet_explain`` then compute the fleet's clock estimates together
(:func:`ingero.fleet.skew.refine`, numpy: drift, fleet median, MAD outliers); ``fleet_query`` keeps each
node's own estimate (the same offset ± bound) and no numpy: measured on 4 local agents, the numpy pass
added ~150 ms to a query's wall time (its import, after the answers), and a query shows no drift or
outlier column.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from ingero import API_VERSION
from ingero.config import NodeSpec
from ingero.fleet.client import FleetClient, NodeClient, OutcomeCallback
from ingero.fleet.merge import FleetChains, FleetResult, merge_chains, merge_rows
from ingero.fleet.outcome import Kind, NodeFailure, NodeOutcome, Outcomes
from ingero.fleet.settings import ClientSettings
from ingero.fleet.skew import refine
from ingero.timeutil import NS_PER_MS, fmt_ts


@asynccontextmanager
async def _client(
    nodes: Sequence[NodeSpec], settings: ClientSettings | None, client: FleetClient | None
) -> AsyncIterator[FleetClient]:
    """The caller's open client, or a fresh one closed afterwards."""
    if client is not None:
        yield client
        return
    async with FleetClient(nodes, settings) as fc:
        yield fc


async def fleet_query(
    nodes: Sequence[NodeSpec],
    settings: ClientSettings | None,
    sql: str,
    *,
    limit: int | None = None,
    timeout_ms: int | None = None,
    since: str | None = None,
    from_: str | None = None,
    to: str | None = None,
    pid: int | None = None,
    op: str | None = None,
    client: FleetClient | None = None,
    on_outcome: OutcomeCallback | None = None,
) -> FleetResult:
    """``POST /api/v1/query`` on every node; rows merged under ``node`` (see :mod:`ingero.fleet.merge`).

    ``limit`` caps rows per node. ``since``/``from_``/``to``/``pid``/``op`` restrict what the table
    ``events`` shows to the SQL on each node (each agent resolves ``since`` against its own data).
    """
    body: dict[str, Any] = {"sql": sql}
    extra = {"limit": limit, "timeout_ms": timeout_ms, "since": since, "from": from_, "to": to, "pid": pid, "op": op}
    body.update({k: v for k, v in extra.items() if v is not None})

    async def job(conn: NodeClient) -> dict[str, Any]:
        return await conn.post("/api/v1/query", body)

    started = time.perf_counter()
    async with _client(nodes, settings, client) as fc:
        outcomes = await fc.fan_out(job, on_outcome=on_outcome)
    return merge_rows(outcomes, (time.perf_counter() - started) * 1000)


def window_params(since: str | None = None, from_: str | None = None, to: str | None = None) -> dict[str, str] | None:
    params = {k: v for k, v in (("since", since), ("from", from_), ("to", to)) if v}
    return params or None


async def fleet_explain(
    nodes: Sequence[NodeSpec],
    settings: ClientSettings | None,
    *,
    since: str | None = None,
    from_: str | None = None,
    to: str | None = None,
    op: str | None = None,
    node: str | None = None,
    stored: bool = False,
    per_process: bool = False,
    annotation: str | None = None,
    annotations: bool = False,
    client: FleetClient | None = None,
    on_outcome: OutcomeCallback | None = None,
) -> FleetChains:
    """``/chains`` and ``/ops`` from every node: chains merged and the straggler verdict.

    ``op``/``node``/``stored`` select chains as local ``explain --op/--node/--chains`` does
    (see :func:`~ingero.fleet.merge.merge_chains`); ``per_process`` has every agent compute its chains
    for each GPU process (``explain --per-process``). ``annotation`` (``step=12``) has each agent explain
    that value's span(s) (a node without one answers so: :func:`~ingero.fleet.labels.label_job`);
    ``annotations`` adds each node's label summary.
    """
    # numpy and the explain model are imported here, not with the module: a fleet query needs neither
    from ingero.fleet.collective_ops import collective_verdict, fetch_collectives, node_calls
    from ingero.fleet.straggler import with_collectives

    params = window_params(since, from_, to)

    from ingero.fleet.labels import check_some_span, label_job, label_params

    chain_params = {**(params or {}), "per_process": "1"} if per_process else params
    chain_params = label_params(chain_params, annotation=annotation, annotations=annotations)
    missing: list[NodeSpec] = []  # nodes without a span of ``annotation``
    # the late rank across nodes (no NCCL rows): judged on every node's whole window, from its step summary
    judged = annotation is None and op is None and not stored and len(nodes) != 1

    async def job(conn: NodeClient) -> dict[str, Any]:
        from ingero.fleet.late_ranks import ask_with_steps

        def ask(p: dict[str, str] | None) -> Awaitable[dict[str, Any]]:
            return label_job(conn, p, annotation=annotation, annotations=annotations, missing=missing)

        chains = await (ask_with_steps(ask, chain_params) if judged else ask(chain_params))
        if isinstance(chains.get("ops"), list) and isinstance(chains.get("host"), dict) and not per_process:
            ops = {"ops": chains["ops"], "host": chains["host"]}  # the agent computed them with the chains
        else:  # an older agent, or per-process chains (whose op tables are per process): ask /ops
            ops = await conn.get("/api/v1/ops", params)
        for name, b in (("chains", chains), ("ops", ops)):
            if not isinstance(b.get(name), list):
                raise NodeFailure(Kind.SCHEMA, f"the /{name} answer has no '{name}' list")
        return {"chains": chains, "ops": ops, "collectives": await fetch_collectives(conn, params)}

    started = time.perf_counter()
    async with _client(nodes, settings, client) as fc:
        outcomes = await refine(await fc.fan_out(job, on_outcome=on_outcome))
    check_some_span(annotation, missing, outcomes)
    fleet = merge_chains(outcomes, (time.perf_counter() - started) * 1000, op=op, node=node, stored=stored)
    if judged:
        from ingero.fleet.late_ranks import with_late_rank, with_late_ranks

        told, fleet.notes = with_late_ranks(outcomes, fleet.chains)  # judged on every node; shown as --node says
        fleet.chains = [c for c in told if node is None or c.node == node]
        fleet.verdict = with_late_rank(fleet.verdict, told)
    calls = node_calls(outcomes)  # where nodes recorded collectives, their verdict replaces the host one
    if any(len(c) for c in calls):
        fleet.verdict = with_collectives(fleet.verdict, collective_verdict(calls))
    return fleet


async def fleet_ops(
    nodes: Sequence[NodeSpec],
    settings: ClientSettings | None,
    *,
    since: str | None = None,
    from_: str | None = None,
    to: str | None = None,
    client: FleetClient | None = None,
    on_outcome: OutcomeCallback | None = None,
) -> list[NodeOutcome]:
    """``/api/v1/ops`` from every node (each answered outcome's ``data`` is the agent's body)."""
    async with _client(nodes, settings, client) as fc:
        return await fc.request_all("GET", "/api/v1/ops", params=window_params(since, from_, to), on_outcome=on_outcome)


STATUS_COLUMNS = [
    "reachable",
    "node",
    "addr",
    "rank",
    "version",
    "rtt_ms",
    "skew",
    "drift_ppm",
    "events",
    "first",
    "last",
    "shipping",
    "tls",
]


def _shipping(lag: Any) -> str:
    """``caught up`` / ``1,234 rows, 12.5s behind`` per ClickHouse store ('' when never shipped)."""
    if not isinstance(lag, dict):
        return ""
    parts = []
    for target, d in sorted(lag.items()):
        rows = int(d.get("unshipped_rows", 0)) if isinstance(d, dict) else 0
        behind = float(d.get("lag_s", 0.0)) if isinstance(d, dict) else 0.0
        words = "caught up" if rows == 0 else f"{rows:,} rows, {behind:.1f}s behind"
        parts.append(words if len(lag) == 1 else f"{target}: {words}")
    return "; ".join(parts)


@dataclass
class FleetStatus(Outcomes):
    outcomes: list[NodeOutcome]
    elapsed_ms: float = 0.0
    columns: list[str] = field(default_factory=lambda: list(STATUS_COLUMNS))

    def rows(self) -> list[list[Any]]:
        out: list[list[Any]] = []
        for o in sorted(self.outcomes, key=lambda o: (not o.answered, o.label, o.spec.port)):
            info = o.data if o.answered and isinstance(o.data, dict) else {}
            rank = info.get("rank")
            world = info.get("world_size")
            rank_s = f"{rank}/{world}" if rank is not None and world is not None else ("-" if info else "")
            rtt = o.skew.delay_ns / NS_PER_MS if o.skew else None
            out.append(
                [
                    "yes" if o.answered else f"no: {o.kind}",
                    o.label,
                    o.spec.addr,
                    rank_s,
                    info.get("version", ""),
                    round(rtt, 2) if rtt is not None else "",
                    o.skew.short() if o.skew else "",
                    o.skew.drift_short() if o.skew else "",
                    info.get("events", ""),
                    fmt_ts(info.get("first_ns")) if info.get("first_ns") else "",
                    fmt_ts(info.get("last_ns")) if info.get("last_ns") else "",
                    _shipping(info.get("shipping")),
                    _tls_mode(info) if info else "",
                ]
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        nodes = []
        for o in self.outcomes:
            d = o.as_dict()
            d["info"] = o.data if o.answered else None
            nodes.append(d)
        medians = [o.skew.fleet_median_ns for o in self.outcomes if o.skew and o.skew.fleet_median_ns is not None]
        return {
            "answered": len(self.answered),
            "failed": len(self.failed),
            "elapsed_ms": round(self.elapsed_ms, 3),
            "skew": {
                "fleet_median_ms": round(medians[0] / NS_PER_MS, 3) if medians else None,
                "outliers": [o.label for o in self.outcomes if o.skew and o.skew.outlier],
            },
            "nodes": nodes,
        }


def _tls_mode(info: dict[str, Any]) -> str:
    tls = info.get("tls")
    mode = str(tls.get("mode", "")) if isinstance(tls, dict) else str(tls or "")
    auth = info.get("auth")
    if auth and str(auth) not in ("none", "False", "false"):
        mode = f"{mode}+token" if mode else "token"
    return mode


STATUS_SAMPLE_INTERVAL_S = 0.2  # between the clock samples of ``fleet status --samples N``
# ``fleet status`` without --samples: the /info answer's own sample (headers) and one /time sample
STATUS_BASE_SAMPLES = 2


async def fleet_status(
    nodes: Sequence[NodeSpec],
    settings: ClientSettings | None,
    *,
    samples: int | None = None,
    interval_s: float = STATUS_SAMPLE_INTERVAL_S,
    client: FleetClient | None = None,
    on_outcome: OutcomeCallback | None = None,
) -> FleetStatus:
    """``/api/v1/info`` and clock skew for every node.

    ``samples``: clock samples per node (default: the /info answer's and one /time sample, 2). More
    are /time round trips ``interval_s`` apart after /info — with 3 or more the fleet pass also gives
    each node's drift in ppm — and the node's deadline grows by their span.
    """
    extra = max(0, (samples or STATUS_BASE_SAMPLES) - STATUS_BASE_SAMPLES)
    if extra:
        base = settings or ClientSettings()
        settings = base.with_(timeout_s=base.timeout_s + extra * interval_s)

    async def job(conn: NodeClient) -> dict[str, Any]:
        info = await conn.get("/api/v1/info")
        version = info.get("api_version")
        if version != API_VERSION:
            raise NodeFailure(Kind.SCHEMA, f"the agent speaks API version {version}; this client speaks {API_VERSION}")
        for _ in range(extra):
            await trio.sleep(interval_s)
            try:
                conn.samples.append(await conn.time_sample())
            except NodeFailure:
                continue  # a failed sample never drops the node; the estimate counts what arrived
        return info

    started = time.perf_counter()
    async with _client(nodes, settings, client) as fc:
        outcomes = await refine(await fc.fan_out(job, on_outcome=on_outcome))
    return FleetStatus(outcomes, (time.perf_counter() - started) * 1000)


# --- synchronous wrappers (CLI, scripts): one trio.run per call ----------------------------------


def query_sync(nodes: Sequence[NodeSpec], settings: ClientSettings | None, sql: str, **kw: Any) -> FleetResult:
    return trio.run(partial(fleet_query, nodes, settings, sql, **kw))


def explain_sync(nodes: Sequence[NodeSpec], settings: ClientSettings | None, **kw: Any) -> FleetChains:
    return trio.run(partial(fleet_explain, nodes, settings, **kw))


def status_sync(nodes: Sequence[NodeSpec], settings: ClientSettings | None, **kw: Any) -> FleetStatus:
    return trio.run(partial(fleet_status, nodes, settings, **kw))
