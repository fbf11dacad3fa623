"""Fleet operations on collectives: every node's ``/api/v1/collectives`` (with its clock skew), the
join and verdict (:mod:`ingero.fleet.collectives`), the cost of waiting (:mod:`ingero.fleet.cost`) and
the straggler node's top explain chain.

* :func:`fleet_stragglers` — ``ingero fleet stragglers``, ``ingero fleet cost``, the MCP tools;
* :func:`fetch_collectives` / :func:`collective_verdict` — what ``ingero explain --nodes`` adds to its
  per-node job and its verdict (an agent too old to have the endpoint contributes no calls).

Each node's entry times are corrected by its measured offset and carry its ± uncertainty; a node
without a skew estimate carries an infinite uncertainty (its lag can only be inconclusive).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from ingero.config import GpuRates, NodeSpec
from ingero.fleet.client import FleetClient, NodeClient, OutcomeCallback
from ingero.fleet.collectives import CollectiveVerdict, NodeCalls, analyze
from ingero.fleet.cost import WaitCost, wait_cost
from ingero.fleet.outcome import Kind, NodeFailure, NodeOutcome, Outcomes
from ingero.fleet.settings import ClientSettings
from ingero.fleet.straggler import NodeFigures, StragglerVerdict, verdict, with_collectives

COLLECTIVES_PATH = "/api/v1/collectives"
LIVE_SLACK_NS = 600 * 1_000_000_000  # newest call within 10 min of now: a live job, waits run to now


async def fetch_collectives(conn: NodeClient, params: dict[str, str] | None) -> dict[str, Any] | None:
    """One node's ``/collectives`` body; None from an agent that predates the endpoint (404)."""
    try:
        body = await conn.get(COLLECTIVES_PATH, params)
    except NodeFailure as e:
        if e.status == 404:
            return None
        raise
    if not isinstance(body.get("calls"), dict) or not isinstance(body.get("comms"), list):
        raise NodeFailure(Kind.SCHEMA, "the /collectives answer lacks 'calls' or 'comms'")
    return body


def node_calls(outcomes: Sequence[NodeOutcome], key: str | None = "collectives") -> list[NodeCalls]:
    """Decode every answered node's ``/collectives`` body (``o.data[key]``, or ``o.data`` itself)."""
    out: list[NodeCalls] = []
    for o in outcomes:
        if not o.answered or not isinstance(o.data, dict):
            continue
        body = o.data.get(key) if key else o.data
        if not isinstance(body, dict):
            continue
        offset = o.skew.offset_ns if o.skew else 0.0
        unc = o.skew.uncertainty_ns if o.skew else math.inf
        try:
            out.append(NodeCalls.from_body(o.label, body, offset, unc))
        except (ValueError, TypeError, AttributeError):
            continue  # a malformed answer contributes nothing; the node's outcome still stands
    return out


def collective_verdict(calls: Sequence[NodeCalls]) -> CollectiveVerdict:
    """The verdict, with waits in flight counted up to now when the recording is live."""
    now = time.time_ns()
    newest = max((float(c.entry_ns.max()) - c.offset_ns for c in calls if len(c)), default=None)
    as_of = float(now) if newest is not None and now - newest < LIVE_SLACK_NS else None
    return analyze(calls, as_of_ns=as_of)


@dataclass
class StragglerReport(Outcomes):
    outcomes: list[NodeOutcome]
    verdict: StragglerVerdict  # .collectives set when any node recorded collectives
    cost: WaitCost
    chain: dict[str, Any] | None = None  # the straggler node's top explain chain
    elapsed_ms: float = 0.0
    truncated: list[str] = field(default_factory=list)  # nodes whose answer hit the call cap

    @property
    def collectives(self) -> CollectiveVerdict | None:
        return self.verdict.collectives

    def headline(self) -> str:
        cv = self.collectives
        if cv is not None:
            return cv.headline()
        return f"straggler: {self.verdict.line}" if self.verdict.outlier else self.verdict.line

    def as_dict(self) -> dict[str, Any]:
        cv = self.collectives
        return {
            "headline": self.headline(),
            "kind": cv.kind if cv is not None else ("straggler" if self.verdict.outlier else "no-straggler"),
            "source": self.verdict.source,
            "outlier": self.verdict.outlier,
            "ranks": [r.as_dict() for r in cv.ranks] if cv is not None else [],
            "straggler": self.verdict.as_dict(),
            "cost": self.cost.as_dict(),
            "chain": self.chain,
            "truncated_nodes": self.truncated,
            "answered": len(self.answered),
            "failed": len(self.failed),
            "elapsed_ms": round(self.elapsed_ms, 3),
            "nodes": [o.as_dict() for o in self.outcomes],
        }


