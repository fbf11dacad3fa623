"""The HTTP tools API: versions without auth, OpenAPI 3.1 validated, the middleware order (authentication →
audit → rate limit → handler) on real TLS servers, and the agent's older endpoints untouched."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio

from ingero import API_VERSION
from ingero.agent.api.https import Listen, serve_asgi
from ingero.tools import toolset
from ingero.tools.http import Auth, Guard, RateLimit, ToolsAPI
from ingero.tools.openapi import openapi_document
from ingero.tools.registry import ToolEnv
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, make_pki
from tests.tools_surfaces import https_client

TOKEN = "t0ken-for-tools"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_openapi_document_is_valid_openapi_31() -> None:
    from openapi_spec_validator import validate
    from openapi_spec_validator.versions import consts, get_spec_version

    doc = openapi_document()
    assert get_spec_version(doc) == consts.OPENAPIV31
    validate(doc)  # raises on any schema violation
    posted = {p.removeprefix("/api/v1/tools/") for p, ops in doc["paths"].items() if "post" in ops}
    assert posted == set(toolset.tools())
    run_sql = doc["paths"]["/api/v1/tools/run_sql"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert run_sql["required"] == ["query"] and run_sql["properties"]["limit"]["maximum"] == 1000
    assert doc["paths"]["/api/versions"]["get"]["security"] == []


def test_agent_serves_the_tools_api_beside_its_endpoints(
    samples: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ingero.audit")
    spec = AgentSpec(samples / "sample-cluster.db", "cluster", token=TOKEN)
    with agents_in_thread(pki, [spec]) as servers:
        url = servers[0].url

        async def main() -> None:
            async with https_client(url, pki) as anon, https_client(url, pki, TOKEN) as c:
                r = await anon.get("/api/versions")  # no token needed
                assert r.status_code == 200 and r.json()["current"] == f"{API_VERSION}.1" == r.json()["versions"][0]
                assert set(r.json()) == {"versions", "current", "capabilities"}
                r = await anon.get("/api/v1/tools/list")
                assert r.status_code == 401 and r.json()["kind"] == "unauthorized"
                assert r.headers["www-authenticate"].startswith("Bearer")
                r = await anon.post(
                    "/api/v1/tools/run_sql", json={"query": "SELECT 1"}, headers={"Authorization": "Bearer nope"}
                )
                assert r.status_code == 401 and r.json()["error"].startswith("wrong bearer token")

                r = await c.get("/api/v1/openapi.json")
                assert r.status_code == 200 and r.json()["openapi"] == "3.1.0"
                r = await c.post("/api/v1/tools/run_sql", json={"query": "SELECT count(*) AS n FROM events"})
                assert r.status_code == 200 and r.json()["rows"] == [[600]] and r.json()["limit"] == 200
                r = await c.get("/api/v1/tools/run_sql")
                assert r.status_code == 405 and r.json()["kind"] == "method_not_allowed"
                r = await c.post("/api/v1/tools/run_sql", content=b"[1,2]")
                assert r.status_code == 400 and "JSON object" in r.json()["error"]
                r = await c.post("/api/v1/tools/query_fleet", json={"action": "status"})
                assert r.status_code == 400 and "no fleet nodes" in r.json()["error"]
                r = await c.post("/api/v1/tools/event_history", json={"fleet": True})
                assert r.status_code == 400 and "no fleet nodes" in r.json()["error"]
                # the agent's own endpoints are untouched (the fleet client uses them)
                r = await c.post("/api/v1/query", json={"sql": "SELECT count(*) AS n FROM events"})
                assert r.status_code == 200 and r.json()["rows"] == [[600]]
                r = await anon.get("/api/v1/health")
                assert r.status_code == 401

        anyio.run(main, backend="trio")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "ingero.audit"]
    # one line per tools request, refusals included; the older endpoints are not the audit's
    assert [(x["path"], x["status"]) for x in lines] == [
        ("/api/versions", 200),
        ("/api/v1/tools/list", 401),
        ("/api/v1/tools/run_sql", 401),
        ("/api/v1/openapi.json", 200),
        ("/api/v1/tools/run_sql", 200),
        ("/api/v1/tools/run_sql", 405),
        ("/api/v1/tools/run_sql", 400),
        ("/api/v1/tools/query_fleet", 400),
        ("/api/v1/tools/event_history", 400),
    ]
    assert lines[1]["client"] == "refused" and lines[4]["client"].startswith("token:127.0.0.1")
    assert all(x["surface"] == "agent" and x["ts"].endswith("Z") and len(x["ts"]) == 27 for x in lines)


def test_a_burst_beyond_the_rate_limit_gets_429s_each_audited(samples: Path, pki: Pki) -> None:
    audit: list[dict[str, Any]] = []
    burst, calls = 5, 12
    limit = RateLimit(per_second=0.5, burst=burst, clock=lambda: 1000.0)  # a frozen clock: no refill
    app = Guard(
        ToolsAPI(ToolEnv(samples / "sample-cluster.db")),
        auth=Auth(token=TOKEN, mtls=True),
        surface="test",
        limit=limit,
        audit=audit.append,
    )
    listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key, client_ca=pki.ca)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_asgi, app, listen)
            async with (
                https_client(bound.url.rstrip("/"), pki, TOKEN) as c,
                https_client(bound.url.rstrip("/"), pki) as anon,
            ):
                statuses: list[int] = []
                retry: set[str] = set()
                with trio.move_on_after(60):
                    async with trio.open_nursery() as burst_nursery:

                        async def one() -> None:
                            r = await c.post("/api/v1/tools/run_sql", json={"query": "SELECT 1"})
                            statuses.append(r.status_code)
                            if r.status_code == 429:
                                retry.add(r.headers["retry-after"])
                                assert r.json()["kind"] == "rate_limited"

                        for _ in range(calls):
                            burst_nursery.start_soon(one)
                assert sorted(statuses) == [200] * burst + [429] * (calls - burst)
                assert retry == {"2"}  # one token at 0.5/s
                r = await anon.post("/api/v1/tools/run_sql", json={"query": "SELECT 1"})
                assert r.status_code == 401  # refused before the rate limit: it spends nobody's tokens
            nursery.cancel_scope.cancel()

    anyio.run(main, backend="trio")
    assert sorted(a["status"] for a in audit) == [200] * burst + [401] + [429] * (calls - burst)
    assert all(a["path"] == "/api/v1/tools/run_sql" and "ms" in a for a in audit)
    assert {a["client"] for a in audit if a["status"] == 429} == {"token:127.0.0.1"}


def test_rate_limit_refills_with_time() -> None:
    now = [0.0]
    limit = RateLimit(per_second=2.0, burst=2, clock=lambda: now[0])
    limit.take("a")
    limit.take("a")
    with pytest.raises(Exception, match="rate limit") as e:
        limit.take("a")
    assert getattr(e.value, "retry_after_s", None) == 1
    limit.take("b")  # buckets are per client
    now[0] += 0.5  # one token back
    limit.take("a")
    with pytest.raises(Exception, match="rate limit"):
        limit.take("a")


RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


@pytest.mark.slow  # waits out a query time limit: run by make test, not test-fast
def test_time_limits_answer_timeout(samples: Path, pki: Pki) -> None:
    """A statement that never ends is stopped by the guard's limit: kind ``timeout``, 408, one line."""
    spec = AgentSpec(samples / "sample-cluster.db", "cluster", token=TOKEN)
    with agents_in_thread(pki, [spec]) as servers:

        async def main() -> None:
            async with https_client(servers[0].url, pki, TOKEN) as c:
                r = await c.post("/api/v1/tools/run_sql", json={"query": RUNAWAY})
                assert (r.status_code, r.json()["kind"]) == (408, "timeout"), r.text
                r = await c.post("/api/v1/tools/run_sql", json={"query": "SELECT count(*) FROM events"})
                assert r.status_code == 200  # the agent goes on answering

        anyio.run(main, backend="trio")


