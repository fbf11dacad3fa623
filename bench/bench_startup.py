"""CLI start-up (issues 13, 21): ``ingero --help``, process start → first network byte, a query to a refused node.

Run: ``.venv/bin/python bench/bench_startup.py [--runs 7] [--quick]``. Best of N wall times, each a fresh
process whose exit status and output are checked (a crash at import is not a fast start):

  python          ``python -c pass`` — the interpreter alone (not ours, for scale)
  floor           ``python -c "import trio, ssl, httpx"`` — what any trio + TLS + httpx client pays
                  before its first byte; must exit 0
  --help          ``ingero --help``: exit 0 and a usage text                        target ≤ 100 ms
  first byte      ``ingero query --nodes HOST:PORT`` (mTLS flags) from ``Popen`` until the bench's
                  listening socket receives the TLS ClientHello's first byte        target ≤ 100 ms
  refused         ``ingero query --nodes 127.0.0.1:<closed>``, start to exit: must exit with
                  NoNodeAnsweredError's status and end on one ``ingero: error: ...`` line naming the
                  refusal                                                           target ≤ 1.25x floor

The absolute targets are printed beside the floor: on a loaded machine (load average above the core
count) every figure, the floor included, grows together; the refused query is judged against the floor
measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench_fleet import make_pki, tls_flags
from verdict import Runs, Target, summary, verdict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ingero.errors import NoNodeAnsweredError  # noqa: E402

PY = sys.executable
INGERO = [PY, "-m", "ingero"]
HELP_TARGET = Target(100, " ms", fmt="{:.0f}")
FIRST_BYTE_TARGET = Target(100, " ms", fmt="{:.0f}")
REFUSED_TARGET = Target(1.25, "x")  # ÷ the floor, same run
REFUSED_EXIT = NoNodeAnsweredError.exit_code
ERROR_PREFIX = "ingero: error: "

Check = Callable[[subprocess.CompletedProcess[str]], str]  # "" when the outcome is the expected one
ENV = {k: v for k, v in os.environ.items() if k != "INGERO_CONFIG"}  # HOME is set to a temp dir in main()


def expect_ok(proc: subprocess.CompletedProcess[str], needle: str = "") -> str:
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {last_line(proc.stderr)}"
    return f"no {needle!r} in its output" if needle not in proc.stdout else ""


def expect_refused(proc: subprocess.CompletedProcess[str]) -> str:
    """The documented outcome of a query whose only node refuses: exit status and one error line."""
    line = last_line(proc.stderr)
    if proc.returncode != REFUSED_EXIT:
        return f"exit {proc.returncode}, expected {REFUSED_EXIT}: {line}"
    if not line.startswith(ERROR_PREFIX) or "refused" not in line:
        return f"unexpected error line: {line!r}"
    return ""


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def best_wall(argv: list[str], runs: int, check: Check = expect_ok) -> Runs:
    timing = Runs()
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, check=False)
        timing.add(time.perf_counter() - t0, check(proc))
    return timing


def first_byte(argv_for_port: list[str], listener: socket.socket, runs: int) -> Runs:
    """Popen → the first byte the client sends arrives at ``listener`` (a client that dies first: a problem)."""
    timing = Runs()
    listener.settimeout(0.2)
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv_for_port, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        got, problem = None, ""
        while got is None and not problem:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                if proc.poll() is not None:
                    problem = f"exited {proc.returncode} before connecting"
                elif time.perf_counter() - t0 > 30:
                    problem = "no connection within 30 s"
                continue
            with conn:
                conn.settimeout(30)
                got = conn.recv(1)
                problem = "" if got else "connected but sent nothing"
        seconds = time.perf_counter() - t0
        proc.kill()
        _, err = proc.communicate()
        timing.add(seconds, f"{problem}: {last_line(err.decode())}" if problem else "")
    return timing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="fresh processes per figure (best taken)")
    ap.add_argument("--quick", action="store_true", help="3 runs per figure (same targets: per-process figures)")
    args = ap.parse_args()
    runs = 3 if args.quick else args.runs
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as listener:
        make_pki(Path(tmp) / "pki")
        tls = tls_flags(Path(tmp) / "pki")
        ENV["HOME"] = tmp  # no user config file: nodes and TLS from the flags only
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        query = [*INGERO, "query", *tls, "SELECT 1", "--nodes"]
        python = best_wall([PY, "-c", "pass"], runs)
        floor = best_wall([PY, "-c", "import trio, ssl, httpx"], runs)
        helps = best_wall([*INGERO, "--help"], runs, partial(expect_ok, needle="usage: ingero"))
        byte = first_byte([*query, f"127.0.0.1:{port}"], listener, runs)
        refused = best_wall([*query, f"127.0.0.1:{closed}"], runs, expect_refused)
    print(f"CLI start-up, best of {runs} fresh processes; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"  python -c pass                {python.best * 1000:6.0f} ms   [{python.detail}]")
    print(f"  floor: import trio, ssl, httpx {floor.best * 1000:5.0f} ms   [{floor.detail}]")
    verdict("ingero --help", helps.best * 1000, HELP_TARGET, complete=helps.complete, detail=helps.detail)
    verdict(
        "start → first network byte", byte.best * 1000, FIRST_BYTE_TARGET, complete=byte.complete, detail=byte.detail
    )
    verdict(
        "query to a refused node ÷ floor",
        refused.best / floor.best,
        REFUSED_TARGET,
        complete=refused.complete and floor.complete,
        detail=f"{refused.best * 1000:.0f} ms vs {floor.best * 1000:.0f} ms; {refused.detail}",
    )
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
