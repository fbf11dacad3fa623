"""``ingero trace --inference`` scraping cost (issue 22): the agent's CPU for 4 engines at 1 s.

Four stand-in engines run as their own processes, with the engines' command lines (two ``vllm serve``,
two ``-m sglang.launch_server``) and a full page each (vLLM's histogram and counter families: ~500
samples, tests/engine_standin.py), their values moving at every scrape. In this process, side by side
on the same trio loop and for the same wall time:

  floor      the loop waking once a second and doing nothing
  scraping   :class:`ingero.agent.trace.engine_scrape.Scraper` at 1 s (detection every 5 s over /proc, each
             engine fetched and parsed in a worker thread on its own clock, change-only rows handed to a sink)

Target: (scraping - floor) CPU ≤ 0.5 % of one core, at rest (after a 3 s warm-up, reported apart). The run must have scraped every engine at every
tick (no failure), and stored rows; else the figure is a MISS. ``--quick``: 5 s each, no verdict.

    .venv/bin/python bench/bench_inference.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from verdict import Target, no_verdict, summary, verdict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ingero.agent.trace.engine_scrape import Scraper  # noqa: E402
from ingero.store.engine_metrics import EngineMetricRow  # noqa: E402
from tests.engine_standin import free_port, launcher  # noqa: E402

COST = Target(0.5, " % of a core", fmt="{:.3f}")
WARMUP_S = 3.0
ENGINES = 4


def cpu_over(seconds: float, work: Scraper | None) -> tuple[float, float]:
    """CPU seconds this process used over ``seconds`` of wall time, scraping with ``work`` or idling,
    after a warm-up of :data:`WARMUP_S` (first imports, the client, the first parse of every page); and
    the warm-up's own CPU seconds."""

    async def idle() -> None:
        await trio.sleep_forever()

    async def main() -> tuple[float, float]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(work.run if work is not None else idle)
            c0 = time.process_time()
            await trio.sleep(WARMUP_S)
            c1 = time.process_time()
            await trio.sleep(seconds)
            c2 = time.process_time()
            nursery.cancel_scope.cancel()
        return c2 - c1, c1 - c0

    return trio.run(main)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 s each, figures only")
    args = ap.parse_args()
    seconds = 5.0 if args.quick else 30.0
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        vllm, sgl = launcher(Path(tmp), "vllm"), launcher(Path(tmp), "launch")
        try:
            for i in range(ENGINES):
                port = str(free_port())
                argv = (
                    [str(vllm), "serve", "m", "--port", port]
                    if i % 2 == 0
                    else [str(sgl), "-m", "sglang.launch_server", "--port", port, "--engine", "sglang"]
                )
                procs.append(subprocess.Popen([*argv, "--full-page"], stdout=subprocess.PIPE))
            for p in procs:
                assert p.stdout is not None
                p.stdout.readline()  # serving
            rows = [0]

            def sink(batch: list[EngineMetricRow]) -> bool:
                rows[0] += len(batch)
                return True

            scraper = Scraper(sink)
            floor, _ = cpu_over(seconds, None)
            busy, start = cpu_over(seconds, scraper)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    pct = max(0.0, busy - floor) / seconds * 100
    ticks = int(seconds + WARMUP_S)
    print(
        f"floor {floor * 1000:.1f} ms CPU, scraping {busy * 1000:.1f} ms CPU over {seconds:.0f} s "
        f"(after a {WARMUP_S:.0f} s warm-up that took {start * 1000:.0f} ms CPU: imports, client, first parses)"
    )
    print(
        f"engines {len(scraper.engines)}, scrapes {scraper.scrapes} (of ~{ENGINES * ticks}), errors {scraper.errors}, "
        f"rows {rows[0]:,} ({rows[0] / max(1, scraper.scrapes):.0f} a scrape)"
    )
    complete = len(scraper.engines) == ENGINES and scraper.errors == 0 and scraper.scrapes >= ENGINES * (ticks - 1)
    detail = f"{scraper.scrapes} scrapes, {scraper.errors} errors"
    if args.quick:
        no_verdict("scrape cost, 4 engines at 1 s", pct, COST, "quick run", detail=detail)
    else:
        verdict("scrape cost, 4 engines at 1 s", pct, COST, complete=complete, detail=detail)
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