def test_analysis_deadline_is_a_timeout(samples: Path) -> None:
    from ingero.errors import QueryTimeoutError
    from ingero.tools import local
    from ingero.tools.failures import classify

    with pytest.raises(QueryTimeoutError) as e, local._reader(samples / "sample-cluster.db", budget_s=0.0) as conn:
        conn.execute(
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 100000) SELECT count(*) FROM c"
        )
    assert classify(e.value).kind == "timeout" and classify(e.value).status == 408


def test_mcp_http_needs_the_token(samples: Path, pki: Pki) -> None:
    from ingero.mcp.server import McpSettings, serve_http

    listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key, token=TOKEN)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_http, McpSettings(db=samples / "sample-cluster.db"), listen)
            assert bound.url.endswith("/mcp") and bound.tls_mode == "tls"
            async with https_client(bound.url.removesuffix("/mcp"), pki) as anon:
                hello = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
                r = await anon.post("/mcp", json=hello, headers={"Accept": "application/json, text/event-stream"})
                assert r.status_code == 401 and r.json()["kind"] == "unauthorized"
                r = await anon.get("/api/versions")
                assert r.status_code == 200 and "mcp-streamable-http" in r.json()["capabilities"]
            nursery.cancel_scope.cancel()

    anyio.run(main, backend="trio")
