"""``ingero explain --nodes --by KEY``: every agent computes its by-label ledger over its own data
(:mod:`ingero.fleet.labels`); this prints one line per node and value. (``--annotation`` and
``--annotations`` ride on the fleet explain: :func:`ingero.cli.fleet_cmds.run_explain`.)"""

from __future__ import annotations

import argparse

from ingero.cli import fleet_cmds
from ingero.cli.output import emit_json, note


def run_by(args: argparse.Namespace) -> int:
    """``explain --by KEY --nodes ...``: one line per node and value, the node first."""
    from ingero.errors import UsageError
    from ingero.fleet.labels import by_label_sync, render_by
    from ingero.fleet.operations import window_params

    if getattr(args, "pid", None) is not None:
        raise UsageError("--pid works on a local --db only", hint="drop --pid, or explain one node's database")
    nodes = fleet_cmds.nodes_from(args)
    settings = fleet_cmds.settings_from_args(args)
    progress = fleet_cmds.progress_for(nodes)
    try:
        fleet = by_label_sync(
            nodes,
            settings,
            args.by,
            params=window_params(args.since, args.from_, args.to),
            node=args.node,
            on_outcome=progress,
        )
    finally:
        progress.clear()
    if args.node is not None and fleet.answered and args.node not in fleet.by:
        raise UsageError(
            f"no node {args.node!r} answered", hint="nodes: " + ", ".join(sorted(o.label for o in fleet.answered))
        )
    if args.format == "json":
        emit_json(fleet.as_dict())
    elif fleet.answered:
        print(render_by(fleet), end="")
        note(f"by {args.by} from {len(fleet.answered)} node(s) in {fleet.elapsed_ms:.0f} ms")
    return fleet_cmds.report(fleet.outcomes, settings, strict=bool(args.strict))
