"""Real agents for the fleet tests: a CA and certificates from ingero's own PKI, ``serve_api`` listeners
on 127.0.0.1 (port 0, readiness through ``task_status``), and ASGI wrappers that make one agent slow,
failing, cut-off or off-schema while it still serves real TLS.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ingero.agent.pki import create_ca, issue_cert, split_sans
from ingero.agent.server import BoundServer, ServerSettings, serve_api
from ingero.config import NodeSpec
from ingero.fleet.settings import ClientSettings
from ingero.identity import Identity

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Wrapper = Callable[[ASGIApp], ASGIApp]


@dataclass(frozen=True)
class Pki:
    ca: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing the agents use

    def client_settings(self, **kw: Any) -> ClientSettings:
        base: dict[str, Any] = {
            "ca_cert": str(self.ca),
            "client_cert": str(self.client_cert),
            "client_key": str(self.client_key),
            "timeout_s": 5.0,
        }
        base.update(kw)
        return ClientSettings(**base)


def make_pki(d: Path) -> Pki:
    ca_dir, other = d / "ca", d / "other"
    create_ca(ca_dir)
    create_ca(other, "some other CA")
    node = issue_cert(ca_dir, "node", "fleet-test", split_sans(["127.0.0.1", "localhost"]))
    client = issue_cert(ca_dir, "client", "laptop")
    return Pki(ca_dir / "ca.pem", node.cert, node.key, client.cert, client.key, other / "ca.pem")


@dataclass
class AgentSpec:
    db: Path
    node: str
    wrapper: Wrapper | None = None
    token: str | None = None
    mtls: bool = True
    no_tls: bool = False
    rank: int | None = None
    world_size: int | None = None


def server_settings(spec: AgentSpec, pki: Pki) -> ServerSettings:
    ident = Identity(spec.node, rank=spec.rank, local_rank=spec.rank, world_size=spec.world_size)
    if spec.no_tls:
        return ServerSettings(db_path=spec.db, identity=ident, host="127.0.0.1", port=0, no_tls=True, token=spec.token)
    return ServerSettings(
        db_path=spec.db,
        identity=ident,
        host="127.0.0.1",
        port=0,
        tls_cert=pki.node_cert,
        tls_key=pki.node_key,
        client_ca=pki.ca if spec.mtls else None,
        token=spec.token,
    )


async def start_agents(nursery: trio.Nursery, pki: Pki, specs: list[AgentSpec]) -> list[BoundServer]:
    """Start every agent; returns once each reported its bound port (task_status), in order."""
    bound: list[BoundServer] = []
    for spec in specs:

        async def run(
            settings: ServerSettings, wrapper: Wrapper | None, task_status: Any = trio.TASK_STATUS_IGNORED
        ) -> None:
            await serve_api(settings, app_wrapper=wrapper, task_status=task_status)

        bound.append(await nursery.start(run, server_settings(spec, pki), spec.wrapper))
    return bound


def node_specs(servers: list[BoundServer]) -> list[NodeSpec]:
    return [NodeSpec(s.host, s.port) for s in servers]


@contextmanager
def agents_in_thread(pki: Pki, specs: list[AgentSpec]) -> Iterator[list[BoundServer]]:
    """Agents in a background thread's trio loop, for tests that drive the CLI (its own trio.run)."""
    ready: queue.Queue[list[BoundServer] | BaseException] = queue.Queue()
    token_box: list[trio.lowlevel.TrioToken] = []
    stop: list[trio.CancelScope] = []

    async def main() -> None:
        token_box.append(trio.lowlevel.current_trio_token())
        try:
            async with trio.open_nursery() as nursery:
                stop.append(nursery.cancel_scope)
                ready.put(await start_agents(nursery, pki, specs))
        except BaseException as e:
            ready.put(e)
            raise

    thread = threading.Thread(target=lambda: trio.run(main), daemon=True)
    thread.start()
    got = ready.get(timeout=60)
    if isinstance(got, BaseException):
        thread.join(10)
        raise RuntimeError(f"agents failed to start: {got!r}") from got
    try:
        yield got
    finally:
        trio.from_thread.run_sync(stop[0].cancel, trio_token=token_box[0])
        thread.join(30)


# --- fault injection around a real agent ------------------------------------------------------------


def hang(path: str) -> Wrapper:
    """Requests to ``path`` never get an answer (other endpoints, e.g. /time, still do)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") == "http" and scope.get("path") == path:
                await trio.sleep_forever()
            await app(scope, receive, send)

        return wrapped

    return wrap


def fail(path: str, status: int = 500, error: str = "disk I/O error reading the trace database") -> Wrapper:
    """``path`` answers with the API's one error shape and ``status``."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") == "http" and scope.get("path") == path:
                body = json.dumps({"ok": False, "status": status, "error": error}).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
            await app(scope, receive, send)

        return wrapped

    return wrap


def cut_off(path: str) -> Wrapper:
    """``path``'s answer announces a longer body than it sends: the connection ends mid-answer."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") != "http" or scope.get("path") != path:
                await app(scope, receive, send)
                return

            async def short_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
                    message = {**message, "headers": [*headers, (b"content-length", b"1000000")]}
                await send(message)

            await app(scope, receive, short_send)

        return wrapped

    return wrap


def rewrite_json(path: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Wrapper:
    """``path``'s JSON answer passes through ``change`` (e.g. other column names: a schema mismatch)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") != "http" or scope.get("path") != path:
                await app(scope, receive, send)
                return
            start: dict[str, Any] = {}
            chunks: list[bytes] = []

            async def capture(message: Message) -> None:
                if message["type"] == "http.response.start":
                    start.update(message)
                elif message["type"] == "http.response.body":
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body"):
                        body = json.dumps(change(json.loads(b"".join(chunks)))).encode()
                        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                        await send({"type": "http.response.body", "body": body})

            await app(scope, receive, capture)

        return wrapped

    return wrap
