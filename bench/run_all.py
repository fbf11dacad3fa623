"""Run every benchmark in bench/ one after another (``make bench``); extra arguments go to each.

Benchmarks print measured figures next to their targets as ratios taken side by side in one run; they
never fail the build. ``--quick`` asks each for a short smoke run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).resolve().parent
    failed = []
    for bench in sorted(here.glob("bench_*.py")):
        print(f"\n=== {bench.name} ===", flush=True)
        proc = subprocess.run([sys.executable, str(bench), *sys.argv[1:]], check=False)
        if proc.returncode != 0:
            failed.append(bench.name)
    if failed:
        print(f"\nbenchmarks that did not run to completion: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
