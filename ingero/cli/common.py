"""Argument groups shared by several commands, and the helpers that read them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ingero.config import Config, NodeSpec, load_config, parse_node_list
from ingero.errors import UsageError
from ingero.identity import Identity, resolve_identity

if TYPE_CHECKING:
    from ingero.store.window import Window

DEFAULT_DB = "~/.ingero/ingero.db"
DB_ENV = "INGERO_DB"  # the database every command uses when --db is not given (before the config's agent.db)


def help_formatter() -> type[argparse.HelpFormatter]:
    return argparse.RawDescriptionHelpFormatter


def add_db_arg(parser: argparse.ArgumentParser, *, help_extra: str = "") -> None:
    parser.add_argument(
        "--db",
        metavar="PATH",
        help=f"trace database (SQLite, ingero or Ingero layout; default: ${DB_ENV}, else agent.db in the config, "
        f"else {DEFAULT_DB})" + help_extra,
    )


def add_window_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("time window")
    g.add_argument(
        "--since",
        metavar="DUR",
        help="last DUR (30s, 5m, 2h); on a finished recording, counted back from its last event",
    )
    g.add_argument("--from", dest="from_", metavar="TIME", help="start (ISO 8601 or Unix seconds)")
    g.add_argument("--to", metavar="TIME", help="end (ISO 8601 or Unix seconds)")


def add_node_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node",
        metavar="NAME",
        help="this node's name (default: agent.node in the config; for serve, the node recorded in the database; "
        "else the hostname)",
    )


def add_fleet_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fleet (fan-out to agents)")
    g.add_argument(
        "--nodes",
        metavar="LIST",
        help="agents to ask: host:port,host:port (or name=host:port); default: fleet.nodes in config",
    )
    g.add_argument("--timeout", metavar="DUR", help="per-node timeout (default 5s)")
    g.add_argument("--fanout", type=int, metavar="N", help="nodes asked at once (default 64)")
    g.add_argument("--strict", action="store_true", help="exit non-zero if any node fails")
    g.add_argument("--token", metavar="TOKEN", help="bearer token (default: fleet.token or $INGERO_TOKEN)")
    g.add_argument("--ca-cert", metavar="PEM", help="CA that signed the agents' certificates")
    g.add_argument("--client-cert", metavar="PEM", help="client certificate for mTLS")
    g.add_argument("--client-key", metavar="PEM", help="client key for mTLS")
    g.add_argument(
        "--plaintext",
        action="store_true",
        help="talk plain HTTP (agents started with --no-tls; loopback only unless --allow-plaintext-remote)",
    )
    g.add_argument(
        "--allow-plaintext-remote",
        action="store_true",
        help="permit plain HTTP to non-loopback agents (unencrypted, unauthenticated)",
    )


def config_from(args: argparse.Namespace) -> Config:
    """Load the config named by --config (wherever it was given) or found by discovery."""
    cached = getattr(args, "_config", None)
    if isinstance(cached, Config):
        return cached
    cfg = load_config(getattr(args, "config", None))
    args._config = cfg
    return cfg


def identity_from(args: argparse.Namespace, recorded: Callable[[], str | None] | None = None) -> Identity:
    """This agent's identity; ``recorded``: the node a served recording was made on (read only when neither
    --node nor agent.node names the agent)."""
    cfg = config_from(args)
    cli_node, config_node = getattr(args, "node", None), cfg.agent.node
    name = recorded() if recorded is not None and not (cli_node or config_node) else None
    return resolve_identity(cli_node, config_node, recorded=name)


def fleet_nodes_from(args: argparse.Namespace) -> list[NodeSpec]:
    """Nodes from --nodes, else fleet.nodes in the config; [] when neither."""
    if getattr(args, "nodes", None):
        return parse_node_list(args.nodes)
    return list(config_from(args).fleet.nodes)


def configured_db(args: argparse.Namespace) -> str | None:
    """The database named by --db, else ``$INGERO_DB``, else agent.db in the config; None when none is."""
    return getattr(args, "db", None) or os.environ.get(DB_ENV) or config_from(args).agent.db or None


def db_path_from(args: argparse.Namespace) -> Path:
    """The one database rule of every command: --db > ``$INGERO_DB`` > agent.db in the config > DEFAULT_DB."""
    return Path(configured_db(args) or DEFAULT_DB).expanduser()


def window_from_args(args: argparse.Namespace, path: Path) -> Window | None:
    """The --since/--from/--to window against the database at ``path`` (None when no flag is given).

    On a finished recording ``--since`` counts back from its last event; that is said on stderr.
    """
    if not (args.since or args.from_ or args.to):
        return None
    from ingero.cli.output import note
    from ingero.store.db import open_readonly
    from ingero.store.window import resolve_window

    conn = open_readonly(path)
    try:
        window = resolve_window(conn, args.since, args.from_, args.to)
    finally:
        conn.close()
    if window.note:
        note(window.note)
    return window


def wants_fleet(args: argparse.Namespace) -> bool:
    """Fleet mode: --nodes given, or no --db and the config lists fleet nodes."""
    if getattr(args, "nodes", None):
        if getattr(args, "db", None):
            raise UsageError("--db and --nodes both given", hint="--db reads a local file; --nodes asks agents")
        return True
    if getattr(args, "db", None):
        return False
    cfg = config_from(args)
    return bool(cfg.fleet.nodes) and not cfg.agent.db and not os.environ.get(DB_ENV)
