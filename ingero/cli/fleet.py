"""``ingero fleet status`` (one row per node — reachable, identity, version, RTT, clock skew, data, shipping, TLS),
``ingero fleet stragglers`` (which rank drags the job, from aligned NCCL collectives) and ``ingero fleet
cost`` (what the waiting for it costs)."""

from __future__ import annotations

import argparse
from typing import Any

from ingero.cli import common
from ingero.cli.clickhouse import add_clickhouse_arg
from ingero.cli.output import add_output_args, emit_json, emit_rows, note
from ingero.errors import UsageError

EXAMPLES = """\
examples:
  ingero fleet status --nodes gpu-node-01:8080,gpu-node-02:8080 --ca-cert ca.pem \\
      --client-cert client.pem --client-key client.key
  ingero fleet status --config ~/.config/ingero/ingero.yaml      nodes and TLS from the config
  ingero fleet status --json                                      for machines (fleet.nodes from the config)
  ingero fleet status --strict --timeout 2s && echo "all nodes up"
  ingero fleet status --samples 10 --sample-interval 0.5s          drift (ppm) of every node's clock too

Columns: reachable (or why not), node (the agent's own name), addr, rank (rank/world_size), version,
rtt_ms (lowest /time round trip), skew (agent clock minus this host's, ± its uncertainty; "(outlier)"
when it stands out from the fleet's median by MAD), drift_ppm (how much faster the agent's clock runs,
± its 95 % interval; with --samples 3 or more), events, first/last (time range of the recording),
shipping (to ClickHouse: "caught up" or how many rows and seconds behind; empty when never shipped),
tls (tls, mtls or plaintext; +token when a token is required).
A warning names every node whose clock is off by more than fleet.skew_threshold (10 ms).
"""

STRAGGLER_EXAMPLES = """\
examples:
  ingero fleet stragglers --since 10m                     the verdict, the per-rank table, the cost
  ingero fleet stragglers --json | jq .headline           for scripts (per-rank table under "ranks")
  ingero fleet stragglers --metric wait --threshold 5     outliers by median absolute deviation
  ingero fleet stragglers --comm 9f3a5c0e12d4b871         one communicator

Every agent's NCCL calls are joined per communicator (the k-th call of each), entry times corrected by
each node's measured clock offset. Verdicts: straggler (one rank arrives last: its median lag and the
share of time the others waited), inconclusive (the lag is within the clock uncertainty), the
collective itself slow (network/NVLink: bytes and bandwidth), a hung rank, or no straggler. Without
collectives the per-node host/latency verdict is shown. Columns: node, rank, comm, calls, last (calls
it arrived last), last_pct, lag_ms (median lag when last), wait_s, wait_pct, clock_ms (± uncertainty),
outlier (by --metric: lag, last or wait). Exit status 0 (5 with --strict when a node failed).
"""

