"""The yardstick of explain's speed benchmarks (bench_explain.py, recurring_incidents.py): the ``sqlite3``
shell fetching, from the same database, exactly the ``events`` columns explain reads — found by running
explain once under an SQLite authorizer that records every column it reads (so the baseline follows
explain, never a hand-kept list) — and functions timed side by side, taking turns."""

from __future__ import annotations

import math
import resource
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingero.explain.engine import explain


def columns_read(conn: sqlite3.Connection) -> list[str]:
    """The ``events`` columns one explain reads, in table order (recorded by an SQLite authorizer)."""
    seen: set[str] = set()

    def authorize(action: int, table: str | None, column: str | None, *_: object) -> int:
        if action == sqlite3.SQLITE_READ and table == "events" and column:
            seen.add(column)
        return sqlite3.SQLITE_OK

    conn.set_authorizer(authorize)
    try:
        explain(conn)
    finally:
        conn.set_authorizer(None)
    return [str(r[1]) for r in conn.execute("PRAGMA table_info(events)") if r[1] in seen]


def sqlite3_fetch(db: Path, columns: list[str]) -> None:
    """The ``sqlite3`` shell fetching ``columns`` of every event (output discarded)."""
    sql = f"SELECT {', '.join(columns)} FROM events"
    subprocess.run(["sqlite3", "-readonly", str(db), sql], stdout=subprocess.DEVNULL, check=True)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall time and best CPU time of each function over ``repeat`` rounds, the functions taking turns
    within a round (a machine whose load drifts shifts them all alike, so their ratios hold). CPU time:
    this process's (every thread) plus its children's (the ``sqlite3`` shell)."""
    wall = dict.fromkeys(fns, math.inf)
    cpu = dict.fromkeys(fns, math.inf)
    for _ in range(repeat):
        for name, fn in fns.items():
            c, t = time.process_time() + children_cpu(), time.perf_counter()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t)
            cpu[name] = min(cpu[name], time.process_time() + children_cpu() - c)
    return wall, cpu
