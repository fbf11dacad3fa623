"""``explain --by step`` speed (issue 22), as ratios measured side by side in one run.

A 1,000-step labelled training loop (the ledger tests' loop, written by the StoreWriter: 10 iterations
— micro-batches — a step, one pid-scoped span per step, three steps slowed by 30 ms DataLoader waits), then, best of N, alternating:

  by-step          :func:`ingero.explain.by_label.by_label`: one frame load, each GPU thread's gaps
                   painted once at every span edge, each span's buckets by cumulative sums
  explain          the whole window's explain (what a user runs beside it)
  per-span ledgers the ledger built anew on each span's slice of the loaded frame (the naive path)

Targets on 1,000 steps: by-step / explain ≤ 1.25x (both are one frame load — two thirds of either here
— and one painting of each GPU thread's gaps; by-step adds 1,000 labels' reads and sums where explain
runs its rules: about one explain, whatever the number of steps); by-step / per-span ledgers ≤ 0.25x (the naive path
loads nothing either: the ratio is the per-span work alone). The three slow steps must come out as the
three outliers, each with its cause, and no other step with one; else the figures are a MISS.
``--quick``: 200 steps, no verdict.

    .venv/bin/python bench/bench_by_label.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from verdict import Target, no_verdict, summary, verdict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ingero.annotate import AnnotationLine  # noqa: E402
from ingero.explain.by_label import by_label  # noqa: E402
from ingero.explain.engine import explain  # noqa: E402
from ingero.explain.frame_load import load_frames  # noqa: E402
from ingero.explain.hugepages import prefer_small_pages  # noqa: E402
from ingero.explain.ledger import build_ledger  # noqa: E402
from ingero.explain.memory_policy import one_shot  # noqa: E402
from ingero.explain.offcpu import OffCpu  # noqa: E402
from ingero.store.annotations import write_lines  # noqa: E402
from ingero.store.db import open_readonly  # noqa: E402
from tests.test_explain_ledger import PID, Loop, workers  # noqa: E402

VS_EXPLAIN = Target(1.25, "x")
VS_PER_SPAN = Target(0.25, "x")
ROUNDS = 5
MICRO = 10  # loop iterations a labelled step (micro-batches of gradient accumulation): ~90 events a step


def build(path: Path, steps: int) -> set[str]:
    lp = Loop(22)
    bad = {steps // 5, steps // 2, steps - 7}
    edges = []
    for i in range(steps):
        t0 = lp.t
        if i in bad:
            workers(lp, 0.03)
        for _ in range(MICRO):
            lp.step()
        edges.append((i, lp.rec.ts(t0), lp.rec.ts(lp.t)))
    lp.write(path)
    write_lines(path, [AnnotationLine(a, {"step": str(i)}, PID, 0, a, b) for i, a, b in edges], node=lp.rec.node)
    return {str(i) for i in bad}


def per_span(conn: object, spans: list[tuple[int, int]]) -> int:
    """The naive path: the frame loaded once, a ledger built on each span's slice."""
    fr = next(iter(load_frames(conn, None).values()))  # type: ignore[arg-type]
    n = 0
    for a, b in spans:
        part = fr.select((fr.ts_ns >= a) & (fr.ts_ns < b))
        n += len(build_ledger(part, part.select(part.gpu_mask()), OffCpu(part.args)).rows)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 steps, figures only")
    args = ap.parse_args()
    prefer_small_pages()  # as the CLI and the agent do (ingero.explain.hugepages)
    one_shot()  # as the CLI does (ingero.explain.memory_policy)
    steps = 200 if args.quick else 1000
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "steps.db"
        bad = build(path, steps)
        conn = open_readonly(path)
        try:
            spans = [(int(r[0]), int(r[1])) for r in conn.execute("SELECT span_start, span_end FROM annotations")]
            times: dict[str, list[float]] = {"by-step": [], "explain": [], "per-span": []}
            found: set[str] = set()
            clean = True
            for _ in range(ROUNDS):
                t = time.perf_counter()
                r = by_label(conn, "step")
                times["by-step"].append(time.perf_counter() - t)
                found = {v.value for v in r.values if v.cause == "asleep_workers"}
                clean = all(v.cause is None for v in r.values if v.value not in bad) and len(r.values) == steps
                t = time.perf_counter()
                explain(conn)
                times["explain"].append(time.perf_counter() - t)
                t = time.perf_counter()
                per_span(conn, spans)
                times["per-span"].append(time.perf_counter() - t)
        finally:
            conn.close()
    best = {k: min(v) for k, v in times.items()}
    for k, v in best.items():
        print(f"{k:>10}: {v * 1000:8.1f} ms (best of {ROUNDS}, {steps:,} steps)")
    ok = found == bad and clean
    detail = f"outliers found {sorted(found, key=int)} of {sorted(bad, key=int)}" + (
        "" if clean else ", causes on healthy steps"
    )
    if args.quick:
        no_verdict("by-step / explain", best["by-step"] / best["explain"], VS_EXPLAIN, "quick run")
        no_verdict("by-step / per-span ledgers", best["by-step"] / best["per-span"], VS_PER_SPAN, "quick run")
    else:
        verdict("by-step / explain", best["by-step"] / best["explain"], VS_EXPLAIN, complete=ok, detail=detail)
        verdict(
            "by-step / per-span ledgers", best["by-step"] / best["per-span"], VS_PER_SPAN, complete=ok, detail=detail
        )
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
