"""``ingero demo``: synthetic GPU incidents written to a real trace database, then explained."""

from __future__ import annotations

import argparse

from ingero.cli import common
from ingero.cli.output import add_output_args, emit_json, note

EXAMPLES = """\
examples:
  ingero demo                                   list the scenarios
  ingero demo incident                          CPU spike + sched_switch storm → HIGH chain, fix: taskset
  ingero demo cold-start                        first CUDA calls 50-200x slower after each process start
  ingero demo memcpy-bottleneck --json          the report as JSON
  ingero demo periodic-spike --db spikes.db     keep the database, then: ingero query --db spikes.db "..."
  ingero demo gpu-steal --speed 10              play the 30 s trace back live, 10x faster than real time
  ingero demo cpu-contention --per-process      chains per GPU process

Scenarios are synthetic (no GPU, no root needed: --no-gpu is the default): a seeded generator writes
events through the same writer the tracer uses, into a temporary database (or --db PATH), then
'ingero explain' runs on it and its chains are stored in the database. --speed X plays the trace back
X times faster than real time as a live recording (default: max, written at once).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        parents=parents,
        help="synthetic GPU incidents: write a real trace database and explain it",
        description="Run a synthetic scenario (a classic GPU incident) end to end: generate the trace, "
        "write it to a real database, run the explain engine, print the causal chains.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.add_argument("scenario", nargs="?", help="scenario name (omit to list them)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--no-gpu", dest="gpu", action="store_false", help="synthetic events, no GPU needed (the default)")
    gpu.add_argument("--gpu", dest="gpu", action="store_true", help="ask for a run on a real GPU (needs one)")
    p.set_defaults(gpu=False)
    p.add_argument(
        "--speed",
        metavar="X",
        default="max",
        help="playback speed: X times real time as a live recording (e.g. 1, 10), or 'max' (default: at once)",
    )
    p.add_argument("--db", metavar="PATH", help="keep the database here (default: a temporary file, removed)")
    p.add_argument("--seed", type=int, default=7, metavar="N", help="random seed (default 7)")
    p.add_argument("--per-process", action="store_true", help="explain per GPU process")
    add_output_args(p, csv_ok=False)
    p.set_defaults(func=run)


def _speed(text: str) -> float | None:
    from ingero.errors import UsageError

    if text.strip().lower() in ("max", "0", "inf"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--speed {text!r}: not a number", hint="use e.g. --speed 10, or --speed max") from None
    if not 0 < value < float("inf"):
        raise UsageError(f"--speed {text}: must be a positive number", hint="use e.g. --speed 10, or --speed max")
    return value


def _list(fmt: str) -> int:
    from ingero.demo.scenarios import SCENARIOS
    from ingero.texttable import render_table

    if fmt == "json":
        emit_json(
            {
                "scenarios": [
                    {"name": s.name, "title": s.title, "story": s.story, "expect": s.expect, "seconds": s.seconds}
                    for s in SCENARIOS.values()
                ]
            }
        )
        return 0
    print(render_table(["scenario", "what it shows"], [[s.name, s.title] for s in SCENARIOS.values()]))
    print("\nrun one: ingero demo incident   (details: ingero demo --help)")
    return 0


def _gpu_present() -> str | None:
    """A line describing the GPU if one is usable here, else None."""
    import ctypes
    from pathlib import Path

    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return None
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return "an NVIDIA GPU (/dev/nvidia*, libcuda.so.1)"


def run(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from ingero.errors import TracingUnavailableError, UsageError

    speed = _speed(args.speed)
    if not args.scenario:
        return _list(args.format)
    from ingero.demo.runner import get_scenario, run_scenario

    sc = get_scenario(args.scenario)
    if args.gpu:
        found = _gpu_present()
        if found is None:
            raise TracingUnavailableError(
                "no GPU on this machine: no /dev/nvidia* device and no loadable libcuda.so.1",
                hint=f"run the synthetic scenario instead: ingero demo {sc.name} (--no-gpu is the default)",
            )
        raise UsageError(
            f"--gpu: found {found}, but demo scenarios are synthetic only",
            hint="trace a real workload with: sudo ingero trace --db t.db, then ingero explain --db t.db",
        )
    if args.per_process and speed is not None:
        pass  # both are fine together; --per-process only changes the explain step
    with tempfile.TemporaryDirectory(prefix="ingero-demo-") as tmp:
        db = Path(args.db).expanduser() if args.db else Path(tmp) / f"{sc.name}.db"
        if args.format != "json":
            note(f"demo {sc.name}: {sc.story} (synthetic, no GPU)")
        run = run_scenario(sc.name, db, speed=speed, seed=args.seed, progress=note if args.format != "json" else None)
        report = run.report
        if args.per_process:
            from ingero.explain.engine import explain
            from ingero.store.db import open_readonly

            conn = open_readonly(db)
            try:
                report = explain(conn, per_process=True)
            finally:
                conn.close()
        kept = str(db) if args.db else None
        if args.format == "json":
            emit_json(
                {
                    "scenario": sc.name,
                    "title": sc.title,
                    "expect": sc.expect,
                    "db": kept,
                    "events": run.events,
                    **report.as_dict(),
                }
            )
            return 0
        from ingero.explain.render import render_report

        print(render_report(report, source=f"demo {sc.name}"), end="")
        note(f"expected: {sc.expect}")
        if kept:
            note(f"database kept: {kept} (try: ingero explain --db {kept} --chains)")
        else:
            note("database removed (keep it with --db PATH)")
    return 0
