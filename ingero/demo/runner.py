"""Running a demo scenario: synthesise → write a real database → explain → store the chains.

Playback pacing (``speed``):

* ``None`` (the default, ``--speed max``): everything is written at once with a fixed base timestamp
  (2026-04-20T09:00:00Z), so a run is deterministic to the byte and takes well under a second.
* ``X > 0``: the trace is *played back* as if it were being recorded now, X times faster than real
  time: events are stamped from the current wall clock and written in half-second slices of trace
  time, each slice no earlier than its due time / X. The session stays open during playback, so the
  database is live (another terminal can ``ingero query`` or ``ingero explain --since 10s`` it), and a
  progress line per slice goes to ``progress``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ingero.demo.scenarios import SCENARIOS, Scenario
from ingero.demo.synth import SyntheticNode
from ingero.errors import UsageError
from ingero.explain.engine import ExplainReport, explain
from ingero.store.catalog import CUDA, DRIVER
from ingero.store.db import open_readonly
from ingero.store.writer import StoreWriter
from ingero.timeutil import NS_PER_S, now_ns, parse_time

BASE_NS = parse_time("2026-04-20T09:00:00Z")
DEFAULT_SEED = 7
SLICE_S = 0.5


@dataclass
class DemoRun:
    scenario: Scenario
    db: Path
    events: int
    report: ExplainReport


def get_scenario(name: str) -> Scenario:
    sc = SCENARIOS.get(name)
    if sc is None:
        raise UsageError(f"unknown scenario {name!r}", hint="choose one of: " + ", ".join(SCENARIOS))
    return sc


def run_scenario(
    name: str,
    db: Path,
    *,
    speed: float | None = None,
    seed: int = DEFAULT_SEED,
    progress: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> DemoRun:
    """Write scenario ``name`` into ``db`` (replacing it), explain it, store the chains."""
    sc = get_scenario(name)
    if speed is not None and speed <= 0:
        raise UsageError(f"--speed {speed}: must be positive (or 'max')")
    for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        p.unlink(missing_ok=True)
    if speed is None:
        rec = sc.build(BASE_NS, seed)
        n = rec.write(db)
    else:
        rec = sc.build(now_ns(), seed)
        n = _play(rec, db, speed, progress or (lambda _m: None), sleep)
    conn = open_readonly(db)
    try:
        report = explain(conn)
    finally:
        conn.close()
    with StoreWriter(db, rec.identity()) as w:
        w.save_chains([c.as_row() for c in report.chains])
    return DemoRun(sc, db, n, report)


def _play(
    rec: SyntheticNode, db: Path, speed: float, progress: Callable[[str], None], sleep: Callable[[float], None]
) -> int:
    snaps = sorted(rec.snapshots)
    written = 0
    wall0 = time.monotonic()
    with StoreWriter(db, rec.identity()) as w:
        sid = w.start_session(rec.session, started_at=rec.base_ns)
        w.write_batch(process_names=[(p, nm, seen) for p, (nm, seen) in sorted(rec.names.items())])
        w.write_batch(stacks=[(h, ips, fr) for h, (ips, fr) in sorted(rec.stacks.items())])
        for t_s, rows in rec.slices(SLICE_S):
            due = t_s / speed - (time.monotonic() - wall0)
            if due > 0:
                sleep(due)
            cutoff = rec.base_ns + round(t_s * NS_PER_S)
            batch_snaps = [s for s in snaps if s[0] < cutoff]
            snaps = snaps[len(batch_snaps) :]
            written += w.write_batch(rows, snapshots=batch_snaps)
            slow = max((r[5] for r in rows if r[3] in (CUDA, DRIVER)), default=0)
            progress(f"[{t_s:5.1f}s] {written:,} events written; slowest GPU call in this slice {slow / 1e6:.1f} ms")
        w.write_batch(snapshots=snaps, aggregates=rec.aggregates())
        w.end_session(sid, {"events_seen": written, "events_stored": written})
    return written
