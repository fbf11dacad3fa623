"""Fleet client: node list, concurrent fan-out over HTTPS, clock skew, merge and straggler verdict.

Library API (the CLI's ``query --nodes``, ``explain --nodes``, ``fleet status``, ``export --nodes`` and
the MCP ``query_fleet`` tool are thin layers over it)::

    from ingero.config import parse_node_list
    from ingero.fleet import ClientSettings, FleetClient, fleet_query, query_sync

    nodes = parse_node_list("10.0.0.1:8080,10.0.0.2:8080")
    settings = ClientSettings(ca_cert="ca.pem", client_cert="client.pem", client_key="client.key")

    # synchronous (CLI, scripts, MCP tools in a worker thread): one trio.run per call
    result = query_sync(nodes, settings, "SELECT node, count(*) AS n FROM events GROUP BY node")
    result.columns, result.rows            # merged; first column 'node' = each agent's own identity
    for o in result.outcomes:              # one NodeOutcome per node, node-list order
        o.label, o.kind, o.reason, o.answered, o.elapsed_ms, o.skew

    # async (inside trio): several operations over one client, one SSL context, one connection pool
    async with FleetClient(nodes, settings) as fc:
        result = await fleet_query(nodes, settings, sql, limit=100, client=fc)
        chains = await fleet_explain(nodes, settings, since="5m", client=fc)
        outcomes = await fc.request_all("GET", "/api/v1/overview")   # raw bodies in o.data
        outcomes = await fc.fan_out(job)    # job: async (NodeClient) -> Any; conn.get/post return bodies

Pieces, one job per module:

* :mod:`ingero.fleet.settings` — :class:`ClientSettings`, :func:`settings_from` (config + flags), the one
  SSL context, the plaintext-to-remote refusal.
* :mod:`ingero.fleet.client` — :class:`FleetClient` (one shared transport, a ``CapacityLimiter``,
  one trio task per node, per-node deadline, skew samples concurrent with each node's job),
  :class:`NodeClient`.
* :mod:`ingero.fleet.transport` — httpx on trio: one ``httpx.AsyncClient`` per node (HTTP/1.1, at most 2
  connections a node; samples share the query's connection unless it is busy for half the deadline),
  answers streamed under the caps, t1/t4 from httpcore's trace hooks, per-node release on wide fleets.
* :mod:`ingero.fleet.outcome` — :class:`NodeOutcome` and its kinds (ok, truncated, timeout, refused,
  unreachable, tls, auth, http, schema, protocol, error); transport errors → kinds.
* :mod:`ingero.fleet.skew` — NTP four-timestamp offset/delay (samples ride every answer's headers plus
  one light /time round trip), lowest-delay sample wins, ±delay/2 uncertainty, the warning line.
* :mod:`ingero.fleet.fleet_skew` — numpy over every node's t1..t4 at once: lowest-delay sample, drift
  in ppm (≥ 3 samples), fleet median and MAD outliers; imported once a fan-out's answers are in.
* :mod:`ingero.fleet.budget` — the per-answer cap and the byte budget one fan-out's answers share.
* :mod:`ingero.fleet.merge` — rows under ``node`` with column checks (:class:`FleetResult`), chains
  across nodes (:class:`FleetChains`).
* :mod:`ingero.fleet.straggler` — robust z-score (median/MAD) verdict on per-node ``/ops`` figures.
* :mod:`ingero.fleet.operations` — ``fleet_query``, ``fleet_explain``, ``fleet_ops``, ``fleet_status``
  and their ``*_sync`` wrappers.
* :mod:`ingero.fleet.render` — footers, the unanswered-nodes list, skew warnings, the merged
  diagnosis text, the TTY progress line.
* :mod:`ingero.fleet.local_agents` — ``ingero serve`` child processes (demo, benchmarks, tests):
  wait for their readiness report, stop them.

Nothing here raises because one node failed: failures are outcomes. Callers decide what "none
answered" means (the CLI raises :class:`~ingero.errors.NoNodeAnsweredError`, see
:func:`ingero.fleet.outcome.failure_summary`). Configuration errors (bad flags, unreadable
certificates, plaintext to a remote node) raise :class:`~ingero.errors.IngeroError` subclasses before
anything is sent.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module; imported on first use, so that ``import ingero.fleet.operations`` (the CLI's query
# path) does not pull in numpy (straggler), the explain engine, ... before the first byte is sent.
_EXPORTS = {
    "FleetClient": "client",
    "NodeClient": "client",
    "FleetChains": "merge",
    "FleetResult": "merge",
    "merge_chains": "merge",
    "merge_rows": "merge",
    "FleetStatus": "operations",
    "explain_sync": "operations",
    "fleet_explain": "operations",
    "fleet_ops": "operations",
    "fleet_query": "operations",
    "fleet_status": "operations",
    "query_sync": "operations",
    "status_sync": "operations",
    "Kind": "outcome",
    "NodeFailure": "outcome",
    "NodeOutcome": "outcome",
    "failure_summary": "outcome",
    "ClientSettings": "settings",
    "settings_from": "settings",
    "SkewEstimate": "skew",
    "TimeSample": "skew",
    "NodeFigures": "straggler",
    "StragglerVerdict": "straggler",
}

if TYPE_CHECKING:
    from ingero.fleet.client import FleetClient, NodeClient
    from ingero.fleet.merge import FleetChains, FleetResult, merge_chains, merge_rows
    from ingero.fleet.operations import (
        FleetStatus,
        explain_sync,
        fleet_explain,
        fleet_ops,
        fleet_query,
        fleet_status,
        query_sync,
        status_sync,
    )
    from ingero.fleet.outcome import Kind, NodeFailure, NodeOutcome, failure_summary
    from ingero.fleet.settings import ClientSettings, settings_from
    from ingero.fleet.skew import SkewEstimate, TimeSample
    from ingero.fleet.straggler import NodeFigures, StragglerVerdict


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ingero.fleet' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ingero.fleet.{module}"), name)


__all__ = [
    "ClientSettings",
    "FleetChains",
    "FleetClient",
    "FleetResult",
    "FleetStatus",
    "Kind",
    "NodeClient",
    "NodeFailure",
    "NodeFigures",
    "NodeOutcome",
    "SkewEstimate",
    "StragglerVerdict",
    "TimeSample",
    "explain_sync",
    "failure_summary",
    "fleet_explain",
    "fleet_ops",
    "fleet_query",
    "fleet_status",
    "merge_chains",
    "merge_rows",
    "query_sync",
    "settings_from",
    "status_sync",
]
