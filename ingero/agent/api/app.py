"""The agent's HTTP API as a small ASGI application (served by hypercorn's trio worker).

Routes (``/api/v1``): ``GET health``, ``GET info``, ``GET time``, ``POST query``, ``GET chains``,
``GET ops``, ``GET overview``. Success bodies carry ``"ok": true`` and ``"node"``; every failure is
``{"ok": false, "status": N, "error": "<one line>"}`` with ``N`` taken from
:attr:`~ingero.errors.IngeroError.http_status` (anything else is a logged 500 with a generic line).

Order of checks for every request: bearer token (when configured; constant-time compare), route
(404), method (405), query parameters, body (size cap, checked as it arrives: a body over the cap is
refused with 413 as soon as the cap is passed, never read to its end; UTF-8, JSON, field types), then
the work. ``/time`` and ``/health`` answer on the loop; everything that reads the database is admitted
into worker threads (:mod:`ingero.agent.api.workers`: fair per client, a short lane for cheap work, 503 with
``Retry-After`` when saturated), so they never wait behind a query.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from ingero import __version__
from ingero.agent.api import collectives, endpoints
from ingero.agent.api.endpoints import AgentContext, encode, ok
from ingero.agent.api.workers import META, SHORT, client_identity
from ingero.asgi import Receive, Scope, Send, lifespan, read_body
from ingero.errors import (
    AuthError,
    BodyTooLargeError,
    IngeroError,
    MethodNotAllowedError,
    NotFoundError,
    RequestError,
)

log = logging.getLogger("ingero.agent.api.app")


PREFIX = "/api/v1/"
MAX_BODY_BYTES = 1024 * 1024  # a query body; SQL text itself is capped at 100 000 characters
# After a 413 has been sent, what is still arriving is discarded for at most this long and
# this much, so that a client that writes its whole body before reading sees the answer (lingering close).
LINGER_BYTES = 16 * 1024 * 1024
LINGER_S = 2.0

_CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("ingero_api_client", default="peer:unknown")


class _Disconnected(Exception):
    pass


@dataclass
class Request:
    params: dict[str, str]
    received_ns: int
    body: bytes = b""


Handler = Callable[[Request], Awaitable[bytes]]


class AgentAPI:
    """ASGI app over one trace database. Several instances may live in one process."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        # name -> method -> (handler, known query parameters, uses a worker thread)
        self.routes: dict[str, dict[str, tuple[Handler, tuple[str, ...], bool]]] = {
            "health": {"GET": (self._health, (), False)},
            "info": {"GET": (self._info, (), True)},
            "time": {"GET": (self._time, (), False)},
            "query": {"POST": (self._query, (), True)},
            "chains": {"GET": (self._chains, endpoints.CHAINS_PARAMS, True)},
            "ops": {"GET": (self._ops, endpoints.WINDOW_PARAMS, True)},
            "overview": {"GET": (self._overview, endpoints.WINDOW_PARAMS, True)},
            "collectives": {"GET": (self._collectives, collectives.PARAMS, True)},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets: refuse
            return
        received_ns = time.time_ns()
        headers: list[tuple[bytes, bytes]] = []
        linger = False
        try:
            status, body, headers = 200, await self._dispatch(scope, receive, received_ns), []
        except _Disconnected:
            return
        except IngeroError as e:
            status, body = e.http_status, error_body(e.http_status, self._without_paths(e.one_line()))
            if isinstance(e, AuthError):
                headers = [(b"www-authenticate", b'Bearer realm="ingero"')]
            elif isinstance(retry_after := getattr(e, "retry_after_s", None), int):  # 503 busy, 429 limited
                headers = [(b"retry-after", str(retry_after).encode())]
            elif isinstance(e, MethodNotAllowedError):
                allowed = ", ".join(sorted(self.routes.get(_route_name(scope["path"]), {})))
                headers = [(b"allow", allowed.encode())]
            elif isinstance(e, BodyTooLargeError):
                linger = True
                if scope.get("http_version", "1.1").startswith("1"):  # (connection headers are illegal in HTTP/2)
                    headers = [(b"connection", b"close")]
        except Exception:
            log.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            status = 500
            body = error_body(500, "internal error in the agent; its log has the details")
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                    (b"cache-control", b"no-store"),
                    (b"x-content-type-options", b"nosniff"),
                    # NTP t2/t3 on every answer: the fleet client's clock-skew sample rides the query
                    (b"x-ingero-receive-ns", str(received_ns).encode()),
                    (b"x-ingero-transmit-ns", str(time.time_ns()).encode()),
                    *headers,
                ],
            }
        )
        if linger:  # the whole answer now (content-length), the end of the message after the discard
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await _discard_rest(receive)
            body = b""
        await send({"type": "http.response.body", "body": body})

    async def _dispatch(self, scope: Scope, receive: Receive, received_ns: int) -> bytes:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        self._check_auth(headers)
        method, path = scope["method"], scope["path"]
        name = _route_name(path)
        methods = self.routes.get(name) if path.startswith(PREFIX) else None
        if methods is None:
            raise NotFoundError(
                f"no such endpoint: {method} {path}", hint="endpoints: " + ", ".join(PREFIX + n for n in self.routes)
            )
        if method not in methods:
            raise MethodNotAllowedError(f"{method} is not allowed on {path}; use {' or '.join(sorted(methods))}")
        handler, known, heavy = methods[method]
        _CLIENT.set(client_identity(scope))
        req = Request(_params(scope, known), received_ns)
        if method == "POST":
            req.body = await _read_body(receive, headers)
        if not heavy:
            return await handler(req)
        # the client may hang up while its query runs: then cancel the work (the guard stops the statement)
        answer: list[bytes] = []
        failure: list[Exception] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                answer.append(await handler(req))
            except Exception as e:  # raised as itself, not wrapped in the nursery's ExceptionGroup
                failure.append(e)
            nursery.cancel_scope.cancel()
        if failure:
            raise failure[0]
        if not answer:
            raise _Disconnected
        return answer[0]

    def _without_paths(self, text: str) -> str:
        """Remote clients never learn where the database lives: its path becomes its file name."""
        path = self.ctx.db_path
        for form in sorted({str(path), str(path.resolve())}, key=len, reverse=True):
            text = text.replace(form, path.name)
        return text

    def _check_auth(self, headers: Mapping[bytes, bytes]) -> None:
        token = self.ctx.token
        if not token:
            return
        raw = headers.get(b"authorization")
        if raw is None:
            raise AuthError(
                "missing bearer token", hint="send 'Authorization: Bearer <token>' (ingero --token / $INGERO_TOKEN)"
            )
        scheme, _, given = raw.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), token.encode()):
            raise AuthError("wrong bearer token", hint="check --token / $INGERO_TOKEN on both sides")

    # --- handlers ------------------------------------------------------------------------------

    async def _health(self, req: Request) -> bytes:
        return encode(ok(self.ctx, status="ok", version=__version__))

    async def _time(self, req: Request) -> bytes:
        doc = ok(self.ctx, receive_ns=req.received_ns, transmit_ns=0)
        doc["transmit_ns"] = time.time_ns()
        return encode(doc)

    async def _info(self, req: Request) -> bytes:
        return await self._in_worker(lambda cancel: endpoints.info(self.ctx, cancel), meta=True)

    async def _query(self, req: Request) -> bytes:
        doc = endpoints.check_query_body(_json_body(req.body))
        return await self._in_worker(
            lambda cancel: endpoints.query(self.ctx, doc, cancel), endpoints.query_timeout_ms(self.ctx, doc)
        )

    async def _chains(self, req: Request) -> bytes:
        return await self._in_worker(lambda cancel: endpoints.chains(self.ctx, req.params, cancel))

    async def _ops(self, req: Request) -> bytes:
        return await self._in_worker(lambda cancel: endpoints.ops(self.ctx, req.params, cancel))

    async def _overview(self, req: Request) -> bytes:
        return await self._in_worker(lambda cancel: endpoints.overview(self.ctx, req.params, cancel))

    async def _collectives(self, req: Request) -> bytes:
        return await self._in_worker(lambda cancel: collectives.collectives(self.ctx, req.params, cancel))

    async def _in_worker(
        self, fn: Callable[[threading.Event], bytes], budget_ms: int | None = None, *, meta: bool = False
    ) -> bytes:
        """Run ``fn`` in a worker thread within ``budget_ms`` of its own time (default: the analysis
        budget); the time it waits for admission is not counted."""
        budget_s = (budget_ms or self.ctx.budget.analysis_timeout_ms) / 1000
        return await self.ctx.workers.run(
            fn, client=_CLIENT.get(), hard_s=budget_s * 1.25 + 1.0, lane=META if meta else SHORT
        )


