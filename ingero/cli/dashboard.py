"""``ingero dashboard``: the HTTPS browser view of one database or a whole fleet."""

from __future__ import annotations

import argparse

from ingero.cli import common
from ingero.cli.mcp import add_https_args, listen_from, settings_from

DEFAULT_PORT = 8470

EXAMPLES = """\
examples:
  ingero dashboard --config configs/ingero.yaml            the fleet in fleet.nodes, https://127.0.0.1:8470/
  ingero dashboard --nodes a:8443,b:8443 --ca-cert ca.pem --client-cert me.pem --client-key me-key.pem
  ingero dashboard --db cluster.db                          one database (a merged cluster works too)
  INGERO_TOKEN=s3cret ingero dashboard --db trace.db --listen 0.0.0.0:8470 --tls-cert c.pem --tls-key k.pem

The page shows the nodes (reachability, rank, version, clock skew ±, events) and the straggler verdict,
per-op latency (p50/p95/p99, refreshed live), causal chains with their evidence, a zoomable timeline of
ops and host events per node, and a read-only SQL box. It reads only through the tools API
(/api/v1/tools/<name>) it serves on the same port. TLS 1.3 always (a self-signed certificate unless
--tls-cert); with a token (--token-file or $INGERO_TOKEN) a login page asks for it and keeps a session
cookie (Secure, HttpOnly, SameSite=Strict); with --client-ca browsers need a client certificate.
Listening beyond loopback needs a token or --client-ca.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "dashboard",
        parents=parents,
        help="HTTPS browser dashboard for one database or the fleet",
        description="Serve a browser dashboard (HTTPS, TLS 1.3) over the tool registry.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p, help_extra=" to show (with fleet nodes: optional)")
    common.add_fleet_args(p)
    add_https_args(p, "--listen", f"address to serve on (default 127.0.0.1:{DEFAULT_PORT}; port 0 picks one)")
    p.add_argument("--ready-file", metavar="PATH", help="write the URL as JSON here once listening (scripts)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    listen = listen_from(args, DEFAULT_PORT)  # the refusals come first, before the server's imports
    settings = settings_from(args)

    import json
    import os
    import sys

    import trio

    from ingero.agent.api.https import Listen
    from ingero.dashboard.app import DashboardSettings, serve_dashboard
    from ingero.mcp.server import McpSettings

    assert isinstance(settings, McpSettings) and isinstance(listen, Listen)
    dash = DashboardSettings(env=settings.env(), token=listen.token, mtls=listen.client_ca is not None)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_dashboard, dash, listen)
            if args.ready_file:  # written before the line that says so
                doc = {"url": bound.url, "port": bound.port, "fingerprint_sha256": bound.fingerprint_sha256}
                doc["pid"] = os.getpid()  # whose file it is: removed on the way out by this process only
                await trio.Path(args.ready_file).write_text(json.dumps(doc))
            fp = f" (certificate sha256 {bound.fingerprint_sha256})" if bound.fingerprint_sha256 else ""
            login = "; log in with the token" if listen.token else ""
            print(f"ingero dashboard: listening on {bound.url}{fp}{login}", file=sys.stderr, flush=True)

    try:
        trio.run(main)  # Ctrl-C: ingero.cli.main says so in one line and exits 130
    finally:
        if args.ready_file:  # a ready file names a running dashboard only
            from pathlib import Path

            from ingero.cli.serve import remove_ready_file

            remove_ready_file(Path(args.ready_file).expanduser())
    return 0
