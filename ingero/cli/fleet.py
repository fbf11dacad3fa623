"""``ingero fleet status``: one row per node — reachable, identity, version, RTT, clock skew, data, TLS."""

from __future__ import annotations

import argparse

from ingero.cli import common
from ingero.cli.output import add_output_args, emit_json, emit_rows, note

EXAMPLES = """\
examples:
  ingero fleet status --nodes gpu-node-01:8080,gpu-node-02:8080 --ca-cert ca.pem \\
      --client-cert client.pem --client-key client.key
  ingero fleet status --config ~/.config/ingero/ingero.yaml      nodes and TLS from the config
  ingero fleet status --json                                      for machines (fleet.nodes from the config)
  ingero fleet status --strict --timeout 2s && echo "all nodes up"

Columns: reachable (or why not), node (the agent's own name), addr, rank (rank/world_size), version,
rtt_ms (lowest /time round trip), skew (agent clock minus this host's, ± its uncertainty), events,
first/last (time range of the recording), tls (tls, mtls or plaintext; +token when a token is required).
A warning names every node whose clock is off by more than fleet.skew_threshold (10 ms).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fleet",
        parents=parents,
        help="fleet overview: reachability, versions, clock skew of every node",
        description="Commands about the fleet as a whole.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.set_defaults(func=_no_subcommand, _fleet_parser=p)
    fsub = p.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND")
    s = fsub.add_parser(
        "status",
        parents=parents,
        help="one row per node: reachable, node, rank, version, RTT, skew, events, time range, TLS",
        description="Ask every agent for its identity and data, and estimate each node's clock skew "
        "(NTP four-timestamp method, lowest-delay sample of several).",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_fleet_args(s)
    add_output_args(s)
    s.set_defaults(func=run_status)


def _no_subcommand(args: argparse.Namespace) -> int:
    args._fleet_parser.print_help()
    return 2


def run_status(args: argparse.Namespace) -> int:
    from ingero.cli import fleet_cmds
    from ingero.fleet.operations import status_sync

    nodes = fleet_cmds.nodes_from(args)
    settings = fleet_cmds.settings_from_args(args)
    progress = fleet_cmds.progress_for(nodes)
    try:
        status = status_sync(nodes, settings, on_outcome=progress)
    finally:
        progress.clear()
    if args.format == "json":
        emit_json(status.as_dict())
    else:
        emit_rows(status.columns, status.rows(), args.format)
    if args.format == "table":
        note(f"{len(status.answered)} of {len(status.outcomes)} node(s) reachable in {status.elapsed_ms:.0f} ms")
    return fleet_cmds.report(status.outcomes, settings, strict=bool(args.strict), what="answer /api/v1/info")
