"""Serving any ingero ASGI app besides the agent (MCP Streamable HTTP, the dashboard) over HTTPS: hypercorn's trio
worker on a socket we bind ourselves, TLS 1.3 only, mTLS when a client CA is given.

The socket, the hypercorn configuration and the SSL contexts are the agent's own
(:mod:`ingero.agent.api.server`, :mod:`ingero.tls.context`): one way to listen for every ingero server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ingero.agent.api.server import BoundServer, _url, bind_socket, serve_on_socket, server_cert
from ingero.config import is_loopback
from ingero.errors import UsageError
from ingero.tls import context


@dataclass(frozen=True)
class Listen:
    """Where and how to listen: address, TLS material (self-signed when none is given), auth."""

    host: str = "127.0.0.1"
    port: int = 0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    token: str | None = None
    no_tls: bool = False
    tls_dir: Path | None = None
    common_name: str = "ingero"
    backlog: int = 128

    @property
    def tls_mode(self) -> str:
        return "plaintext" if self.no_tls else ("mtls" if self.client_ca else "tls")


def ssl_context(listen: Listen) -> tuple[Any, str | None]:
    """(SSLContext or None for plaintext, certificate fingerprint)."""
    if listen.no_tls:
        if listen.tls_cert or listen.client_ca:
            raise UsageError("--no-tls conflicts with --tls-cert/--client-ca", hint="drop one of them")
        if not is_loopback(listen.host):
            raise UsageError(
                f"refusing plain HTTP on {listen.host}: tokens and traces would cross the network unencrypted",
                hint="listen on 127.0.0.1 or drop --no-tls",
            )
        return None, None
    cert, key, _ = server_cert(listen.tls_cert, listen.tls_key, listen.host, listen.tls_dir, listen.common_name)
    ctx = context.server_ssl_context(cert, key, listen.client_ca.expanduser() if listen.client_ca else None)
    return ctx, context.cert_fingerprint(cert)


async def serve_asgi(
    app: Any,
    listen: Listen,
    *,
    path: str = "/",
    task_status: trio.TaskStatus[BoundServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets the bound address (``url`` ends in ``path``)."""
    sock = bind_socket(listen.host, listen.port, listen.backlog)  # bound first: a busy port touches no certificate
    try:
        ctx, fingerprint = ssl_context(listen)
        host, port = sock.getsockname()[:2]
        shown = listen.host.strip("[]") or host
        bound = BoundServer(
            host=shown,
            port=port,
            url=_url("https" if ctx else "http", shown, port) + path,
            tls_mode=listen.tls_mode,
            fingerprint_sha256=fingerprint,
        )
        # an MCP stream or a dashboard refresh may stay open
        await serve_on_socket(app, sock, ctx, bound, read_timeout=None, task_status=task_status)
    finally:
        sock.close()
