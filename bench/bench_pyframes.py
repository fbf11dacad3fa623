"""Cost of Python frames in stored stacks, side by side in one run (no root needed for own children).

A CPython child (this interpreter) sits in step() inside a thread; for each round, one stack row is
built for that thread N times with a fresh symbolizer per row (the worst case: every stored stack
new) without Python frames, then with them. Printed: µs per row each way and the ratio, plus the
cost of reading a thread's Python frames alone (code objects cached, as in a trace).
The traced call itself never pays for this: frames are read by the drain thread, once per new stack.

usage: .venv/bin/python bench/bench_pyframes.py [--rows N] [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ingero.agent.trace.pyframes import PyFrames, PyProcess  # noqa: E402
from ingero.agent.trace.stacks import Symbolizer, stack_row  # noqa: E402

CHILD = """
import sys, threading
ready = threading.Event()
def step():
    ready.set()
    threading.Event().wait()
def train():
    step()
t = threading.Thread(target=train, daemon=True)
t.start()
ready.wait()
print(t.native_id, flush=True)
sys.stdin.readline()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="200 rows, 3 rounds (no target here: figures only)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.rounds = 200, 3
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    tid = int(child.stdout.readline())
    libc = ctypes.CDLL(None)
    ip = ctypes.cast(libc.getpid, ctypes.c_void_p).value or 0
    ips = [ip + i for i in range(8)]  # an 8-frame native stack in libc
    pid = child.pid
    try:
        plain: list[float] = []
        python: list[float] = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.rows):
                stack_row(pid, ips, Symbolizer(), tid)
            plain.append((time.perf_counter() - t0) / args.rows * 1e6)
            t0 = time.perf_counter()
            for _ in range(args.rows):
                stack_row(pid, ips, Symbolizer(python=PyFrames()), tid)
            python.append((time.perf_counter() - t0) / args.rows * 1e6)
        proc = PyProcess(pid)
        t0 = time.perf_counter()
        for _ in range(args.rows):
            frames = proc.frames(tid)
        walk_us = (time.perf_counter() - t0) / args.rows * 1e6
        proc.close()
    finally:
        child.kill()
        child.wait()
    p, q = statistics.median(plain), statistics.median(python)
    print(f"stack row, new process + new stack each time: native only {p:8.1f} µs   with Python frames {q:8.1f} µs")
    print(f"ratio (with / without, per new stored stack): {q / p:.2f}x")
    print(f"reading one thread's {len(frames)} Python frames (process found, codes cached): {walk_us:.1f} µs")


if __name__ == "__main__":
    main()
