"""Serving the agent API: hypercorn's trio worker on a socket we bind ourselves, TLS 1.3 only.

:func:`serve_api` is the one entry point (``ingero serve``, ``ingero trace --listen``, tests, the fleet
benchmarks that run 128 listeners in one process). It checks the database and the TLS settings,
binds (port 0 works), and reports readiness with ``task_status.started(BoundServer(...))`` carrying
the real port, URL, TLS mode and certificate fingerprint. Cancelling the surrounding nursery stops it.

hypercorn builds its own ``SSLContext`` from its ``Config`` (TLS 1.2 minimum); :class:`_HypercornConfig`
hands it ours instead (TLS 1.3 minimum, client CA and ``CERT_REQUIRED`` for mTLS).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from ingero.agent.api import hypercorn_h2
from ingero.agent.api.app import AgentAPI
from ingero.agent.api.endpoints import AgentContext
from ingero.agent.api.workers import Admission, AdmissionLimits, PeerRecordingSSLObject
from ingero.asgi import ASGIApp
from ingero.config import is_loopback
from ingero.errors import PortInUseError, UsageError
from ingero.identity import Identity
from ingero.store.budget import QueryBudget
from ingero.store.db import open_readonly
from ingero.store.instance import agent_instance, instance_of
from ingero.tls import context

log = logging.getLogger("ingero.agent.api.server")


@dataclass
class ServerSettings:
    db_path: Path
    identity: Identity
    host: str = "127.0.0.1"
    port: int = 8080
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    token: str | None = None
    no_tls: bool = False
    allow_plaintext_remote: bool = False
    insecure_no_auth: bool = False  # serve beyond loopback with neither a client CA nor a token
    budget: QueryBudget = field(default_factory=QueryBudget)
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    tls_dir: Path | None = None  # where the self-signed certificate lives (default ~/.ingero/tls)
    backlog: int = 128
    # which database is served (:func:`ingero.store.instance.database_key`), when the caller read it in the
    # one read-only open of its start-up (``ingero serve``): the database is then neither checked nor
    # opened again here. None: read it when the app is built (``trace --listen`` serves what it writes).
    db_key: str | None = None

    @property
    def tls_mode(self) -> str:
        """``plaintext`` (--no-tls), ``mtls`` (a client CA) or ``tls``."""
        return "plaintext" if self.no_tls else "mtls" if self.client_ca else "tls"


@dataclass
class BoundServer:
    host: str
    port: int
    url: str
    tls_mode: str  # "mtls" | "tls" | "plaintext"
    fingerprint_sha256: str | None


@dataclass(frozen=True)
class TLSSetup:
    """What :func:`preflight` settled: the SSL context (None: plaintext), for ``ingero serve``'s note the
    certificate and whether it was just made, and the listening socket it bound (kept: never closed and
    bound again, so no other process can take the port in between)."""

    context: ssl.SSLContext | None
    mode: str
    fingerprint: str | None
    cert: Path | None
    created: bool = False
    sock: socket.socket | None = None


class _HypercornConfig(HypercornConfig):
    """hypercorn configuration that serves our prebuilt SSL context instead of building its own."""

    def __init__(self, ssl_context: ssl.SSLContext | None) -> None:
        super().__init__()
        self._ingero_ssl = ssl_context
        self.loglevel = "WARNING"
        self.errorlog = logging.getLogger("ingero.agent.api.http")
        self.accesslog = None
        self.include_server_header = False
        self.ssl_handshake_timeout = 10.0
        self.keep_alive_timeout = 30.0
        self.read_timeout = 120
        self.graceful_timeout = 1.0
        self.h11_max_incomplete_size = 64 * 1024

    @property
    def ssl_enabled(self) -> bool:
        return self._ingero_ssl is not None

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return self._ingero_ssl


def _is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


def check_exposure(settings: ServerSettings) -> None:
    """Who could reach this listener, checked before anything is made or bound: plain HTTP only on
    loopback (unless ``--allow-plaintext-remote``); beyond loopback some authentication (client CA or
    token) unless the operator said ``--insecure-no-auth`` by name; an empty token is always an error."""
    s = settings
    if s.no_tls:
        if s.tls_cert or s.tls_key or s.client_ca:
            raise UsageError("--no-tls conflicts with --tls-cert/--tls-key/--client-ca", hint="drop one of them")
        if not is_loopback(s.host) and not s.allow_plaintext_remote:
            raise UsageError(
                f"refusing plain HTTP on {s.host}: traces and tokens would cross the network unencrypted",
                hint="listen on 127.0.0.1, drop --no-tls, or add --allow-plaintext-remote to accept the risk",
            )
    if s.token is not None and not s.token.strip():
        raise UsageError("the bearer token is empty", hint="put a token in --token-file, or drop the token setting")
    if is_loopback(s.host) or s.token or s.client_ca or s.insecure_no_auth:
        return
    raise UsageError(
        f"refusing to serve {s.host} without authentication: anyone who can reach it could read this node's traces",
        hint="add --client-ca (mutual TLS) or --token-file, listen on 127.0.0.1, or say --insecure-no-auth",
    )


def server_cert(
    tls_cert: Path | None, tls_key: Path | None, host: str, tls_dir: Path | None, common_name: str
) -> tuple[Path, Path, context.AutoCert | None]:
    """The certificate and key to serve ``host`` with: the pair given (both or neither), else the
    self-signed one in ``tls_dir`` (reused or made; it also names ``host`` unless that is a wildcard)."""
    if (tls_cert is None) != (tls_key is None):
        raise UsageError(
            "--tls-cert and --tls-key go together", hint="give both, or neither for a self-signed certificate"
        )
    if tls_cert is not None and tls_key is not None:
        return tls_cert.expanduser(), tls_key.expanduser(), None
    extra = [] if _is_wildcard(host) else [host.strip("[]")]
    auto = context.ensure_auto_cert(tls_dir, common_name=common_name, extra_names=extra)
    return auto.cert, auto.key, auto


def prepare_tls(settings: ServerSettings) -> TLSSetup:
    s = settings
    check_exposure(s)
    if s.no_tls:
        return TLSSetup(None, "plaintext", None, None)
    cert, key, auto = server_cert(s.tls_cert, s.tls_key, s.host, s.tls_dir, s.identity.node)
    fingerprint, created = (auto.fingerprint_sha256, auto.created) if auto else (None, False)
    ctx = context.server_ssl_context(cert, key, s.client_ca.expanduser() if s.client_ca else None)
    ctx.sslobject_class = PeerRecordingSSLObject  # client certificate subject → fair admission per client
    return TLSSetup(ctx, s.tls_mode, fingerprint or context.cert_fingerprint(cert), cert, created)


def bind_socket(host: str, port: int, backlog: int) -> socket.socket:
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"cannot resolve listen address {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and _is_wildcard(bare):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(port, hint="pick another --listen port or stop what holds it") from None
        raise UsageError(
            f"cannot listen on {host}:{port}: {e.strerror or e}",
            hint="pick another --listen port or stop what holds it",
        ) from None
    return sock


def _url(scheme: str, host: str, port: int) -> str:
    h = host.strip("[]")
    return f"{scheme}://[{h}]:{port}" if ":" in h else f"{scheme}://{h}:{port}"


def check_database(path: Path) -> None:
    """Fail before listening when the database is missing or unreadable (one clear line)."""
    conn = open_readonly(path)
    conn.close()


def preflight(settings: ServerSettings) -> TLSSetup:
    """Every check that can fail before listening: the database, then the TLS settings (this makes the
    self-signed certificate when one is needed). Raises IngeroError."""
    if settings.db_key is None:  # else read (so checked) already, in the caller's one open
        check_database(settings.db_path.expanduser())
    # bound (and kept) first: a busy port fails here, before the self-signed certificate is made or renewed
    sock = bind_socket(settings.host, settings.port, settings.backlog)
    try:
        return dataclasses.replace(prepare_tls(settings), sock=sock)
    except BaseException:
        sock.close()
        raise


def database_instance(path: Path, node: str) -> str:
    """The instance id this agent sends with its answers (see :mod:`ingero.store.instance`)."""
    conn = open_readonly(path)
    try:
        return agent_instance(conn, path, node)
    finally:
        conn.close()


def build_app(settings: ServerSettings, tls_mode: str) -> AgentAPI:
    from ingero.explain import memory_policy
    from ingero.explain.hugepages import prefer_small_pages

    prefer_small_pages()  # process-wide choices: no huge-page hint for numpy's large arrays; the C heap
    memory_policy.long_lived()  # keeps freed memory and gives it back after each heavy request
    node = settings.identity.node
    ctx = AgentContext(
        db_path=settings.db_path.expanduser(),
        instance=(
            instance_of(settings.db_key, node)
            if settings.db_key is not None
            else database_instance(settings.db_path.expanduser(), node)
        ),
        identity=settings.identity,
        tls_mode=tls_mode,
        token=settings.token or None,
        budget=settings.budget,
        workers=Admission(settings.admission),
    )
    return AgentAPI(ctx)


async def serve_api(
    settings: ServerSettings,
    *,
    tls_setup: TLSSetup | None = None,
    app_wrapper: Callable[[ASGIApp], ASGIApp] | None = None,
    sock: socket.socket | None = None,
    task_status: trio.TaskStatus[BoundServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled. Raises IngeroError (before ``started``) on bad settings. ``tls_setup``:
    what the caller's own :func:`preflight` returned (then it is not run again). ``app_wrapper`` puts
    routes in front of the agent's endpoints: the node's server is composed at the edge (``ingero serve``
    and ``trace --listen`` mount the tools API with :func:`ingero.tools.http.node_tools`), so the agent
    imports nothing above it. ``sock``: a listening socket the caller bound early (``trace --listen``
    binds before attaching probes); else :func:`preflight`'s."""
    if sock is not None and tls_setup is None:
        tls_setup = prepare_tls(settings)
    setup = tls_setup if tls_setup is not None else preflight(settings)
    sock = sock or setup.sock or bind_socket(settings.host, settings.port, settings.backlog)
    try:
        app: ASGIApp = build_app(settings, setup.mode)
        if app_wrapper is not None:
            app = app_wrapper(app)
        host, port = sock.getsockname()[:2]
        shown = settings.host.strip("[]") or host
        bound = BoundServer(
            host=shown,
            port=port,
            url=_url("https" if setup.context else "http", shown, port),
            tls_mode=setup.mode,
            fingerprint_sha256=setup.fingerprint,
        )
        await serve_on_socket(app, sock, setup.context, bound, task_status=task_status)
    finally:
        sock.close()


async def serve_on_socket(
    app: ASGIApp,
    sock: socket.socket,
    ssl_context: ssl.SSLContext | None,
    bound: BoundServer,
    *,
    read_timeout: int | Literal["default"] | None = "default",
    task_status: trio.TaskStatus[BoundServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio worker serving ``app`` on a socket bound by the caller (TLS when ``ssl_context``)
    until cancelled; ``task_status.started(bound)`` once it accepts. Every ingero server listens this way."""
    hypercorn_h2.install()  # request data after the answer must not end the server (see the module)
    config = _HypercornConfig(ssl_context)
    if read_timeout != "default":
        config.read_timeout = read_timeout
    sockets = Sockets(
        secure_sockets=[sock] if ssl_context else [],
        insecure_sockets=[] if ssl_context else [sock],
        quic_sockets=[],
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(worker_serve, wrap_app(cast(Any, app), config.wsgi_max_body_size, "asgi"), config, sockets=sockets)
        )
        task_status.started(bound)
