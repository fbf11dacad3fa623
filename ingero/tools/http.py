"""The HTTP+JSON tools API (ASGI), and the middleware every tool surface passes through.

Routes (the same on the agent, on ``ingero mcp --http`` and on the dashboard):

* ``GET /api/versions`` — unauthenticated: API major.minor and capabilities only;
* ``GET /api/v1/tools/list`` — every tool with its input schema;
* ``POST /api/v1/tools/<name>`` — a JSON object of arguments; 200 answers the tool's compact JSON (the
  same text MCP returns), failures ``{"ok": false, "status", "kind", "error"}`` (:mod:`.failures`);
* ``GET /api/v1/openapi.json`` — OpenAPI 3.1, generated from the registry.

:class:`Guard` wraps an ASGI app in this order: **authentication** (bearer token, a dashboard session
cookie, or the TLS client certificate the handshake already required) → **audit** (one structured JSON
log line per request, refusals included) → **rate limit** (a token bucket per client identity, 429 with
``Retry-After``) → the handler. Paths outside ``guarded`` pass through untouched (the agent's older
endpoints keep their own checks).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from ingero import API_VERSION, __version__
from ingero.agent.api.server import ServerSettings
from ingero.asgi import ASGIApp, Message, Receive, Scope, Send, lifespan, read_body
from ingero.errors import (
    AuthError,
    IngeroError,
    MethodNotAllowedError,
    NotFoundError,
    RateLimitedError,
    RequestError,
)
from ingero.tools import registry, toolset
from ingero.tools.failures import Failure, classify
from ingero.tools.openapi import OPENAPI_PATH, TOOLS_PREFIX, VERSIONS_PATH, openapi_document
from ingero.tools.registry import ToolEnv

PUBLIC_PATHS = frozenset({VERSIONS_PATH})
MAX_ARGS_BYTES = 256 * 1024
TOOL_THREADS = 4  # blocking tool calls (statistics, explain, SQL) running at once per server
API_MINOR = 1  # 1.1: the tool registry (tools, OpenAPI) beside the v1 endpoints
CAPABILITIES = ("tools", "openapi", "mcp-streamable-http", "dashboard")
JSON_HEADERS = [
    (b"content-type", b"application/json; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
]

audit_log = logging.getLogger("ingero.audit")


def is_tools_path(path: str) -> bool:
    return path in (VERSIONS_PATH, OPENAPI_PATH) or path.startswith(TOOLS_PREFIX)


# --- rate limit ----------------------------------------------------------------------------------


@dataclass
class RateLimit:
    """Token buckets per client identity: ``burst`` calls at once, refilled at ``per_second``."""

    per_second: float = 20.0
    burst: int = 40
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, who: str) -> None:
        """Spend one token of ``who``'s bucket or raise RateLimitedError with the wait in seconds."""
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.get(who, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.per_second)
            if tokens < 1.0:
                self._buckets[who] = (tokens, now)
                wait = max(1, math.ceil((1.0 - tokens) / self.per_second))
                raise RateLimitedError(
                    f"rate limit: {self.burst} calls at once, then {self.per_second:g}/s per client",
                    retry_after_s=wait,
                    hint=f"retry after {wait} s",
                )
            self._buckets[who] = (tokens - 1.0, now)
            if len(self._buckets) > 10_000:  # forget idle clients (full buckets carry no state)
                full = [k for k, (t, _) in self._buckets.items() if t >= self.burst]
                for k in full:
                    del self._buckets[k]


# --- authentication ------------------------------------------------------------------------------

CookieCheck = Callable[[Mapping[bytes, bytes]], str | None]


@dataclass(frozen=True)
class Auth:
    """Who may call: a bearer token (constant-time compare), a session cookie check (the dashboard), and
    whether the TLS layer already demanded a client certificate (mTLS)."""

    token: str | None = None
    mtls: bool = False
    cookie: CookieCheck | None = None

    def authenticate(self, scope: Scope) -> str:
        """The caller's identity for audit and rate limit, or AuthError."""
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        peer = scope.get("client")
        addr = f"{peer[0]}" if peer else "unknown"
        raw = headers.get(b"authorization")
        if self.token and raw is not None:
            scheme, _, given = raw.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token.encode()):
                return f"token:{addr}"
            raise AuthError("wrong bearer token", hint="check --token / $INGERO_TOKEN on both sides")
        if self.cookie is not None:
            session = self.cookie(headers)
            if session is not None:
                return f"session:{session}"
        if self.token or self.cookie is not None:
            raise AuthError(
                "missing bearer token", hint="send 'Authorization: Bearer <token>' (ingero --token / $INGERO_TOKEN)"
            )
        return f"{'mtls' if self.mtls else 'peer'}:{addr}"


# --- the guard (auth → audit → rate limit → handler) ---------------------------------------------


AuditSink = Callable[[dict[str, Any]], None]


