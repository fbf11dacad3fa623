"""Real agents for the fleet tests: ingero's own PKI (``tests.agent_servers.make_pki``), ``serve_api``
listeners on 127.0.0.1 (port 0, readiness through ``task_status``), ASGI wrappers that make one agent
slow, failing, cut-off or off-schema while it still serves real TLS, and the events of a straggler.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ingero.agent.api.server import BoundServer, ServerSettings, serve_api
from ingero.asgi import ASGIApp, Message, Receive, Scope, Send
from ingero.config import NodeSpec
from ingero.fleet.settings import ClientSettings
from ingero.identity import Identity
from ingero.store.writer import EventRow
from ingero.tools.http import node_tools
from tests import agent_servers

Pki = agent_servers.Pki  # the agent tests' PKI; test modules import both from here too
make_pki = agent_servers.make_pki
Wrapper = Callable[[ASGIApp], ASGIApp]
BASE_NS = 1_775_218_715_000_000_000
MS = 1_000_000


def client_settings(pki: Pki, **kw: Any) -> ClientSettings:
    """mTLS client settings for agents with ``pki``'s certificates; ``kw`` overrides."""
    base: dict[str, Any] = {
        "ca_cert": str(pki.ca),
        "client_cert": str(pki.client_cert),
        "client_key": str(pki.client_key),
        "timeout_s": 5.0,
    }
    return ClientSettings(**{**base, **kw})


def closed_port() -> int:
    """A port on 127.0.0.1 that nobody listens on (bound, learnt, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def straggler_events(n_host: int, host_ms: float, seed: int, *, tail: bool = False) -> list[EventRow]:
    """Kernel launches plus host events (sched_switch off-CPU, block writes) of a given mean duration,
    interleaved in one time window; with ``tail`` every 12th launch is slow (a p99 >> p50 symptom)."""
    rows: list[EventRow] = []
    t = BASE_NS + seed
    launches = 300
    for i in range(max(launches, n_host)):
        t += 1 * MS
        if i < launches:
            dur = 20_000 + (i % 7) * 1000
            if tail and i % 12 == 0:
                dur = 1_500_000 + (i % 5) * 100_000
            rows.append((t, 4242, 4242, 4, 1, dur, 0, 0, 0, 0, 0, 0))  # cuLaunchKernel
        if i < n_host:
            source, op = (3, 1) if i % 2 else (5, 2)
            dur = int(host_ms * MS * (0.8 + 0.4 * ((i * 7919 + seed) % 100) / 100))
            rows.append((t + 1000, 4242, 4242, source, op, dur, 0, 4096, 0, 0, 0, 0))
    return rows


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
    started = []
    for spec in specs:
        settings = server_settings(spec, pki)
        tools, extra = node_tools(settings), spec.wrapper
        wrap: Wrapper = tools if extra is None else (lambda app, t=tools, w=extra: w(t(app)))  # type: ignore[misc]
        started.append(await nursery.start(partial(serve_api, settings, app_wrapper=wrap)))
    return started


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


def shift_clock(shift_ns: int) -> Wrapper:
    """The agent's clock reads ``shift_ns`` ahead: /time's body and every answer's t2/t3 headers."""
    from ingero.fleet.skew import RECEIVE_HEADER, TRANSMIT_HEADER

    names = {RECEIVE_HEADER.encode(), TRANSMIT_HEADER.encode()}

    def shifted_body(body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "receive_ns": body["receive_ns"] + shift_ns, "transmit_ns": body["transmit_ns"] + shift_ns}

    def wrap(app: ASGIApp) -> ASGIApp:
        inner = rewrite_json("/api/v1/time", shifted_body)(app)

        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            async def shifted(message: Message) -> None:
                if message["type"] == "http.response.start":
                    headers = [
                        (k, str(int(v) + shift_ns).encode() if k.lower() in names else v)
                        for k, v in message.get("headers", [])
                    ]
                    message = {**message, "headers": headers}
                await send(message)

            await inner(scope, receive, shifted)

        return wrapped

    return wrap


def stream(
    path: str, chunks: Callable[[], Iterator[bytes]], *, length: int | None = None, pause_s: float = 0.0
) -> Wrapper:
    """``path`` answers 200 with the bytes ``chunks()`` yields (chunked, or ``length`` announced),
    ``pause_s`` between chunks: huge, endless, dribbling or malformed answers from a real TLS agent."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") != "http" or scope.get("path") != path:
                await app(scope, receive, send)
                return
            headers = [(b"content-type", b"application/json")]
            if length is not None:
                headers.append((b"content-length", str(length).encode()))
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for chunk in chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if pause_s:
                    await trio.sleep(pause_s)
                else:
                    await trio.lowlevel.checkpoint()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return wrapped

    return wrap
