"""Run every benchmark in bench/ one after another (``make bench``).

Benchmarks print measured figures next to their targets as ratios taken side by side in one run, each
judged by :mod:`verdict` (ok / MISS / no verdict). Their exit status says how the run went: 0 every
verdict ok, :data:`verdict.EXIT_MISS` some verdict missed, anything else a crash. A MISS is a result;
a crash is not, so this script exits non-zero only when some benchmark crashed.

``--quick`` asks for a short smoke run from every benchmark that takes it: a benchmark takes it when
its own argparse declares ``--quick`` (read from its source, not guessed); the others run as they are.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time
from pathlib import Path

from verdict import EXIT_MISS

HERE = Path(__file__).resolve().parent
BENCHES = sorted(HERE.glob("bench_*.py"))  # bench_diagnosis.py among them once it exists


def takes_quick(bench: Path) -> bool:
    """Whether ``bench`` declares ``--quick`` in an ``add_argument`` call (its argparse is the declaration)."""
    for node in ast.walk(ast.parse(bench.read_text(), str(bench))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and any(isinstance(a, ast.Constant) and a.value == "--quick" for a in node.args)
        ):
            return True
    return False


def outcome(rc: int) -> str:
    """0 claims nothing beyond "no verdict missed" (a quick run may judge nothing)."""
    return "no MISS" if rc == 0 else "MISS" if rc == EXIT_MISS else f"CRASH (exit status {rc})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short smoke run of every benchmark that takes it")
    ap.add_argument("only", nargs="*", help="run only these benchmarks (names, with or without .py)")
    args = ap.parse_args()
    wanted = {Path(n).stem for n in args.only}
    results: list[tuple[str, str, float]] = []
    for bench in BENCHES:
        if wanted and bench.stem not in wanted:
            continue
        quick = args.quick and takes_quick(bench)
        print(f"\n=== {bench.name}{' --quick' if quick else ''} ===", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, str(bench), *(["--quick"] if quick else [])], check=False).returncode
        results.append((bench.name, outcome(rc), time.monotonic() - t0))
    print("\nbenchmark                    outcome")
    for name, what, secs in results:
        print(f"  {name:<28} {what}   ({secs:.0f} s)")
    crashed = [name for name, what, _ in results if what.startswith("CRASH")]
    if crashed:
        print(f"crashed (no verdict from them): {', '.join(crashed)}")
    return 1 if crashed else 0


if __name__ == "__main__":
    raise SystemExit(main())
