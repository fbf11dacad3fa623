"""``ingero mcp``: serve the Model Context Protocol on stdio for AI assistants."""

from __future__ import annotations

import argparse

from ingero.cli import common

EXAMPLES = """\
examples:
  ingero mcp --db cluster.db                               local tools on one database
  ingero mcp --db trace.db --config ~/.config/ingero/ingero.yaml   plus query_fleet over fleet.nodes
  ingero mcp --config configs/ingero.yaml                  fleet only (query_fleet)

Claude Desktop / any MCP client (stdio):
  {"mcpServers": {"ingero": {"command": "ingero", "args": ["mcp", "--db", "/data/cluster.db"]}}}

Tools (read-only): overview, chains, sql, stacks, processes (on --db), query_fleet(action=chains|sql|ops|
overview|status, since, sql) over the config's fleet.nodes (or --nodes). Prompt: investigate(symptom,
since). The protocol speaks on stdout; diagnostics go to stderr.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mcp",
        parents=parents,
        help="MCP server (stdio) so an AI assistant can query traces and the fleet",
        description="Serve ingero's read-only tools over the Model Context Protocol (stdio transport).",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p, help_extra=" for the local tools (default: agent.db in the config)")
    common.add_fleet_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ingero.errors import UsageError
    from ingero.mcp.server import McpSettings, run_stdio
    from ingero.store.db import open_readonly

    cfg = common.config_from(args)
    raw_db = args.db or cfg.agent.db
    db = Path(raw_db).expanduser() if raw_db else None
    if db is not None:
        open_readonly(db).close()  # a wrong --db fails now, in one line, not at the first tool call
    nodes = common.fleet_nodes_from(args)
    if db is None and not nodes:
        raise UsageError(
            "nothing to serve: no database and no fleet nodes",
            hint="pass --db PATH, or a --config with fleet.nodes (or --nodes)",
        )
    from ingero.cli.fleet_cmds import settings_from_args

    run_stdio(McpSettings(db=db, nodes=nodes, fleet=settings_from_args(args)))
    return 0
