"""``ingero dashboard``: the browser surface of the tool registry (ASGI, served over HTTPS by
:func:`ingero.agent.api.https.serve_asgi`).

Pages: ``/`` (the dashboard), ``/login`` (takes the token, answers a session cookie marked Secure,
HttpOnly, SameSite=Strict), ``/logout``, ``/static/...`` (our JS/CSS and the vendored uPlot),
``/dashboard/config`` (what this dashboard shows: a fleet or one database). Every figure on the page is
fetched from the tools API (``/api/v1/tools/<name>``, :mod:`ingero.tools.http`) mounted on the same
port behind the same guard (authentication → audit → rate limit): there is no second query path.

Who may look: with a token configured, whoever holds it (bearer header or the login's session cookie);
with mTLS, the TLS handshake already demanded a client certificate; with neither (loopback only, as
``ingero mcp --http`` refuses otherwise), anyone on this host. Cookie-authenticated calls must carry
``X-Ingero: 1`` (a custom header a cross-site form cannot send), which with SameSite=Strict closes CSRF.
"""

from __future__ import annotations

import hmac
import mimetypes
import secrets
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

import trio

from ingero import __version__
from ingero.asgi import ASGIApp, Receive, Scope, Send, lifespan
from ingero.errors import RateLimitedError
from ingero.explain.ledger import BUCKETS, GPU_SLOW, GPU_STEADY, WORDS
from ingero.store.catalog import GPU_API_SOURCES, SOURCE_NAMES
from ingero.tools import registry
from ingero.tools.http import Auth, Guard, RateLimit, ToolsAPI, is_tools_path, send_json
from ingero.tools.registry import ToolEnv

if TYPE_CHECKING:
    from ingero.agent.api.https import Listen
    from ingero.agent.api.server import BoundServer

COOKIE = "ingero_session"
CSRF_HEADER = b"x-ingero"
SESSION_TTL_S = 12 * 3600
MAX_FORM_BYTES = 4096
STATIC_PACKAGE = "ingero.dashboard"
LEDGER_LABELS = {GPU_STEADY: "GPU calls", GPU_SLOW: "GPU calls slower than steady", **WORDS}
SECURITY_HEADERS = [
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        b"frame-ancestors 'none'; form-action 'self'",
    ),
    (b"strict-transport-security", b"max-age=31536000"),
]


@dataclass
class Sessions:
    """Login sessions: random ids → expiry (monotonic seconds), in memory (a restart logs everyone out)."""

    ttl_s: float = SESSION_TTL_S
    _ids: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def new(self) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            now = time.monotonic()
            self._ids = {k: v for k, v in self._ids.items() if v > now}
            self._ids[sid] = now + self.ttl_s
        return sid

    def valid(self, sid: str) -> bool:
        with self._lock:
            expiry = self._ids.get(sid)
        return expiry is not None and expiry > time.monotonic()

    def drop(self, sid: str) -> None:
        with self._lock:
            self._ids.pop(sid, None)

    def from_headers(self, headers: Mapping[bytes, bytes], *, csrf: bool = True) -> str | None:
        """The session id of a valid cookie (and, when ``csrf``, the X-Ingero header), else None."""
        if csrf and headers.get(CSRF_HEADER) != b"1":
            return None
        sid = cookie_value(headers.get(b"cookie", b""), COOKIE)
        return sid if sid and self.valid(sid) else None


def cookie_value(raw: bytes, name: str) -> str | None:
    for part in raw.decode("latin-1").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


@dataclass(frozen=True)
class DashboardSettings:
    env: ToolEnv
    token: str | None = None
    mtls: bool = False
    title: str = "ingero"