def _window(since: str | None, from_: str | None, to: str | None, comm: str | None) -> dict[str, str] | None:
    params = {k: v for k, v in (("since", since), ("from", from_), ("to", to), ("comm", comm)) if v}
    return params or None


async def fleet_stragglers(
    nodes: Sequence[NodeSpec],
    settings: ClientSettings | None,
    *,
    since: str | None = None,
    from_: str | None = None,
    to: str | None = None,
    comm: str | None = None,
    rates: GpuRates | None = None,
    with_chain: bool = True,
    client: FleetClient | None = None,
    on_outcome: OutcomeCallback | None = None,
) -> StragglerReport:
    """``/collectives`` and ``/ops`` from every node: the collectives verdict (the host-figures one where
    no node recorded collectives), the cost of waiting, and the straggler's top chain."""
    params = _window(since, from_, to, comm)
    ops_params = _window(since, from_, to, None)

    async def job(conn: NodeClient) -> dict[str, Any]:
        colls = await fetch_collectives(conn, params)
        ops = await conn.get("/api/v1/ops", ops_params)
        return {"collectives": colls, "ops": ops}

    started = time.perf_counter()
    if client is None:
        async with FleetClient(nodes, settings) as fc:
            outcomes = await fc.fan_out(job, on_outcome=on_outcome)
    else:
        outcomes = await client.fan_out(job, on_outcome=on_outcome)
    calls = node_calls(outcomes)
    figures = [
        NodeFigures.from_ops_body(o.label, o.data["ops"])
        for o in outcomes
        if o.answered and isinstance(o.data, dict) and isinstance(o.data.get("ops"), dict)
    ]
    cv = collective_verdict(calls) if any(len(c) for c in calls) else None
    v = with_collectives(verdict(figures), cv)
    ranks = cv.ranks if cv is not None else []
    span_s = _span_s(calls)
    report = StragglerReport(
        outcomes,
        v,
        wait_cost(ranks, rates or GpuRates(), window_s=span_s),
        truncated=[
            o.label
            for o in outcomes
            if o.answered
            and isinstance(o.data, dict)
            and isinstance(o.data.get("collectives"), dict)
            and o.data["collectives"].get("truncated")
        ],
    )
    if with_chain and v.outlier:
        spec = next((o.spec for o in outcomes if o.answered and o.label == v.outlier), None)
        if spec is not None:
            report.chain = await _top_chain(spec, settings, ops_params)
    report.elapsed_ms = (time.perf_counter() - started) * 1000
    return report


def _span_s(calls: Sequence[NodeCalls]) -> float:
    """The job time the calls cover (first entry to last exit, this host's clock)."""
    lo, hi = math.inf, -math.inf
    for c in calls:
        if not len(c):
            continue
        lo = min(lo, float(c.entry_ns.min()) - c.offset_ns)
        done = c.duration_ns >= 0
        if done.any():
            hi = max(hi, float((c.entry_ns[done] + c.duration_ns[done]).max()) - c.offset_ns)
    return (hi - lo) / 1e9 if hi > lo else 0.0


async def _top_chain(
    spec: NodeSpec, settings: ClientSettings | None, params: dict[str, str] | None
) -> dict[str, Any] | None:
    """The straggler node's strongest explain chain in the window (None when it has none or fails)."""
    async with FleetClient([spec], settings) as fc:
        (o,) = await fc.request_all("GET", "/api/v1/chains", params=params, skew=False)
    body = o.data if o.answered and isinstance(o.data, dict) else {}
    chains = [c for c in body.get("chains") or [] if isinstance(c, dict)]
    order = {"HIGH": 0, "MEDIUM": 1, "LOW": 2}
    chains.sort(key=lambda c: order.get(str(c.get("severity")), 3))
    return chains[0] if chains else None


def stragglers_sync(nodes: Sequence[NodeSpec], settings: ClientSettings | None, **kw: Any) -> StragglerReport:
    return trio.run(partial(fleet_stragglers, nodes, settings, **kw))
