"""``ingero mcp``: serve the tool registry over the Model Context Protocol (stdio, or Streamable HTTP)."""

from __future__ import annotations

import argparse

from ingero.cli import common

DEFAULT_HTTP_PORT = 8471

EXAMPLES = """\
examples:
  ingero mcp --db cluster.db                               local tools on one database (stdio)
  ingero mcp --db trace.db --config ~/.config/ingero/ingero.yaml   plus the fleet tools over fleet.nodes
  ingero mcp --config configs/ingero.yaml                  fleet tools only
  ingero mcp --db trace.db --http :8471 --token-file ~/.ingero/token
                                                           Streamable HTTP on https://127.0.0.1:8471/mcp
  ingero mcp --db trace.db --http 0.0.0.0:8471 --tls-cert c.pem --tls-key k.pem --client-ca ca.pem   mTLS

Claude Desktop / any MCP client (stdio):
  {"mcpServers": {"ingero": {"command": "ingero", "args": ["mcp", "--db", "/data/cluster.db"]}}}

Tools (read-only; the same on MCP, the agent's /api/v1/tools and the dashboard): get_trace_stats,
get_causal_chains, run_sql, get_stacks, processes, event_history (on --db), get_check, run_demo (this
host), query_fleet, fleet_status, find_outlier_nodes, get_cost (over fleet.nodes or --nodes). Prompt:
investigate(symptom, since). On stdio the protocol speaks on stdout; diagnostics go to stderr.
Over HTTP: TLS 1.3 (self-signed certificate unless --tls-cert), a bearer token (--token-file, $INGERO_TOKEN)
and/or mutual TLS (--client-ca); listening beyond loopback needs one of them.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mcp",
        parents=parents,
        help="MCP server (stdio or HTTPS) so an AI assistant can query traces and the fleet",
        description="Serve ingero's read-only tools over the Model Context Protocol (stdio or Streamable HTTP).",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p, help_extra=" for the local tools (with fleet nodes: optional)")
    common.add_fleet_args(p)
    add_https_args(p, "--http", "serve Streamable HTTP on HOST:PORT (':8471' is loopback) instead of stdio")
    p.set_defaults(func=run)


def add_https_args(p: argparse.ArgumentParser, flag: str, helptext: str) -> None:
    """The listen / TLS / token flags of ``ingero mcp --http`` and ``ingero dashboard``."""
    g = p.add_argument_group("https")
    g.add_argument(flag, dest="listen", metavar="HOST:PORT", help=helptext)
    g.add_argument("--tls-cert", metavar="PEM", help="server certificate (default: self-signed, made once)")
    g.add_argument("--tls-key", metavar="PEM", help="its private key")
    g.add_argument("--client-ca", metavar="PEM", help="require client certificates signed by this CA (mutual TLS)")
    g.add_argument(
        "--token-file", metavar="PATH", help="require the bearer token held in this file (default: $INGERO_TOKEN)"
    )
    g.add_argument("--tls-dir", metavar="DIR", help="where the self-signed certificate lives (default ~/.ingero/tls)")
    g.add_argument("--no-tls", action="store_true", help="plain HTTP on loopback (tests, local tinkering)")


def listen_from(args: argparse.Namespace, default_port: int) -> object:
    """A :class:`ingero.agent.api.https.Listen` from the https flags (refuses unauthenticated remote serving
    before it imports any server code: a refusal is quick)."""
    from pathlib import Path

    from ingero.cli.serve import bearer_token, parse_listen
    from ingero.config import is_loopback
    from ingero.errors import UsageError

    text = args.listen or f"127.0.0.1:{default_port}"
    host, port = parse_listen(f"127.0.0.1{text}" if text.startswith(":") else text)
    token = bearer_token(args.token_file)  # --token-file, else $INGERO_TOKEN (--token is the fleet's)
    if not is_loopback(host) and not token and not args.client_ca:
        raise UsageError(
            f"refusing to serve {host}:{port} without authentication", hint="add --token-file or --client-ca"
        )
    from ingero.agent.api.https import Listen

    def path(v: str | None) -> Path | None:
        return Path(v).expanduser() if v else None

    return Listen(
        host=host,
        port=port,
        tls_cert=path(args.tls_cert),
        tls_key=path(args.tls_key),
        client_ca=path(args.client_ca),
        token=token,
        no_tls=bool(args.no_tls),
        tls_dir=path(args.tls_dir),
    )


def settings_from(args: argparse.Namespace) -> object:
    """The tools' environment (database + fleet) shared by ``ingero mcp`` and ``ingero dashboard``; its
    refusals come before the server's imports."""

    from pathlib import Path

    from ingero.cli.fleet_cmds import settings_from_args
    from ingero.errors import UsageError
    from ingero.store.db import open_readonly

    cfg = common.config_from(args)
    nodes = common.fleet_nodes_from(args)
    # the one database rule (--db > $INGERO_DB > agent.db > the default); the default only when it exists
    default = common.db_path_from(args)
    db: Path | None = None if not common.configured_db(args) and (nodes or not default.exists()) else default
    if db is not None:
        open_readonly(db).close()  # a wrong --db fails now, in one line, not at the first tool call
    if db is None and not nodes:
        raise UsageError(
            "nothing to serve: no database and no fleet nodes",
            hint=f"pass --db PATH (there is no {common.DEFAULT_DB}), or a --config with fleet.nodes (or --nodes)",
        )
    fleet = settings_from_args(args)
    from ingero.mcp.server import McpSettings

    return McpSettings(db=db, nodes=nodes, fleet=fleet, rates=cfg.fleet.gpu_hourly_usd)


def run(args: argparse.Namespace) -> int:
    listen = None if args.listen is None else listen_from(args, DEFAULT_HTTP_PORT)  # its refusals come first
    settings = settings_from(args)

    from ingero.mcp.server import McpSettings, run_stdio

    assert isinstance(settings, McpSettings)
    if listen is None:
        _exit_on_ctrl_c()
        run_stdio(settings)
        return 0
    return _run_http(listen, settings)


def _exit_on_ctrl_c() -> None:
    """Ctrl-C on the stdio server: one line and exit 130 at once. The server waits for stdin in a worker
    thread that no cancellation reaches, so trio's deferred KeyboardInterrupt would wait for the next
    request; there is nothing to clean up (the database is read-only, nothing is half written)."""
    import os
    import signal
    import sys
    from types import FrameType

    def stop(signum: int, frame: FrameType | None) -> None:
        sys.stderr.write("ingero: interrupted (Ctrl-C)\n")
        sys.stderr.flush()
        os._exit(130)

    signal.signal(signal.SIGINT, stop)


def _run_http(listen: object, settings: object) -> int:
    import sys

    import trio

    from ingero.agent.api.https import Listen
    from ingero.mcp.server import McpSettings, serve_http

    assert isinstance(listen, Listen) and isinstance(settings, McpSettings)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_http, settings, listen)
            fp = f" (certificate sha256 {bound.fingerprint_sha256})" if bound.fingerprint_sha256 else ""
            print(f"ingero mcp: listening on {bound.url} [{bound.tls_mode}]{fp}", file=sys.stderr, flush=True)

    trio.run(main)  # Ctrl-C: ingero.cli.main says so in one line and exits 130
    return 0