class Dashboard:
    """The dashboard's ASGI app (pages and assets), with the guarded tools API in front."""

    def __init__(self, settings: DashboardSettings, *, limit: RateLimit | None = None) -> None:
        self.settings = settings
        self.sessions = Sessions()
        auth = Auth(
            token=settings.token, mtls=settings.mtls, cookie=self.sessions.from_headers if settings.token else None
        )
        self.auth = auth
        self.tools = Guard(
            ToolsAPI(settings.env, title="ingero dashboard tools API"),
            auth=auth,
            surface="dashboard",
            limit=limit or RateLimit(per_second=50.0, burst=100),  # one page load asks several tools at once
        )

    @property
    def app(self) -> ASGIApp:  # the middleware convention: the wrapped app is ``.app``
        return self.tools

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if is_tools_path(path):
            await self.tools(scope, receive, send)
        elif path.startswith("/static/") and method == "GET":
            await self._static(path.removeprefix("/static/"), send)
        elif path == "/login":
            await self._login(scope, receive, send)
        elif path == "/logout" and method == "POST":
            await self._logout(scope, send)
        elif path == "/dashboard/config" and method == "GET":
            if not self._allowed(scope, csrf=True):
                await send_json(send, 401, b'{"ok":false,"status":401,"kind":"unauthorized","error":"log in first"}')
                return
            await send_json(send, 200, registry.encode_answer(self.config()).encode())
        elif path in ("/", "/index.html") and method == "GET":
            if not self._allowed(scope, csrf=False):
                await _redirect(send, "/login")
                return
            await self._static("index.html", send)
        else:
            await _page(send, 404, b"<!doctype html><title>not found</title><p>no such page</p>")

    def _allowed(self, scope: Scope, *, csrf: bool) -> bool:
        if not self.settings.token:
            return True  # mTLS (the handshake checked the certificate) or loopback without auth
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.sessions.from_headers(headers, csrf=csrf) is not None:
            return True
        raw = headers.get(b"authorization", b"")
        scheme, _, given = raw.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.settings.token.encode())

    def config(self) -> dict[str, Any]:
        env = self.settings.env
        return {
            "ok": True,
            "title": self.settings.title,
            "version": __version__,
            "mode": "fleet" if env.nodes else "local",
            "nodes": [n.name or n.addr for n in env.nodes],
            "database": env.db.name if env.db else None,
            "gpu_sources": sorted(SOURCE_NAMES[s] for s in GPU_API_SOURCES if s in SOURCE_NAMES),
            # the wall-time ledger's buckets, in order, with the words explain prints for them
            "ledger_buckets": [{"name": b, "label": LEDGER_LABELS[b]} for b in BUCKETS],
            "login": bool(self.settings.token),
        }

    async def _static(self, name: str, send: Send) -> None:
        parts = [p for p in name.split("/") if p]
        if not parts or any(p.startswith(".") for p in parts):
            await _page(send, 404, b"not found")
            return
        node = resources.files(STATIC_PACKAGE).joinpath("static", *parts)
        if not node.is_file():
            await _page(send, 404, b"not found")
            return
        body = node.read_bytes()
        ctype = mimetypes.guess_type(parts[-1])[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        await _send(send, 200, body, [(b"content-type", ctype.encode())])

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "GET":
            await self._static("login.html", send)
            return
        if scope["method"] != "POST":
            await _page(send, 405, b"use GET or POST")
            return
        peer = scope.get("client")
        try:  # guessing the token is rate-limited like any call (per address)
            self.tools.limit.take(f"login:{peer[0] if peer else 'unknown'}")
        except RateLimitedError as e:
            await _send(
                send,
                429,
                b"too many login attempts; wait and retry",
                [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", str(e.retry_after_s).encode())],
            )
            return
        form = urllib.parse.parse_qs((await _read_form(receive)).decode("utf-8", "replace"))
        given = (form.get("token") or [""])[0].strip()
        token = self.settings.token
        if token is None:
            await _redirect(send, "/")
            return
        if not hmac.compare_digest(given.encode(), token.encode()):
            self.tools.audit(
                {
                    "ts": registry.iso_us(time.time_ns()),
                    "surface": "dashboard",
                    "method": "POST",
                    "path": "/login",
                    "client": "refused",
                    "status": 401,
                }
            )
            await _redirect(send, "/login?error=wrong-token")
            return
        sid = self.sessions.new()
        cookie = f"{COOKIE}={sid}; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age={SESSION_TTL_S}"
        await _redirect(send, "/", [(b"set-cookie", cookie.encode())])

    async def _logout(self, scope: Scope, send: Send) -> None:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        sid = cookie_value(headers.get(b"cookie", b""), COOKIE)
        if sid:
            self.sessions.drop(sid)
        expired = f"{COOKIE}=; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=0"
        await _redirect(send, "/login", [(b"set-cookie", expired.encode())])


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode()), *SECURITY_HEADERS],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _page(send: Send, status: int, body: bytes) -> None:
    await _send(send, status, body, [(b"content-type", b"text/html; charset=utf-8")])


async def _redirect(send: Send, where: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send(send, 303, b"", [(b"location", where.encode()), *(extra or [])])


async def _read_form(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b""
        part: bytes = msg.get("body", b"")
        size += len(part)
        if size <= MAX_FORM_BYTES:
            chunks.append(part)
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def serve_dashboard(
    settings: DashboardSettings,
    listen: Listen,
    *,
    task_status: trio.TaskStatus[BoundServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard at ``listen`` until cancelled (``task_status`` gets the bound address)."""
    from ingero.agent.api.https import serve_asgi

    await serve_asgi(Dashboard(settings), listen, path="/", task_status=task_status)