COST_EXAMPLES = """\
examples:
  ingero fleet cost --since 1h                 dollars the waiting ranks burned (fleet.gpu_hourly_usd)
  ingero fleet cost --usd-per-gpu-hour 2.5     a rate for every GPU, whatever the config says
  ingero fleet cost --json

fleet.gpu_hourly_usd in the config: a number, or {default: 2.5, models: {H100: 4.0}, nodes: {gpu-node-03: 5}}
(node wins over GPU model, which wins over default). Columns: node, rank, gpu_model, wait_s, usd_per_gpu_hour,
usd. Ranks without a rate are listed without dollars.
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
    s.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help="clock samples per node (default 2: the /info answer's and one /time); 3 or more give drift in ppm",
    )
    s.add_argument(
        "--sample-interval",
        metavar="DUR",
        default="200ms",
        help="time between the extra samples (default 200ms; longer spans give tighter drift)",
    )
    add_output_args(s)
    s.set_defaults(func=run_status)

    st = fsub.add_parser(
        "stragglers",
        parents=parents,
        help="which rank drags the job: NCCL collectives aligned across nodes, lag, waiting and its cost",
        description="Join every node's NCCL calls (the k-th call of each communicator), correct entry times "
        "for clock skew, and name the rank that arrives last — with its lag, the others' waiting and its cost.",
        epilog=STRAGGLER_EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    _collective_args(st)
    st.add_argument("--metric", choices=("lag", "last", "wait"), default="lag", help="outlier metric (default lag)")
    st.add_argument("--threshold", type=float, default=3.5, metavar="Z", help="robust z-score for outliers (3.5)")
    add_clickhouse_arg(st, "align the collectives stored in the fleet's history in ClickHouse")
    st.set_defaults(func=run_stragglers)

    c = fsub.add_parser(
        "cost",
        parents=parents,
        help="dollars of GPU time the ranks burned waiting for peers in collectives",
        description="Price each rank's waiting inside NCCL collectives at its GPU-hour rate (fleet.gpu_hourly_usd).",
        epilog=COST_EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    _collective_args(c)
    c.add_argument(
        "--usd-per-gpu-hour", type=float, metavar="USD", help="one rate for every GPU (overrides the config)"
    )
    c.set_defaults(func=run_cost)


def _collective_args(p: argparse.ArgumentParser) -> None:
    common.add_window_args(p)
    p.add_argument("--comm", metavar="ID", help="one communicator (its 16-hex-digit id)")
    common.add_fleet_args(p)
    add_output_args(p)


def _no_subcommand(args: argparse.Namespace) -> int:
    args._fleet_parser.print_help()
    return 2


def run_status(args: argparse.Namespace) -> int:
    from ingero.cli import fleet_cmds
    from ingero.fleet.operations import status_sync
    from ingero.timeutil import NS_PER_S, parse_duration

    if args.samples is not None and args.samples < 1:
        raise UsageError(f"--samples {args.samples}: must be at least 1")
    interval_ns = parse_duration(args.sample_interval)
    if interval_ns <= 0:
        raise UsageError(f"--sample-interval {args.sample_interval}: must be positive")
    nodes = fleet_cmds.nodes_from(args)
    settings = fleet_cmds.settings_from_args(args)
    progress = fleet_cmds.progress_for(nodes)
    try:
        status = status_sync(
            nodes, settings, samples=args.samples, interval_s=interval_ns / NS_PER_S, on_outcome=progress
        )
    finally:
        progress.clear()
    if args.format == "json":
        emit_json(status.as_dict())
    else:
        emit_rows(status.columns, status.rows(), args.format)
    if args.format == "table":
        note(f"{len(status.answered)} of {len(status.outcomes)} node(s) reachable in {status.elapsed_ms:.0f} ms")
    return fleet_cmds.report(status.outcomes, settings, strict=bool(args.strict), what="answer /api/v1/info")


def _stragglers(args: argparse.Namespace, *, with_chain: bool) -> tuple[Any, Any]:
    from ingero.cli import fleet_cmds
    from ingero.config import GpuRates
    from ingero.fleet.collective_ops import stragglers_sync

    nodes = fleet_cmds.nodes_from(args)
    settings = fleet_cmds.settings_from_args(args)
    rates = common.config_from(args).fleet.gpu_hourly_usd
    usd = getattr(args, "usd_per_gpu_hour", None)
    if usd is not None:
        if usd < 0:
            raise UsageError(f"--usd-per-gpu-hour {usd}: must be at least 0")
        rates = GpuRates(default=usd)
    progress = fleet_cmds.progress_for(nodes)
    try:
        report = stragglers_sync(
            nodes,
            settings,
            since=args.since,
            from_=args.from_,
            to=args.to,
            comm=args.comm,
            rates=rates,
            with_chain=with_chain,
            on_outcome=progress,
        )
    finally:
        progress.clear()
    return report, settings


def run_stragglers(args: argparse.Namespace) -> int:
    from ingero.cli import fleet_cmds
    from ingero.fleet.outliers import outlier_ranks

    if getattr(args, "clickhouse", None):
        from ingero.cli.clickhouse import store_stragglers

        report, settings = store_stragglers(args), None
    else:
        report, settings = _stragglers(args, with_chain=True)
    cv = report.collectives
    ranks = cv.ranks if cv is not None else []
    try:
        outliers = outlier_ranks(ranks, args.metric, args.threshold)
    except ValueError as e:
        raise UsageError(str(e)) from None
    flagged = {(o.row.node, o.row.comm, o.row.rank) for o in outliers}
    if args.format == "json":
        doc = report.as_dict()
        doc["outliers"] = {"metric": args.metric, "threshold": args.threshold, "ranks": [o.as_dict() for o in outliers]}
        emit_json(doc)
    else:
        if ranks:
            rows = [
                [
                    r.node,
                    r.rank,
                    r.comm,
                    r.calls,
                    r.last,
                    round(100 * r.last_share, 1),
                    round(r.median_lag_ms, 3),
                    round(r.wait_s, 3),
                    round(100 * r.wait_share, 2),
                    round(r.uncertainty_ms, 3),
                    "yes" if (r.node, r.comm, r.rank) in flagged else "",
                ]
                for r in ranks
            ]
            emit_rows(RANK_COLUMNS, rows, args.format)
        if args.format == "table":
            print(report.headline())
            if cv is None:
                note("no NCCL collectives in the window: the verdict comes from per-node host and latency figures")
            if report.cost.ranks:
                print(report.cost.line())
            if report.chain:
                print(_chain_text(report.chain))
            for node in report.truncated:
                note(f"{node}: its answer hit the call cap; ask for a shorter window (--since)")
    if settings is None:
        return 0
    return fleet_cmds.report(report.outcomes, settings, strict=bool(args.strict), what="answer /api/v1/collectives")


RANK_COLUMNS = [
    "node",
    "rank",
    "comm",
    "calls",
    "last",
    "last_pct",
    "lag_ms",
    "wait_s",
    "wait_pct",
    "clock_ms",
    "outlier",
]
COST_COLUMNS = ["node", "rank", "gpu_model", "wait_s", "usd_per_gpu_hour", "usd"]


def run_cost(args: argparse.Namespace) -> int:
    from ingero.cli import fleet_cmds

    report, settings = _stragglers(args, with_chain=False)
    cost = report.cost
    if args.format == "json":
        emit_json({"headline": report.headline(), **cost.as_dict()})
    else:
        rows = [
            [
                r.node,
                r.rank,
                r.gpu_model,
                round(r.wait_s, 3),
                r.usd_per_hour,
                None if r.usd is None else round(r.usd, 2),
            ]
            for r in cost.ranks
        ]
        emit_rows(COST_COLUMNS, rows, args.format)
        if args.format == "table":
            print(cost.line())
            print(report.headline())
    return fleet_cmds.report(report.outcomes, settings, strict=bool(args.strict), what="answer /api/v1/collectives")


def _chain_text(chain: dict[str, Any]) -> str:
    from ingero.explain.model import Chain
    from ingero.explain.render import render_chains

    c = Chain.from_dict(chain)
    return f"top chain on {c.node or 'the straggler'}:\n" + render_chains([c], verbose=False).rstrip()
