"""``ingero dashboard`` without a browser: the login, the session cookie's flags, CSRF, assets and pages
over real TLS on loopback (the browser test, ``test_dashboard_browser.py``, drives Chromium)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio

from ingero.agent.api.https import Listen, serve_asgi
from ingero.dashboard.app import Dashboard, DashboardSettings, serve_dashboard
from ingero.tls.context import client_ssl_context
from ingero.tools.registry import ToolEnv
from tests.fleet_agents import Pki, make_pki
from tests.test_fleet_cli import thread_lines
from tests.tools_surfaces import INGERO

TOKEN = "dash-token"


def local_answer(tool: Callable[[ToolEnv], object], db: Path) -> dict[str, Any]:
    """A local tool's answer on ``db`` (local tools answer at once, never awaitable)."""
    doc = tool(ToolEnv(db))
    assert isinstance(doc, dict)
    return doc


def cli_ledger_lines(db: Path) -> dict[tuple[str, int], str]:
    """``ingero explain --db``'s GPU-thread lines (unwrapped), by (node, tid)."""
    out = subprocess.run(
        [INGERO, "explain", "--db", str(db)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return thread_lines(out)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@asynccontextmanager
async def dashboard(pki: Pki, db: Path, token: str | None) -> AsyncIterator[httpx.AsyncClient]:
    listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key, token=token)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(serve_dashboard, DashboardSettings(env=ToolEnv(db), token=token), listen)
        async with httpx.AsyncClient(base_url=bound.url, verify=client_ssl_context(ca_cert=pki.ca), timeout=60) as c:
            yield c
        nursery.cancel_scope.cancel()


def test_login_cookie_csrf_and_pages(pki: Pki, samples: Path) -> None:
    async def main() -> None:
        async with dashboard(pki, samples / "sample-cluster.db", TOKEN) as c:
            r = await c.get("/")
            assert (r.status_code, r.headers["location"]) == (303, "/login")
            assert "default-src 'self'" in r.headers["content-security-policy"]
            r = await c.get("/login")
            assert r.status_code == 200 and 'name="token"' in r.text
            r = await c.post("/login", data={"token": "wrong"})
            assert (r.status_code, r.headers["location"]) == (303, "/login?error=wrong-token")
            assert "set-cookie" not in r.headers
            r = await c.post("/login", data={"token": TOKEN})
            assert (r.status_code, r.headers["location"]) == (303, "/")
            cookie = r.headers["set-cookie"]
            flags = {f.strip().split("=")[0] for f in cookie.split(";")}
            assert {"Secure", "HttpOnly", "SameSite", "Path", "Max-Age"} <= flags and "SameSite=Strict" in cookie
            sid = cookie.split(";")[0].split("=", 1)[1]
            assert len(sid) >= 40
            jar = {"Cookie": f"ingero_session={sid}"}

            r = await c.get("/", headers=jar)
            assert r.status_code == 200 and "dashboard.js" in r.text
            # tools need the cookie AND the page's header (a cross-site form can send neither header nor JSON)
            r = await c.post("/api/v1/tools/run_sql", json={"query": "SELECT 1 AS one"}, headers=jar)
            assert r.status_code == 401
            r = await c.post(
                "/api/v1/tools/run_sql", json={"query": "SELECT 1 AS one"}, headers={**jar, "X-Ingero": "1"}
            )
            assert r.status_code == 200 and r.json()["rows"] == [[1]]
            r = await c.get("/dashboard/config", headers={**jar, "X-Ingero": "1"})
            assert r.json()["mode"] == "local" and r.json()["database"] == "sample-cluster.db"
            assert r.json()["gpu_sources"] and r.json()["login"] is True
            # a bearer token works too (scripts), and a wrong one is refused
            r = await c.post("/api/v1/tools/get_trace_stats", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and r.json()["events"] == 600
            r = await c.post("/api/v1/tools/get_trace_stats", json={}, headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401
            # assets: ours and the vendored uPlot with its licence; nothing outside the static folder
            r = await c.get("/static/vendor/uPlot.iife.min.js")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
            assert "uPlot" in r.text[:2000]
            assert "MIT" in (await c.get("/static/vendor/uPlot.LICENSE")).text
            for bad in ("/static/../app.py", "/static/.hidden", "/static/", "/static/vendor/nope.js"):
                assert (await c.get(bad)).status_code == 404, bad
            # logging out ends the session
            r = await c.post("/logout", headers=jar)
            assert r.status_code == 303 and "Max-Age=0" in r.headers["set-cookie"]
            assert (await c.get("/", headers=jar)).status_code == 303

    anyio.run(main, backend="trio")


def test_login_attempts_are_rate_limited(pki: Pki, samples: Path) -> None:
    from ingero.tools.http import RateLimit

    dash = Dashboard(
        DashboardSettings(env=ToolEnv(samples / "sample-cluster.db"), token=TOKEN),
        limit=RateLimit(per_second=0.1, burst=3, clock=lambda: 0.0),  # frozen: no refill
    )
    listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key, token=TOKEN)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_asgi, dash, listen)
            async with httpx.AsyncClient(base_url=bound.url, verify=client_ssl_context(ca_cert=pki.ca)) as c:
                codes = [(await c.post("/login", data={"token": f"guess-{i}"})).status_code for i in range(5)]
                assert codes == [303, 303, 303, 429, 429]
                r = await c.post("/login", data={"token": TOKEN})
                assert r.status_code == 429 and r.headers["retry-after"] == "10"  # even the right one, for now
            nursery.cancel_scope.cancel()

    anyio.run(main, backend="trio")


def test_without_a_token_loopback_needs_no_login(pki: Pki, samples: Path) -> None:
    async def main() -> None:
        async with dashboard(pki, samples / "sample-cluster.db", None) as c:
            r = await c.get("/")
            assert r.status_code == 200
            r = await c.post("/api/v1/tools/run_sql", json={"query": "SELECT count(*) FROM events"})
            assert r.status_code == 200 and r.json()["rows"] == [[600]]

    anyio.run(main, backend="trio")


def test_cli_refuses_remote_listening_without_auth(tmp_path: Path, samples: Path) -> None:
    for cmd in (["dashboard", "--listen"], ["mcp", "--http"]):
        proc = subprocess.run(
            [INGERO, *cmd, "0.0.0.0:0", "--db", str(samples / "sample-cluster.db")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("ingero: error: refusing to serve 0.0.0.0:0 without authentication")


def test_config_names_the_ledgers_buckets_in_explains_words(pki: Pki, samples: Path) -> None:
    """The page draws each GPU thread's buckets in the ledger's order, labelled with explain's words."""
    from ingero.explain.ledger import BUCKETS, WORDS

    async def main() -> None:
        async with dashboard(pki, samples / "sample-cluster.db", None) as c:
            doc = (await c.get("/dashboard/config")).json()
            assert [b["name"] for b in doc["ledger_buckets"]] == list(BUCKETS)
            labels = {b["name"]: b["label"] for b in doc["ledger_buckets"]}
            assert all(labels[b] == w for b, w in WORDS.items())
            assert labels["gpu_steady"] == "GPU calls" and labels["gpu_slow"] == "GPU calls slower than steady"
            # the page's data: the ledger as explain words it (Ingero's sample has its GPU threads' lines)
            r = await c.post("/api/v1/tools/get_causal_chains", json={})
            rows = r.json()["ledger"]
            assert {row["node"] for row in rows} == {"gpu-node-02", "gpu-node-03"}
            cli = cli_ledger_lines(samples / "sample-cluster.db")
            assert set(cli) == {(row["node"], row["tid"]) for row in rows}
            for row in rows:  # word for word the line `ingero explain` prints for the thread
                assert sum(row["buckets"].values()) == row["wall_ns"]
                assert cli[(row["node"], row["tid"])] == f"GPU thread {row['tid']} ({row['name']}): {row['summary']}"
            js = (await c.get("/static/dashboard.js")).text
            assert js.count("function fmtLatency(") == 1  # one duration formatter (checked against Python's)

    anyio.run(main, backend="trio")


def test_fleet_tool_gives_each_ledger_row_explains_line(pki: Pki, tmp_path: Path) -> None:
    """query_fleet chains (the dashboard's fleet ledger): every node's GPU threads with the line explain
    prints for them on that node's own database."""
    from ingero.config import NodeSpec
    from ingero.tools.local import get_causal_chains
    from tests.conftest import write_db
    from tests.fleet_agents import AgentSpec, agents_in_thread, client_settings, straggler_events

    dbs = {
        "gpu-node-01": write_db(tmp_path / "n1.db", straggler_events(850, 18.4, 1, tail=True), node="gpu-node-01"),
        "gpu-node-02": write_db(tmp_path / "n2.db", straggler_events(200, 2.0, 2), node="gpu-node-02"),
    }
    with agents_in_thread(pki, [AgentSpec(db, n) for n, db in dbs.items()]) as servers:
        env = ToolEnv(
            nodes=tuple(NodeSpec("127.0.0.1", s.port, name=n) for n, s in zip(dbs, servers, strict=True)),
            fleet=client_settings(pki, timeout_s=10.0),
        )

        async def main() -> list[dict[str, object]]:
            listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key)
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(serve_dashboard, DashboardSettings(env=env), listen)
                verify = client_ssl_context(ca_cert=pki.ca)
                async with httpx.AsyncClient(base_url=bound.url, verify=verify, timeout=60) as c:
                    r = await c.post("/api/v1/tools/query_fleet", json={"action": "chains"})
                nursery.cancel_scope.cancel()
            assert r.status_code == 200, r.text
            rows: list[dict[str, object]] = r.json()["ledger"]
            return rows

        rows = anyio.run(main, backend="trio")
    local = {(r["node"], r["tid"]): r for db in dbs.values() for r in local_answer(get_causal_chains, db)["ledger"]}
    assert {(r["node"], r["tid"]) for r in rows} == set(local) and len(local) == 2
    for r in rows:
        mine = local[(r["node"], r["tid"])]
        assert r["summary"] == mine["summary"] and r["buckets"] == mine["buckets"]
        assert "preempted" in str(r["summary"])


async def body_after_the_answer(host: str, port: int, ca: Path, path: str) -> int:
    """An HTTP/2 POST whose body is sent only once the server has answered (a refusal answers before
    reading it); the status it got."""
    import h2.config
    import h2.connection
    import h2.events

    ctx = client_ssl_context(ca_cert=ca)
    ctx.set_alpn_protocols(["h2"])
    stream = await trio.open_ssl_over_tcp_stream(host, port, ssl_context=ctx)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    head = [(":method", "POST"), (":path", path), (":scheme", "https"), (":authority", f"{host}:{port}")]
    conn.send_headers(1, [*head, ("content-type", "application/json")])
    await stream.send_all(conn.data_to_send())
    status, answered = 0, False
    with trio.fail_after(30):
        while not answered:
            data = await stream.receive_some(65536)
            assert data, "the server closed the connection before answering"
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    status = int(dict(ev.headers)[b":status"])
                answered |= isinstance(ev, h2.events.StreamEnded) and ev.stream_id == 1
            await stream.send_all(conn.data_to_send())
    conn.send_data(1, b'{"query": "SELECT 1"}', end_stream=True)  # legal: our half of the stream is open
    await stream.send_all(conn.data_to_send())
    with trio.move_on_after(1):  # whatever the server does with it (it used to end the whole server)
        while await stream.receive_some(65536):
            pass
    await stream.aclose()
    return status


def test_a_request_body_after_the_refusal_does_not_stop_the_server(pki: Pki, samples: Path) -> None:
    """hypercorn's HTTP/2 raised KeyError on data for a stream it had answered, which ended the whole
    server: one POST without credentials stopped the dashboard (ingero.agent.api.hypercorn_h2)."""

    async def main() -> None:
        async with dashboard(pki, samples / "sample-cluster.db", TOKEN) as c:
            host, port = c.base_url.host, c.base_url.port
            assert port is not None
            for _ in range(3):
                assert await body_after_the_answer(host, port, pki.ca, "/api/v1/tools/run_sql") == 401
            r = await c.post(
                "/api/v1/tools/run_sql", json={"query": "SELECT 1"}, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert r.status_code == 200 and r.json()["rows"] == [[1]]  # still serving

    anyio.run(main, backend="trio")
