"""``ingero dashboard`` without a browser: the login, the session cookie's flags, CSRF, assets and pages
over real TLS on loopback (the browser test, ``test_dashboard_browser.py``, drives Chromium)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
import trio

from ingero.agent.api.https import Listen, serve_asgi
from ingero.dashboard.app import Dashboard, DashboardSettings, serve_dashboard
from ingero.tls.context import client_ssl_context
from ingero.tools.registry import ToolEnv
from tests.fleet_agents import Pki, make_pki
from tests.tools_surfaces import INGERO

TOKEN = "dash-token"


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