def error_body(status: int, message: str) -> bytes:
    return encode({"ok": False, "status": status, "error": " ".join(message.split())})


def _route_name(path: str) -> str:
    return path[len(PREFIX) :] if path.startswith(PREFIX) else ""


def _params(scope: Scope, known: tuple[str, ...]) -> dict[str, str]:
    raw: bytes = scope.get("query_string", b"")
    if not raw:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(raw.decode("utf-8"), keep_blank_values=True, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise RequestError("the query string is not valid UTF-8 / URL encoding") from None
    out: dict[str, str] = {}
    for k, v in pairs:
        if k not in known:
            hint = ("known: " + ", ".join(known)) if known else "this endpoint takes no parameters"
            raise RequestError(f"unknown parameter {k!r}", hint=hint)
        out[k] = v
    return out


async def _read_body(receive: Receive, headers: Mapping[bytes, bytes]) -> bytes:
    """The body, refused (413, connection closed) the moment it is known to pass the cap: from its
    declared length, or from the chunk that passes it — the rest is never read."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLargeError(f"request body of {int(declared)} bytes is over the {MAX_BODY_BYTES}-byte limit")
    return await read_body(
        receive, MAX_BODY_BYTES, f"request body is over the {MAX_BODY_BYTES}-byte limit", _Disconnected
    )


def _json_body(body: bytes) -> Any:
    if not body.strip():
        raise RequestError("empty request body", hint='send {"sql": "SELECT ..."}')
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"request body is not UTF-8 (bad byte at offset {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise RequestError("request body JSON is nested too deeply") from None
    except ValueError as e:  # e.g. an integer literal with thousands of digits
        raise RequestError(f"request body is not usable JSON: {e}") from None


async def _discard_rest(receive: Receive) -> None:
    """Drop what is still arriving of a refused body, bounded in bytes and time (see LINGER_BYTES)."""
    dropped = 0
    with trio.move_on_after(LINGER_S):
        while dropped <= LINGER_BYTES:
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                return
            dropped += len(msg.get("body", b""))


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
