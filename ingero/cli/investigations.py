"""``ingero investigations``: regenerate the sample databases in investigations/ (deterministic)."""

from __future__ import annotations

import argparse
from typing import Any

from ingero.cli import common
from ingero.cli.output import add_output_args, emit_json, note

EXAMPLES = """\
examples:
  ingero investigations --out investigations     regenerate the committed sample databases
  ingero investigations --out /tmp/inv --json    somewhere else; list what was written as JSON
  ingero explain --db investigations/sample-cluster.db          then explain them
  ingero query --db investigations/sample-cluster.db "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"

Writes sample-gpu-node-01.db (the straggler: CPU contention + checkpoint I/O), sample-gpu-node-02.db,
sample-gpu-node-03.db (healthy peers) and sample-cluster.db (the three in one file). The output is the
same on every run (fixed seeds and timestamps), so the committed files can be checked for drift.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "investigations",
        parents=parents,
        help="regenerate the investigations/ sample databases (3-node cluster, one straggler)",
        description="Generate the deterministic sample databases of a 3-node training cluster where "
        "gpu-node-01 is the straggler, per node and merged.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.add_argument("-o", "--out", metavar="DIR", required=True, help="directory to write the databases into")
    add_output_args(p, csv_ok=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ingero.demo.investigations import generate
    from ingero.errors import StoreError
    from ingero.store.db import open_readonly, summarize

    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise StoreError(f"{out} is not a directory", hint="pass --out DIR")
    written = generate(out)
    rows: list[dict[str, Any]] = []
    for name, path in written.items():
        conn = open_readonly(path)
        try:
            s = summarize(conn, path)
        finally:
            conn.close()
        rows.append(
            {"name": name, "path": str(path), "events": s.events, "chains": s.chains, "bytes": path.stat().st_size}
        )
    if args.format == "json":
        emit_json({"out": str(out), "files": rows})
        return 0
    for r in rows:
        print(f"{r['path']}: {r['events']:,} events, {r['chains']} chain(s), {r['bytes'] / 1e6:.2f} MB")
    note("explain them: ingero explain --db " + str(written["cluster"]))
    return 0
