"""Calls a libcudart's cudaDeviceSynchronize through ctypes from a named Python function, for about
a second (the test library's sleeps 3 ms: the thread is inside step() nearly all the time).

usage: python cudart_pyframes.py /path/to/libcudart.so.12 SECONDS
prints "ready", waits for a line on stdin, calls step() in a loop for SECONDS, prints
"done <calls> <line of the call in step>" and exits.
"""

import ctypes
import sys
import time

lib = ctypes.CDLL(sys.argv[1])


def step() -> int:
    return int(lib.cudaDeviceSynchronize())  # CALL_LINE


def train(seconds: float) -> int:
    calls = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        step()
        calls += 1
    return calls


print("ready", flush=True)
sys.stdin.readline()
n = train(float(sys.argv[2]))
with open(__file__) as source:
    line = next(i for i, text in enumerate(source, 1) if text.rstrip().endswith("# CALL_LINE"))
print(f"done {n} {line}", flush=True)