def log_audit(record: dict[str, Any]) -> None:
    audit_log.info("%s", json.dumps(record, separators=(",", ":"), ensure_ascii=False))


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        auth: Auth,
        surface: str,
        limit: RateLimit | None = None,
        audit: AuditSink = log_audit,
        guarded: Callable[[str], bool] = lambda _path: True,
    ) -> None:
        self.app, self.auth, self.surface = app, auth, surface
        self.limit = limit or RateLimit()
        self.audit = audit
        self.guarded = guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        record: dict[str, Any] = {
            "ts": registry.iso_us(time.time_ns()),
            "surface": self.surface,
            "method": scope.get("method"),
            "path": scope.get("path"),
        }
        seen: dict[str, Any] = {}

        async def watching_send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                seen["status"] = msg["status"]
            await send(msg)

        try:
            who = "public" if scope["path"] in PUBLIC_PATHS else self.auth.authenticate(scope)  # authentication
            record["client"] = who
            self.limit.take(who)  # rate limit (after audit opened the record)
        except IngeroError as e:
            failure = classify(e)
            record.setdefault("client", "refused")
            await send_failure(watching_send, failure)
        else:
            await self.app(scope, receive, watching_send)
        finally:
            record["status"] = seen.get("status", 499)
            record["ms"] = round((time.monotonic() - started) * 1000, 3)
            self.audit(record)  # audit: every request, refusals included


async def send_json(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_failure(send: Send, failure: Failure) -> None:
    extra: list[tuple[bytes, bytes]] = []
    if failure.kind == "unauthorized":
        extra.append((b"www-authenticate", b'Bearer realm="ingero"'))
    if failure.retry_after_s is not None:
        extra.append((b"retry-after", str(failure.retry_after_s).encode()))
    await send_json(send, failure.status, registry.encode_answer(failure.as_dict()).encode(), extra)


# --- the tools API --------------------------------------------------------------------------------


def versions_doc() -> dict[str, Any]:
    """``major.minor``: the major is the agent API's (``/api/v1``), the minor counts compatible additions."""
    current = f"{API_VERSION}.{API_MINOR}"
    return {"versions": [current], "current": current, "capabilities": list(CAPABILITIES)}


class ToolsAPI:
    """ASGI app for the tools routes; anything else goes to ``fallback`` (or 404)."""

    def __init__(self, env: ToolEnv, *, fallback: ASGIApp | None = None, title: str = "ingero tools API") -> None:
        self.env = env
        self.app = fallback
        self.title = title
        self._threads: trio.CapacityLimiter | None = None  # made on the serving loop, at the first call

    async def _run_sync(self, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Blocking tool work in a worker thread, at most ``TOOL_THREADS`` at once per server."""
        if self._threads is None:
            self._threads = trio.CapacityLimiter(TOOL_THREADS)
        return await trio.to_thread.run_sync(fn, limiter=self._threads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not is_tools_path(path):
            if self.app is not None:
                await self.app(scope, receive, send)
            elif scope["type"] == "http":
                await send_failure(send, classify(NotFoundError(f"no such endpoint: {path}")))
            elif scope["type"] == "lifespan":
                await lifespan(receive, send)
            return
        tool = path[len(TOOLS_PREFIX) :] if path.startswith(TOOLS_PREFIX) else ""
        try:
            status, body = 200, await self._answer(scope, receive, path, tool)
        except Exception as e:
            failure = classify(e, tool=tool)
            await send_failure(send, failure)
            return
        await send_json(send, status, body.encode())

    async def _answer(self, scope: Scope, receive: Receive, path: str, tool: str) -> str:
        method = scope["method"]
        if path in (VERSIONS_PATH, OPENAPI_PATH) or tool == "list":
            if method != "GET":
                raise MethodNotAllowedError(f"{method} is not allowed on {path}; use GET")
            if path == VERSIONS_PATH:
                return registry.encode_answer(versions_doc())
            if path == OPENAPI_PATH:
                return registry.encode_answer(openapi_document(self.title))
            return registry.encode_answer(
                {"ok": True, "version": __version__, "tools": [t.as_dict() for t in toolset.tools().values()]}
            )
        toolset.get(tool)  # unknown tool: 404 before reading the body
        if method != "POST":
            raise MethodNotAllowedError(f"{method} is not allowed on {path}; use POST with a JSON object")
        args = _json_object(await read_body(receive, MAX_ARGS_BYTES, f"arguments over {MAX_ARGS_BYTES} bytes", _gone))
        return registry.encode_answer(await toolset.call(tool, args, self.env, run_sync=self._run_sync))


def _gone() -> RequestError:
    return RequestError("the client went away")


def _json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise RequestError("the body is not valid UTF-8 JSON", hint='send the arguments as {"name": value}') from None
    if not isinstance(doc, dict):
        raise RequestError("the body must be a JSON object of arguments", hint='e.g. {"query": "SELECT 1"}')
    return doc


def node_tools(settings: ServerSettings) -> Callable[[ASGIApp], ASGIApp]:
    """The wrapper that mounts the tools routes on an agent (``serve_api(..., app_wrapper=...)``)."""
    env = ToolEnv(db=settings.db_path.expanduser())
    mtls = settings.tls_mode == "mtls"
    return lambda inner: agent_tools_app(inner, env=env, token=settings.token or None, mtls=mtls)


def agent_tools_app(
    inner: ASGIApp, *, env: ToolEnv, token: str | None, mtls: bool, audit: AuditSink = log_audit
) -> ASGIApp:
    """The agent's app with the tools routes in front (same port; its older endpoints untouched)."""
    api = ToolsAPI(env, fallback=inner, title="ingero agent tools API")
    return Guard(api, auth=Auth(token=token, mtls=mtls), surface="agent", audit=audit, guarded=is_tools_path)
