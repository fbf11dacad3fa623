"""Helpers for the agent API tests: real servers on 127.0.0.1 (port 0) with real certificates."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from ingero.agent.api.app import AgentAPI
from ingero.agent.api.server import BoundServer, ServerSettings, serve_api
from ingero.asgi import ASGIApp
from ingero.identity import Identity
from ingero.tls.context import client_ssl_context
from ingero.tls.pki import create_ca, issue_cert, split_sans
from ingero.tools.http import node_tools

RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c"  # never ends


@dataclass(frozen=True)
class Pki:
    ca: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate from another CA
    rogue_key: Path


def make_pki(d: Path) -> Pki:
    create_ca(d / "ca")
    create_ca(d / "rogue", "some other CA")
    node = issue_cert(d / "ca", "node", "test-node", split_sans(["127.0.0.1,localhost"]))
    client = issue_cert(d / "ca", "client", "tester")
    rogue = issue_cert(d / "rogue", "client", "intruder")
    return Pki(d / "ca" / "ca.pem", node.cert, node.key, client.cert, client.key, rogue.cert, rogue.key)


def settings(db: Path, tls_dir: Path, **kw: Any) -> ServerSettings:
    base = ServerSettings(
        db_path=db, identity=Identity("test-node", rank=0, local_rank=0, world_size=2), port=0, tls_dir=tls_dir
    )
    return replace(base, **kw)


@dataclass
class Running:
    bound: BoundServer
    app: Any  # the AgentAPI instance (found inside whatever middleware wraps it)
    client: httpx.AsyncClient

    async def get(self, path: str, **kw: Any) -> httpx.Response:
        return await self.client.get(path, **kw)

    async def post(self, path: str, **kw: Any) -> httpx.Response:
        return await self.client.post(path, **kw)


def client_for(bound: BoundServer, s: ServerSettings, **kw: Any) -> httpx.AsyncClient:
    """An httpx client that trusts the server's certificate (its CA, or the self-signed file)."""
    if bound.tls_mode == "plaintext":
        return httpx.AsyncClient(base_url=bound.url, timeout=30, **kw)
    verify = kw.pop("verify", None)
    if verify is None:  # the agent's self-signed certificate is its own CA
        assert s.tls_cert is None and s.tls_dir is not None, "pass verify= for a server with its own certificate"
        verify = client_ssl_context(ca_cert=s.tls_dir / "server-cert.pem")
    return httpx.AsyncClient(base_url=bound.url, verify=verify, timeout=30, **kw)


@asynccontextmanager
async def running(
    s: ServerSettings,
    *,
    verify: Any = None,
    headers: dict[str, str] | None = None,
    wrapper: Callable[[ASGIApp], ASGIApp] | None = None,
) -> AsyncIterator[Running]:
    """Start one agent in a nursery, yield it with a client; stop it on exit."""
    seen: list[Any] = []

    tools = node_tools(s)

    def capture(app: ASGIApp) -> ASGIApp:
        seen.append(app)
        app = tools(app)  # the node's server as the CLI composes it
        return wrapper(app) if wrapper else app

    async with trio.open_nursery() as nursery:
        bound: BoundServer = await nursery.start(partial(serve_api, s, app_wrapper=capture))
        kw: dict[str, Any] = {"headers": headers or {}}
        if verify is not None:
            kw["verify"] = verify
        async with client_for(bound, s, **kw) as client:
            yield Running(bound, agent_api(seen[0]), client)
        nursery.cancel_scope.cancel()


def agent_api(app: Any) -> AgentAPI:
    """The AgentAPI inside middleware layers (each keeps the app it wraps as ``.app``)."""
    for _ in range(10):
        if isinstance(app, AgentAPI):
            return app
        app = app.app
    raise AssertionError("no AgentAPI inside the served app")


def assert_error_shape(r: httpx.Response, status: int) -> dict[str, Any]:
    """The one error shape: {"ok": false, "status": N, "error": "<one line>"} with N the HTTP status."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    doc: dict[str, Any] = json.loads(r.content)
    assert set(doc) == {"ok", "status", "error"}, doc
    assert doc["ok"] is False and doc["status"] == status
    assert isinstance(doc["error"], str) and doc["error"].strip() and "\n" not in doc["error"]
    return doc
