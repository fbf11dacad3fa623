"""Every tool of the registry answers the same JSON on every surface: MCP stdio (the SDK's stdio client
driving ``ingero mcp``), MCP Streamable HTTP over TLS 1.3 with mTLS + bearer (the SDK's HTTP client), and
the HTTP tools API (the agent's ``POST /api/v1/tools/<name>`` for local tools; the same API on the MCP
server's port for fleet tools, since an agent does not fan out). Real agents on loopback serve the
three sample nodes. A tool added to the registry is covered automatically: it is called with ``{}``
unless ARGS says otherwise, so a tool with required arguments fails here until it gets an entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import trio

from ingero.agent.api.https import Listen
from ingero.config import NodeSpec
from ingero.mcp.server import McpSettings, serve_http
from ingero.tools import toolset
from ingero.tools.failures import STATUS_OF_KIND
from ingero.tools.registry import ToolEnv
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, client_settings, make_pki
from tests.tools_surfaces import (
    NODE_DBS,
    NODE_NAMES,
    decoded,
    fleet_config,
    http_session,
    https_client,
    mcp_call,
    node_agents,
    stdio_session,
)

AGENT_TOKEN = "agent-token-1"
MCP_TOKEN = "mcp-token-1"
SQL = "SELECT node, count(*) AS n FROM events GROUP BY node"

ARGS: dict[str, list[dict[str, Any]]] = {
    "get_trace_stats": [{}, {"since": "1h"}],
    "get_causal_chains": [{}, {"severity": "HIGH", "limit": 1}, {"node": "gpu-node-03"}],
    "run_sql": [{"query": SQL}, {"query": "SELECT * FROM events ORDER BY id", "limit": 3}],
    "get_stacks": [{"op": "cuMemAlloc"}],
    "processes": [{"node": "gpu-node-02", "limit": 3}],
    "event_history": [{"node": "gpu-node-02", "limit": 20}, {"op": "sched_switch", "limit": 5}],
    "run_demo": [{"scenario": "incident"}],
    "find_outlier_nodes": [{}, {"metric": "wait", "threshold": 2.0}],
    "get_cost": [{}, {"usd_per_gpu_hour": 2.5, "since": "1h"}],
    "query_fleet": [
        {"action": "sql", "sql": SQL},
        {"action": "chains", "limit": 5},
        {"action": "ops"},
        {"action": "overview"},
        {"action": "status"},
    ],
}
# (tool, arguments, kind of failure)
FAILURES: list[tuple[str, dict[str, Any], str]] = [
    ("run_sql", {"query": "DELETE FROM events"}, "refused"),
    ("run_sql", {"query": "SELECT nope FROM events"}, "validation"),
    ("get_stacks", {"op": "cudaFrobnicate"}, "validation"),
    ("get_trace_stats", {"since": "soon"}, "validation"),
    ("run_sql", {"query": "SELECT 1", "limit": 0}, "validation"),
    ("run_sql", {"query": "SELECT 1", "colour": "blue"}, "validation"),
    ("no_such_tool", {}, "not_found"),
    ("find_outlier_nodes", {"metric": "speed"}, "validation"),
    ("get_cost", {"usd_per_gpu_hour": -1}, "validation"),
    ("event_history", {"op": "cudaFrobnicate"}, "validation"),
]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.slow  # MCP stdio + HTTP servers and agents: run by make test, not test-fast
def test_every_tool_answers_the_same_on_every_surface(tmp_path: Path, samples: Path, pki: Pki) -> None:
    cluster = samples / "sample-cluster.db"
    specs = node_agents(samples)
    specs.append(AgentSpec(cluster, "cluster", token=AGENT_TOKEN))
    with agents_in_thread(pki, specs) as servers:
        node_ports = [s.port for s in servers[:3]]
        agent_url = servers[3].url
        cfg = fleet_config(tmp_path / "ingero.yaml", pki, node_ports)
        settings = McpSettings(
            db=cluster,
            nodes=[NodeSpec("127.0.0.1", p, name=n) for n, p in zip(NODE_NAMES, node_ports, strict=True)],
            fleet=client_settings(pki, timeout_s=10.0),
        )
        listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key, client_ca=pki.ca, token=MCP_TOKEN)
        compared: dict[str, int] = {}

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(serve_http, settings, listen)
                mcp_base = bound.url.removesuffix("/mcp")
                async with (
                    stdio_session(tmp_path, "--db", str(cluster), "--config", str(cfg)) as stdio,
                    http_session(bound.url, pki, MCP_TOKEN) as http,
                    https_client(agent_url, pki, AGENT_TOKEN) as agent,
                    https_client(mcp_base, pki, MCP_TOKEN) as mcp_api,
                ):
                    for s in (stdio, http):
                        listed = {t.name: t for t in (await s.list_tools()).tools}
                        assert set(listed) == set(toolset.tools())
                        for name, t in listed.items():
                            assert t.input_schema == toolset.get(name).input_schema, name
                    doc = (await agent.get("/api/v1/tools/list")).json()
                    assert [t["name"] for t in doc["tools"]] == list(toolset.tools())

                    for name, tool in toolset.tools().items():
                        api = mcp_api if tool.scope == "fleet" else agent
                        for args in ARGS.get(name, [{}]):
                            err1, text1 = await mcp_call(stdio, name, args)
                            err2, text2 = await mcp_call(http, name, args)
                            resp = await api.post(f"/api/v1/tools/{name}", json=args)
                            assert not err1 and not err2 and resp.status_code == 200, (name, args, text1, resp.text)
                            assert "\n" not in text1 and ", " not in text1[:200]  # compact, not pretty-printed
                            assert decoded(text1) == decoded(text2) == decoded(resp.text), (name, args)
                            if tool.scope != "fleet":  # nothing volatile: the very same bytes
                                assert decoded(text1) == decoded(resp.text)
                            compared[name] = compared.get(name, 0) + 1

                    for name, args, kind in FAILURES:
                        api = mcp_api if name in toolset.tools() and toolset.get(name).scope == "fleet" else agent
                        resp = await api.post(f"/api/v1/tools/{name}", json=args)
                        body = resp.json()
                        assert (resp.status_code, body["kind"], body["ok"]) == (STATUS_OF_KIND[kind], kind, False)
                        assert "\n" not in body["error"]
                        for s in (stdio, http):
                            err, text = await mcp_call(s, name, args)
                            assert err, (name, args, text)
                            assert f"{kind}: {body['error']}" in text, text  # the same vocabulary and words
                nursery.cancel_scope.cancel()

        anyio.run(main, backend="trio")
        assert set(compared) == set(toolset.tools())


@pytest.mark.slow  # MCP stdio + HTTP servers and agents: run by make test, not test-fast
def test_fleet_tools_answer_with_the_straggler_and_every_node(tmp_path: Path, samples: Path, pki: Pki) -> None:
    """The fleet tools' content (not only their agreement): three nodes, the verdict, merged rows."""
    specs = node_agents(samples)
    with agents_in_thread(pki, specs) as servers:
        cfg = fleet_config(tmp_path / "ingero.yaml", pki, [s.port for s in servers])

        async def main() -> None:
            async with stdio_session(tmp_path, "--config", str(cfg)) as s:
                err, text = await mcp_call(s, "fleet_status", {})
                status = decoded(text)
                assert not err and status["answered"] == 3 and status["columns"][:2] == ["reachable", "node"]
                assert [r[1] for r in status["rows"]] == list(NODE_NAMES)
                err, text = await mcp_call(s, "find_outlier_nodes", {})
                out = decoded(text)
                assert not err and out["answered"] == 3 and out["straggler"]["nodes"] == 3
                # the samples' rows single nobody out as slow; gpu-node-01 is unusually low (see
                # test_fleet_stragglers.test_equal_ranks_and_no_collectives)
                assert out["straggler"]["outlier"] is None and out["outlier"] is None
                assert out["straggler"]["line"].startswith("no straggler: the 3 nodes look alike")
                assert "also unusual: gpu-node-01 (low: " in out["straggler"]["line"]
                err, text = await mcp_call(s, "get_trace_stats", {})
                assert err and "no local database" in text

                # the fleet's event history: every node's latest events merged, newest first ...
                err, text = await mcp_call(s, "event_history", {"fleet": True, "limit": 30})
                hist = decoded(text)
                assert not err and hist["columns"][:2] == ["time", "node"] and len(hist["rows"]) == 30
                assert [r[0] for r in hist["rows"]] == sorted((r[0] for r in hist["rows"]), reverse=True)
                # ... and one node's is exactly what its own database says
                args = {"node": "gpu-node-02", "op": "sched_switch", "limit": 7}
                err, text = await mcp_call(s, "event_history", {**args, "fleet": True})
                own = await toolset.call("event_history", args, ToolEnv(samples / NODE_DBS[1]))
                assert not err and decoded(text)["rows"] == own["rows"] and len(own["rows"]) == 7
                assert {(r[1], r[5]) for r in own["rows"]} == {("gpu-node-02", "sched_switch")}

        anyio.run(main, backend="trio")
